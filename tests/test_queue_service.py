"""The queue in-process: its HTTP app, dispatcher and runner over a SQLite store, with FakeHeadroom
for the agents and scripted engines, so each contract and rule runs in a second or two.

The engines here answer when the test says so; FakeHeadroom grants through the agent's own ledger.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from waiting import PATIENCE_S, until_async

from kvgate.agent.in_process import FakeHeadroom
from kvgate.config import parse_config
from kvgate.headroom.snapshot import TenantCharge
from kvgate.queue.engines import EngineFailure
from kvgate.queue.intake import Assessed, Intake
from kvgate.queue.jobs import JobRequest
from kvgate.queue.live import Head
from kvgate.queue.service import QueueService

T = TypeVar("T")
CHAT = "/v1/chat/completions"
QUEUE_CONFIG = "headroom: {agents: ['fake:1']}\n"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), 3 * PATIENCE_S))


@dataclass
class Call:
    job_id: str
    endpoint: str
    request: JobRequest
    answer: asyncio.Future[tuple[int, bytes] | None] = field(default_factory=asyncio.Future)


class _Answer:
    def __init__(self, head: Head, body: bytes) -> None:
        self.head = head
        self._body = body

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self._body


class ScriptedEngines:
    """Engines that answer each call when the test resolves it: (status, body), or None to drop it."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._arrived = asyncio.Event()

    @asynccontextmanager
    async def send(
        self, endpoint: str, request: JobRequest, headers: Mapping[str, str]
    ) -> AsyncIterator[_Answer]:
        call = Call(headers["x-kvgate-job-id"], endpoint, request)
        self.calls.append(call)
        self._arrived.set()
        answer = await call.answer
        if answer is None:
            raise EngineFailure(f"engine {endpoint} dropped the connection")
        yield _Answer(Head(answer[0], "application/json"), answer[1])

    async def wait_calls(self, count: int, timeout_s: float = PATIENCE_S) -> list[Call]:
        deadline = time.monotonic() + timeout_s
        while len(self.calls) < count:
            assert time.monotonic() < deadline, f"{len(self.calls)} engine calls, waited for {count}"
            self._arrived.clear()
            with suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._arrived.wait()
        return self.calls

    def running(self) -> list[Call]:
        return [c for c in self.calls if not c.answer.done()]

    def answer(self, call: Call, status: int = 200) -> None:
        call.answer.set_result((status, json.dumps({"job": call.job_id}).encode()))


@dataclass
class Queue:
    service: QueueService
    server: TestServer
    client: aiohttp.ClientSession
    source: FakeHeadroom
    engines: ScriptedEngines

    async def post(self, tokens: int, **headers: str) -> aiohttp.ClientResponse:
        all_headers = {"x-kvgate-tokens": str(tokens), **{k.replace("_", "-"): v for k, v in headers.items()}}
        return await self.client.post(self.server.make_url(CHAT), data=BODY, headers=all_headers)

    async def defer(self, tokens: int, **headers: str) -> str:
        response = await self.post(tokens, prefer="respond-async", **headers)
        assert response.status == 202, await response.text()
        job_id: str = (await response.json())["id"]
        return job_id

    async def job(self, key: str, tenant: str = "anonymous") -> dict[str, Any]:
        url = self.server.make_url(f"/v1/kvgate/jobs/{key}")
        response = await self.client.get(url, headers={"x-kvgate-tenant": tenant})
        found: dict[str, Any] = await response.json()
        return found

    async def job_in(self, key: str, *states: str, tenant: str = "anonymous") -> dict[str, Any]:
        """The job once it is in one of `states` (it may not be recorded yet)."""

        async def reached() -> dict[str, Any] | None:
            found = await self.job(key, tenant)
            return found if found.get("status") in states else None

        return await until_async(reached, f"job {key} {' or '.join(states)}")


