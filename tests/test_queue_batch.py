"""The Batch API's rules: input files read and checked, lines admitted like requests, batches
settled into output and error files, cancelled, bounded. In-process (see test_queue_service)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
from test_queue_service import CHAT, Queue, next_call, queue, run
from waiting import until_async

from kvgate.queue.batchfile import count_problem, output_files, read_lines, requests_in
from kvgate.queue.jobs import Job, JobError, JobResult, JobState


def line(custom_id: str, max_tokens: int = 8, **changes: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body, **changes}


def jsonl(*lines: dict[str, Any]) -> bytes:
    return "".join(json.dumps(item) + "\n" for item in lines).encode()


def test_a_malformed_input_file_is_refused_with_its_line_numbers() -> None:
    content = jsonl(line("a"), line("a"), line("b", url="/v1/completions"), line("c", method="GET"))
    content += b"not json\n\n" + jsonl({"custom_id": "d", "method": "POST", "url": CHAT, "body": "x"})
    lines, problems = read_lines(content.split(b"\n"), CHAT)
    assert [p.line for p in problems] == [2, 3, 4, 5, 7]
    assert [p.code for p in problems] == [
        "duplicate_custom_id",
        "mismatched_url",
        "invalid_method",
        "invalid_json_line",
        "invalid_body",
    ]
    assert [item.custom_id for item in lines] == ["a"]
    empty = count_problem(requests_in(b"\n \n".split(b"\n")), 100)
    assert empty is not None and empty.code == "empty_file"
    two = requests_in(jsonl(line("a"), line("b")).split(b"\n"))
    assert count_problem(two, 2) is None
    too_many = count_problem(two, 1)
    assert too_many is not None and too_many.code == "too_many_requests"


def test_output_and_error_files_follow_openais_batch_output_format() -> None:
    def ended(n: int, state: JobState, **fields: Any) -> Job:
        return Job(
            f"job_{n}", state, 10, 1, "t", 0.0, custom_id=f"c{n}", line=n, request_id=f"req-{n}", **fields
        )

    jobs = [
        ended(2, JobState.FAILED, result=JobResult(400, "application/json", b'{"error": {"code": "bad"}}')),
        ended(1, JobState.SUCCEEDED, result=JobResult(200, "application/json", b'{"id": "chatcmpl-1"}')),
        ended(3, JobState.FAILED, error=JobError("context_length_exceeded", "too long")),
        ended(4, JobState.EXPIRED, error=JobError("batch_expired", "window closed")),
    ]
    output, errors = output_files(jobs)
    assert [json.loads(x) for x in output.splitlines()] == [
        {
            "id": "batch_req_job_1",
            "custom_id": "c1",
            "response": {"status_code": 200, "request_id": "req-1", "body": {"id": "chatcmpl-1"}},
            "error": None,
        }
    ]
    failed = [json.loads(x) for x in errors.splitlines()]
    assert [f["custom_id"] for f in failed] == ["c2", "c3", "c4"]
    assert failed[0]["response"]["status_code"] == 400 and failed[0]["error"] is None
    assert failed[1]["response"] is None
    assert failed[1]["error"] == {"code": "context_length_exceeded", "message": "too long"}


async def upload(
    q: Queue, content: bytes, purpose: str = "batch", headers: dict[str, str] | None = None
) -> aiohttp.ClientResponse:
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", content, filename="in.jsonl", content_type="application/jsonl")
    return await q.client.post(q.server.make_url("/v1/files"), data=form, headers=headers)


async def create(q: Queue, content: bytes, **headers: str) -> aiohttp.ClientResponse:
    """Upload `content` and make it a batch, both with `headers` (the same tenant's)."""
    uploaded = await (await upload(q, content, headers=headers)).json()
    params = {"input_file_id": uploaded["id"], "endpoint": CHAT, "completion_window": "24h"}
    return await q.client.post(q.server.make_url("/v1/batches"), json=params, headers=headers)


async def batch(q: Queue, batch_id: str) -> dict[str, Any]:
    found: dict[str, Any] = await (await q.client.get(q.server.make_url(f"/v1/batches/{batch_id}"))).json()
    return found


async def ended(q: Queue, batch_id: str) -> dict[str, Any]:
    """The batch once it has ended (completed, failed, cancelled or expired)."""

    async def read() -> dict[str, Any] | None:
        found = await batch(q, batch_id)
        return found if found["status"] in ("completed", "failed", "cancelled", "expired") else None

    return await until_async(read, f"batch {batch_id} to end")


async def content(q: Queue, file_id: str) -> list[dict[str, Any]]:
    response = await q.client.get(q.server.make_url(f"/v1/files/{file_id}/content"))
    return [json.loads(x) for x in (await response.read()).splitlines()]


def test_lines_too_big_for_every_node_or_too_long_go_to_the_error_file_and_the_rest_run(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, capacity=10_000) as q:
            response = await create(q, jsonl(line("ok"), line("big", 12_000), line("long", 20_000)))
            created = await response.json()
            assert response.status == 200 and created["request_counts"]["total"] == 3
            q.engines.answer(await next_call(q, 0))
            done = await ended(q, created["id"])
            assert done["status"] == "completed", done
            assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
            assert [x["custom_id"] for x in await content(q, done["output_file_id"])] == ["ok"]
            errors = {x["custom_id"]: x["error"]["code"] for x in await content(q, done["error_file_id"])}
            assert errors == {"big": "exceeds_node_capacity", "long": "context_length_exceeded"}
            assert len(q.engines.calls) == 1

    run(scenario)


def test_a_malformed_batch_fails_and_runs_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            response = await create(q, jsonl(line("a"), line("a")))
            failed = await response.json()
            assert failed["status"] == "failed" and failed["failed_at"] is not None
            assert failed["errors"]["data"][0]["line"] == 2
            await asyncio.sleep(0.2)
            assert q.engines.calls == []

    run(scenario)


def test_a_cancelled_batch_stops_its_waiting_lines_and_keeps_what_ran(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            created = await (await create(q, jsonl(*(line(f"r{i}", 6000) for i in range(3))))).json()
            running = await next_call(q, 0)  # one at a time: 6,000 of a 10,000-token node
            cancelling = await (
                await q.client.post(q.server.make_url(f"/v1/batches/{created['id']}/cancel"))
            ).json()
            assert cancelling["status"] == "cancelling"
            q.engines.answer(running)
            done = await ended(q, created["id"])
            assert done["status"] == "cancelled" and done["cancelled_at"] is not None
            assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
            errors = await content(q, done["error_file_id"])
            assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
            assert len(q.engines.calls) == 1

    run(scenario)


def test_a_batch_past_the_queues_bounds_is_refused_whole(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, "max_jobs: 2") as q:
            response = await create(q, jsonl(*(line(f"r{i}") for i in range(3))))
            assert response.status == 429 and response.headers["x-kvgate-reason"] == "queue_full"
            listed = await (await q.client.get(q.server.make_url("/v1/batches"))).json()
            assert listed["data"] == [] and listed["has_more"] is False

    run(scenario)


def test_files_are_listed_read_and_deleted_and_bad_requests_say_what_is_wrong(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            assert (await upload(q, b"{}", purpose="fine-tune")).status == 400
            files = [await (await upload(q, jsonl(line(str(i))))).json() for i in range(3)]
            listed = await (await q.client.get(q.server.make_url("/v1/files?purpose=batch&limit=2"))).json()
            assert [f["id"] for f in listed["data"]] == [files[2]["id"], files[1]["id"]] and listed[
                "has_more"
            ]
            after = await (
                await q.client.get(q.server.make_url(f"/v1/files?limit=2&after={listed['last_id']}"))
            ).json()
            assert [f["id"] for f in after["data"]] == [files[0]["id"]] and not after["has_more"]
            deleted = await q.client.delete(q.server.make_url(f"/v1/files/{files[0]['id']}"))
            assert (await deleted.json())["deleted"] is True
            missing = await q.client.get(q.server.make_url(f"/v1/files/{files[0]['id']}/content"))
            assert missing.status == 404
            params = {"input_file_id": files[1]["id"], "endpoint": "/v1/images", "completion_window": "24h"}
            wrong = await q.client.post(q.server.make_url("/v1/batches"), json=params)
            assert (
                wrong.status == 400 and "endpoint must be one of" in (await wrong.json())["error"]["message"]
            )
            unknown = await q.client.get(q.server.make_url("/v1/batches/batch_nope"))
            assert unknown.status == 404

    run(scenario)


def test_a_batchs_lines_take_the_tenant_class_of_the_request_that_created_it(tmp_path: Path) -> None:
    """The route's class (x-kvgate-tenant-class, set by Envoy) is stored with every line's job, so the
    queue weighs the batch's tenant by it; a class kvgate.yaml does not have is stored as none."""

    async def scenario() -> None:
        classes = "fairness: {classes: {partners: {weight: 3}}}\n"
        async with queue(tmp_path, config_yaml=classes) as q:
            for tenant_class in ("partners", "no-such-class"):
                headers = {"x-kvgate-tenant": "acme", "x-kvgate-tenant-class": tenant_class}
                response = await create(
                    q, jsonl(line(f"{tenant_class}-1"), line(f"{tenant_class}-2")), **headers
                )
                assert response.status == 200, await response.text()
            async with q.service.jobs.database.transaction() as tx:
                rows = await tx.execute("SELECT custom_id, tenant_class FROM kvgate_jobs ORDER BY seq")
            assert [tuple(row) for row in rows] == [
                ("partners-1", "partners"),
                ("partners-2", "partners"),
                ("no-such-class-1", None),
                ("no-such-class-2", None),
            ]

    run(scenario)