@asynccontextmanager
async def queue(
    tmp_path: Path, queue_yaml: str = "", capacity: int = 10_000, config_yaml: str = ""
) -> AsyncIterator[Queue]:
    config = parse_config(f"{QUEUE_CONFIG}queue: {{{queue_yaml}}}\n{config_yaml}")
    source = FakeHeadroom(time.monotonic, stale_after_s=3600)
    source.add_node("node-a", capacity)
    engines = ScriptedEngines()
    service = QueueService(
        config, f"sqlite:///{tmp_path / 'queue.db'}", "replica-1", source=source, engines=engines
    )
    await service.start()
    server = TestServer(service.app())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            yield Queue(service, server, client, source, engines)
    finally:
        await server.close()
        await service.stop()


async def tenant_of(q: Queue, call: Call) -> str:
    """Whose job the engine runs (read in the store: the API answers only the job's own tenant)."""
    async with q.service.jobs.database.transaction() as tx:
        ((tenant,),) = await tx.execute("SELECT tenant FROM kvgate_jobs WHERE id = ?", (call.job_id,))
    return str(tenant)


async def next_call(q: Queue, after: int) -> Call:
    """The one call running once `after` calls were made."""
    await q.engines.wait_calls(after + 1)
    (running,) = q.engines.running()
    return running


def test_held_request_is_answered_with_the_engines_answer_once_a_node_has_room(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            q.source.update("node-a", used_tokens=9_000)  # the node is busy: the job must wait
            held = asyncio.ensure_future(q.post(8000, x_request_id="req-held"))
            await q.job_in("req-held", "queued")
            assert q.engines.calls == []
            q.source.update("node-a", used_tokens=0)
            (call,) = await q.engines.wait_calls(1)
            assert call.endpoint == "node-a.engine:8000" and call.request.body == BODY
            assert q.source.reserved_tokens("node-a") == 8000  # the job runs on its reservation
            q.engines.answer(call)
            response = await held
            assert response.status == 200 and await response.json() == {"job": call.job_id}
            assert response.headers["x-kvgate-job-id"] == call.job_id
            await until_async(
                lambda: q.source.reserved_tokens("node-a") == 0, "release once the answer ended"
            )

    run(scenario)


def test_a_reserve_granted_but_unanswered_is_given_back_and_the_job_runs_on_the_next(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            q.source.fail_reserves("node-a", granted=True)
            held = asyncio.ensure_future(q.post(8000, x_request_id="req-late"))
            (call,) = await q.engines.wait_calls(1)
            assert [node for node, _ in q.source.released] == ["node-a"], "the lost grant was given back"
            assert q.source.reserved_tokens("node-a") == 8000, "and the job runs on a grant of its own"
            q.engines.answer(call)
            assert (await held).status == 200

    run(scenario)


def test_deferred_request_gets_202_a_job_url_and_its_answer_when_done(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            q.source.update("node-a", used_tokens=9_000)
            response = await q.post(8000, prefer="respond-async, wait=5", x_kvgate_tenant="acme")
            assert response.status == 202
            assert response.headers["preference-applied"] == "respond-async"
            job = await response.json()
            assert response.headers["location"] == f"/v1/kvgate/jobs/{job['id']}"
            assert (job["status"], job["estimated_tokens"], job["tenant"], job["position"]) == (
                "queued",
                8000,
                "acme",
                0,
            )
            q.source.update("node-a", used_tokens=0)
            (call,) = await q.engines.wait_calls(1)
            assert (await q.job(job["id"], "acme"))["status"] == "running"
            q.engines.answer(call)
            done = await q.job_in(job["id"], "succeeded", "failed", "cancelled", tenant="acme")
            assert done["status"] == "succeeded" and done["attempts"] == 1
            assert done["response"] == {
                "status_code": 200,
                "content_type": "application/json",
                "body": {"job": job["id"]},
            }

    run(scenario)


def test_one_tenant_flooding_delays_another_by_one_more_flood_job_at_most(tmp_path: Path) -> None:
    """The quiet tenant starts level with the flood (lifted to its counter) and, served less in fact,
    goes first on the tie: after the running flood job, turns (kvgate.queue.fairness)."""

    async def scenario() -> None:
        async with queue(tmp_path) as q:
            for _ in range(6):
                await q.defer(8000, x_kvgate_tenant="flood")  # one runs at a time (8k of a 10k node)
            await q.engines.wait_calls(1)
            for _ in range(2):
                await q.defer(8000, x_kvgate_tenant="quiet")
            tenants = []
            for done in range(6):
                running = await next_call(q, done)
                tenants.append(await tenant_of(q, running))
                q.engines.answer(running)
            assert tenants == ["flood", "quiet", "flood", "quiet", "flood", "flood"]

    run(scenario)


@pytest.mark.parametrize(
    ("tenant_class", "expected"),
    [
        ("partners", ["other", "a", "p", "p", "p", "a", "p", "p", "p"]),
        ("no-such-class", ["other", "a", "p", "a", "p", "a", "p", "a", "p"]),
    ],
)
def test_a_jobs_route_class_weighs_its_tenant_in_the_queue(
    tmp_path: Path, tenant_class: str, expected: list[str]
) -> None:
    """Envoy's route table gives a classed route's requests to the queue their class
    (x-kvgate-tenant-class): the queue stores it with the job and weighs the tenant by it (partners:
    weight 3, three jobs for the other tenant's one); a class kvgate.yaml does not have weighs 1."""

    async def scenario() -> None:
        classes = "fairness: {classes: {partners: {weight: 3}}}\n"
        async with queue(tmp_path, config_yaml=classes) as q:
            await q.defer(8000, x_kvgate_tenant="other")  # one runs at a time (8k of a 10k node)
            await q.engines.wait_calls(1)
            for _ in range(6):
                await q.defer(8000, x_kvgate_tenant="a")
                await q.defer(8000, x_kvgate_tenant="p", x_kvgate_tenant_class=tenant_class)
            tenants = []
            for done in range(9):
                running = await next_call(q, done)
                tenants.append(await tenant_of(q, running))
                q.engines.answer(running)
            assert tenants == expected

    run(scenario)


def test_the_queue_orders_tenants_by_the_service_the_agents_count_from_the_gates_too(tmp_path: Path) -> None:
    """A gate's grants to `busy` reach the agent (a Reserve carrying its charge) while the queue's
    jobs wait: the queue runs `idle`'s jobs before `busy`'s older ones; its own dispatches are charged
    on the agent too (kvgate.queue.fairness)."""

    async def scenario() -> None:
        async with queue(tmp_path) as q:
            blocker = await q.defer(8000, x_kvgate_tenant="other")  # one runs at a time (8k of a 10k node)
            await q.engines.wait_calls(1)
            for tenant in ("busy", "busy", "idle", "idle"):
                await q.defer(8000, x_kvgate_tenant=tenant)
            # A gate's grant to busy on another node, as its Reserve reaches that node's agent.
            q.source.add_node("node-b", 100)
            granted = await q.source.reserve(
                "node-b", "gate-grant", 1, charge=TenantCharge("busy", 50_000.0, 2.0)
            )
            assert granted.granted
            await q.source.release("node-b", "gate-grant")
            tenants = []
            for done in range(5):
                running = await next_call(q, done)
                tenants.append(await tenant_of(q, running))
                q.engines.answer(running)
            assert tenants == ["other", "idle", "idle", "busy", "busy"], blocker
            (node_a,) = [n.headroom for n in q.source.snapshot() if n.agent == "node-a"]
            # Charged as the gate charges (prompt + 2 x output budget), not the 8,000 tokens reserved.
            assessed = Intake(parse_config(QUEUE_CONFIG)).assess(CHAT, BODY, "8000")
            assert isinstance(assessed, Assessed) and assessed.charge is not None
            one = assessed.charge.prompt_tokens + 2 * assessed.charge.output_tokens
            assert node_a is not None and node_a.tenant_service["idle"] == 2 * one

    run(scenario)


def test_a_higher_priority_job_runs_before_older_normal_ones(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            first = await q.defer(8000)
            await q.engines.wait_calls(1)
            normal = [await q.defer(8000) for _ in range(2)]
            urgent = await q.defer(8000, x_kvgate_priority="high")
            order = []
            for done in range(4):
                running = await next_call(q, done)
                order.append(running.job_id)
                q.engines.answer(running)
            assert order == [first, urgent, *normal]

    run(scenario)


def test_a_job_bigger_than_every_node_fails_at_once_with_its_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, capacity=10_000) as q:
            for headers in ({}, {"prefer": "respond-async"}):
                response = await q.post(12_000, **headers)
                assert response.status == 413
                assert response.headers["x-kvgate-reason"] == "exceeds_node_capacity"
                error = (await response.json())["error"]
                assert error["code"] == "exceeds_node_capacity" and "12000 tokens" in error["message"]
                assert "admits 10000" in error["message"]
            assert q.engines.calls == []

    run(scenario)


def test_bounds_refuse_with_429_and_the_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, "max_jobs: 2, max_tokens_waiting: 9000, retry_after_s: 7") as q:
            q.source.update("node-a", used_tokens=9_500)  # nothing runs
            await q.defer(6000)
            response = await q.post(5000, prefer="respond-async")
            assert response.status == 429 and response.headers["retry-after"] == "7"
            assert response.headers["x-kvgate-reason"] == "queue_full"
            assert "queue.max_tokens_waiting is 9000" in (await response.json())["error"]["message"]
            await q.defer(1000)
            response = await q.post(10, prefer="respond-async")
            assert response.status == 429
            assert "queue.max_jobs is 2" in (await response.json())["error"]["message"]

    run(scenario)


def test_a_held_request_past_max_hold_gets_429_and_its_job_is_cancelled(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, "max_hold_s: 1, retry_after_s: 3") as q:
            q.source.update("node-a", used_tokens=9_500)
            started = time.monotonic()
            response = await q.post(8000, x_request_id="req-timeout")
            assert time.monotonic() - started >= 1.0
            assert response.status == 429 and response.headers["retry-after"] == "3"
            assert (await response.json())["error"]["code"] == "queue_timeout"
            job = await q.job("req-timeout")
            assert job["status"] == "cancelled" and job["error"]["code"] == "hold_timeout"
            q.source.update("node-a", used_tokens=0)
            await asyncio.sleep(0.3)
            assert q.engines.calls == []

    run(scenario)


def test_a_held_job_that_started_within_the_hold_is_answered_however_long_it_runs(tmp_path: Path) -> None:
    """The hold bounds the wait for a node. A job cancelled at the deadline while its engine ran
    answered 429 for work the engine then threw away, charged to its tenant all the same."""

    async def scenario() -> None:
        async with queue(tmp_path, "max_hold_s: 1") as q:
            held = asyncio.ensure_future(q.post(8000, x_request_id="req-slow"))
            call = await next_call(q, 0)
            await asyncio.sleep(1.2)  # past the hold's deadline while the engine works
            assert not held.done()
            q.engines.answer(call)
            response = await held
            assert response.status == 200
            assert (await q.job("req-slow"))["status"] == "succeeded"

    run(scenario)


def test_delete_cancels_a_waiting_job_and_cuts_a_running_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            running_id = await q.defer(8000)
            waiting_id = await q.defer(8000)
            (call,) = await q.engines.wait_calls(1)
            for job_id in (waiting_id, running_id):
                response = await q.client.delete(q.server.make_url(f"/v1/kvgate/jobs/{job_id}"))
                assert response.status == 200 and (await response.json())["status"] == "cancelled"
            await until_async(call.answer.cancelled, "the running job's engine call cut")
            await until_async(lambda: q.source.reserved_tokens("node-a") == 0, "its reservation released")
            assert len(q.engines.calls) == 1  # the waiting one never ran
            gone = await q.client.get(q.server.make_url("/v1/kvgate/jobs/job_nope"))
            assert gone.status == 404 and (await gone.json())["error"]["code"] == "not_found"

    run(scenario)


def test_a_dropped_engine_call_runs_again_and_the_last_allowed_attempt_fails(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, "max_attempts: 2") as q:
            held = asyncio.ensure_future(q.post(8000))
            first = await next_call(q, 0)
            first.answer.set_result(None)
            second = await next_call(q, 1)
            assert second.job_id == first.job_id
            q.engines.answer(second)
            assert (await held).status == 200
            assert (await q.job(first.job_id))["attempts"] == 2
            doomed = await q.defer(8000)
            for done in (2, 3):
                (await next_call(q, done)).answer.set_result(None)
            job = await q.job_in(doomed, "succeeded", "failed", "cancelled")
            assert job["status"] == "failed" and job["error"]["code"] == "engine_failed"

    run(scenario)


def test_a_client_that_comes_back_with_its_request_id_gets_the_same_job(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            q.source.update("node-a", used_tokens=9_500)
            lost = asyncio.ensure_future(q.post(8000, x_request_id="req-again"))
            await q.job_in("req-again", "queued")
            lost.cancel()  # the client's connection dropped
            again = asyncio.ensure_future(q.post(8000, x_request_id="req-again"))
            q.source.update("node-a", used_tokens=0)
            (call,) = await q.engines.wait_calls(1)
            q.engines.answer(call, status=400)
            response = await again
            # The engine's own answer, error status included; one job, one engine call.
            assert response.status == 400 and await response.json() == {"job": call.job_id}
            assert len(q.engines.calls) == 1

    run(scenario)


def test_a_held_job_whose_client_left_before_it_started_is_cancelled_and_never_runs(tmp_path: Path) -> None:
    """Run for nobody, it would hold a node and be charged to its tenant (kvgate.queue.live)."""

    async def scenario() -> None:
        async with queue(tmp_path, "reattach_s: 0.6") as q:
            lost = await _held_on_a_full_node(q, "req-left")
            lost.cancel()  # the client's connection dropped
            job = await q.job_in("req-left", "cancelled")
            assert job["error"]["code"] == "client_gone"
            q.source.update("node-a", used_tokens=0)
            after = await q.defer(8000)
            (call,) = await q.engines.wait_calls(1)
            assert call.job_id == after

    run(scenario)


def test_a_held_client_that_stays_connected_keeps_its_job_past_the_reattach_window(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, "reattach_s: 0.6") as q:
            held = await _held_on_a_full_node(q, "req-stays")
            first = await _hold_until(q, "req-stays")
            # Renewed twice past its first hold: the window has passed while the client waited.
            await until_async(lambda: _renewed_past(q, "req-stays", first + 1.2), "the hold renewed")
            assert (await q.job("req-stays"))["status"] == "queued"
            q.source.update("node-a", used_tokens=0)
            q.engines.answer((await q.engines.wait_calls(1))[0])
            assert (await held).status == 200

    run(scenario)


async def _held_on_a_full_node(q: Queue, request_id: str) -> asyncio.Future[aiohttp.ClientResponse]:
    """A held request whose job waits in the queue: the node has no room for it."""
    q.source.update("node-a", used_tokens=9_500)
    held = asyncio.ensure_future(q.post(8000, x_request_id=request_id))
    await q.job_in(request_id, "queued")
    return held


async def _hold_until(q: Queue, request_id: str) -> float:
    async with q.service.jobs.database.transaction() as tx:
        ((until,),) = await tx.execute(
            "SELECT expires_at FROM kvgate_jobs WHERE request_id = ?", (request_id,)
        )
    return float(until)


async def _renewed_past(q: Queue, request_id: str, time_s: float) -> bool:
    return await _hold_until(q, request_id) > time_s


def test_requests_the_gate_did_not_estimate_are_estimated_and_refused_as_the_gate_would(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            url = q.server.make_url(CHAT)
            response = await q.client.post(url, data=BODY, headers={"prefer": "respond-async"})
            job = await response.json()
            assert response.status == 202 and 1024 < job["estimated_tokens"] < 1100
            too_long = json.dumps({"model": "m", "messages": [], "max_tokens": 20_000}).encode()
            response = await q.client.post(url, data=too_long, headers={"prefer": "respond-async"})
            assert response.status == 413
            assert (await response.json())["error"]["code"] == "context_length_exceeded"
            response = await q.client.post(url, data=b"{not json", headers={"prefer": "respond-async"})
            assert response.status == 400
            response = await q.client.post(q.server.make_url("/v1/unknown"), data=BODY)
            assert response.status == 404

    run(scenario)
