"""The queue's three contracts through the real Envoy, the gate, agents and simulated nodes.

Both long-pool nodes are filled with reservations the test holds on their agents, so the gate finds
no room and hands long requests to the async pool, which is `kvgate queue`; once the test lets go,
the queue runs them on a node whose agent reserved for them. Batch API paths never pass the gate:
Envoy routes them (and /v1/kvgate/jobs) to the queue with ext_proc off, as envoy/envoy.yaml does.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from texts import text_with_tokens

from kvgate.config.headroom import HeadroomSettings
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service, kvgate_command, sim_command
from kvgate.harness.stack import agent_process, envoy_process, gate_process, started
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
NODE_TOKENS = 20_000


# Paths the queue serves that the gate must not see: Envoy sends them straight to the async cluster.
@dataclass
class Stack:
    listener: int
    agents: list[int]
    queue: Service


def _sim(stack: ExitStack, tmp: Path, name: str, sp_model: Path) -> Service:
    port = free_port()
    argv = sim_command(
        *("--listen", f"127.0.0.1:{port}", "--node-name", name, "--tokenizer", str(sp_model)),
        *("--kv-capacity-tokens", str(NODE_TOKENS), "--max-model-len", "16384", "--model-name", "test-model"),
        *("--prefill-tokens-per-s", "200000", "--decode-tokens-per-s", "400"),
    )
    service = started(Service(name, argv, tmp, port=port), port)
    stack.callback(service.stop)
    return service


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, sp_model_path: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("queue-e2e")
    with ExitStack() as stack:
        sims = [_sim(stack, tmp, f"node-{i}", sp_model_path) for i in range(2)]
        agents = []
        for i, node in enumerate(sims):
            endpoint = f"127.0.0.1:{node.port}"
            flags = ["--engine-metrics", f"http://{endpoint}/metrics", "--safety-ratio", "1.0"]
            agent = agent_process(tmp, f"agent-{i}", free_port(), endpoint, flags)
            stack.callback(agent.stop)
            agents.append(agent.port)
        agent_list = ", ".join(f"127.0.0.1:{port}" for port in agents)
        config = (
            f"default_model: {{tokenizer: {sp_model_path}}}\n"
            f"headroom: {{agents: [{agent_list}]}}\n"
            # The wait's overflow goes to the queue at once (no holding in the gate: max_hold_s 0).
            "admission: {max_wait_s: 0.2, async_fallback: true, max_hold_s: 0}\n"
            "queue: {max_hold_s: 60}\n"
        )
        (tmp / "queue.yaml").write_text(config)
        queue_port = free_port()
        queue = started(
            Service(
                "queue",
                kvgate_command(
                    "queue",
                    *("--listen", f"127.0.0.1:{queue_port}", "--config", str(tmp / "queue.yaml")),
                    *("--store", f"sqlite:///{tmp / 'queue.db'}", "--metrics-listen", "off"),
                ),
                tmp,
                port=queue_port,
            ),
            queue_port,
        )
        stack.callback(queue.stop)
        ports = {
            "listener": free_port(),
            "gate": free_port(),
            "admin": free_port(),
            "interactive": sims[0].port,
            "long": sims[1].port,
            "async": queue_port,
        }
        rendered = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp / "envoy.yaml", ports)
        envoy = envoy_process(rendered, tmp, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        stack.enter_context(gate_process(config, tmp, ports["gate"]))
        _until_served(ports["listener"], chat(text_with_tokens(sp_model_path, 6000), max_tokens=8))
        yield Stack(ports["listener"], agents, queue)


def _until_served(listener: int, body: bytes) -> None:
    """Until the gate has seen its agents and serves a long request from the long pool itself."""
    deadline = time.monotonic() + 20
    while (reply := post(listener, CHAT, body)).status != 200 or reply.headers.get("x-kvgate-job-id"):
        assert time.monotonic() < deadline, reply
        time.sleep(0.2)


class Blockers:
    """Reservations the test holds on every long-pool agent, leaving each node `free` tokens."""

    def __init__(self, agents: list[int], free: int) -> None:
        self._agents = [f"127.0.0.1:{port}" for port in agents]
        self._free = free

    async def _each(self, reserve: bool) -> None:
        # The test's own calls, not the gate's: a busy CI host can take longer than the gate's 50 ms.
        view = HeadroomView(HeadroomSettings(agents=tuple(self._agents), reserve_timeout_s=10.0))
        await view.start()
        try:
            for agent in self._agents:
                if reserve:
                    outcome = await view.reserve(
                        agent, f"blocker-{agent}", NODE_TOKENS - self._free, lease_s=600
                    )
                    assert outcome.granted, outcome
                else:
                    await view.release(agent, f"blocker-{agent}")
        finally:
            await view.stop()

    def __enter__(self) -> Blockers:
        asyncio.run(self._each(reserve=True))
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()

    def release(self) -> None:
        asyncio.run(self._each(reserve=False))


def in_background(
    listener: int, body: bytes, headers: dict[str, str]
) -> tuple[threading.Thread, list[Reply]]:
    replies: list[Reply] = []
    thread = threading.Thread(target=lambda: replies.append(post(listener, CHAT, body, headers, timeout=90)))
    thread.start()
    return thread, replies


def job(listener: int, key: str) -> dict[str, Any]:
    reply = post(listener, f"/v1/kvgate/jobs/{key}", None)
    assert reply.status in (200, 404), reply
    found: dict[str, Any] = reply.json()
    return found


def until(listener: int, key: str, status: str, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (found := job(listener, key)).get("status") != status:
        assert time.monotonic() < deadline, found
        time.sleep(0.1)
    return found


def test_held_requests_are_answered_on_their_connection_once_a_node_frees(
    stack: Stack, sp_model_path: Path
) -> None:
    long_text = text_with_tokens(sp_model_path, 6000)
    with Blockers(stack.agents, free=2000) as blockers:
        plain, plain_replies = in_background(
            stack.listener, chat(long_text, max_tokens=16), {"x-request-id": "held-plain"}
        )
        streamed, streamed_replies = in_background(
            stack.listener, chat(long_text, max_tokens=16, stream=True), {"x-request-id": "held-stream"}
        )
        queued = [until(stack.listener, key, "queued") for key in ("held-plain", "held-stream")]
        # The gate's estimate came with them (its fast estimate of 6,000 + 4 + 16 tokens, within its band).
        assert all(6000 < j["estimated_tokens"] < 7000 for j in queued), queued
        time.sleep(0.3)
        assert job(stack.listener, "held-plain")["status"] == "queued"  # no node has room
        blockers.release()
        plain.join(60)
        streamed.join(60)
    (reply,) = plain_replies
    assert reply.status == 200, reply
    assert reply.json()["object"] == "chat.completion"
    assert reply.headers["x-kvgate-job-id"] == job(stack.listener, "held-plain")["id"]
    (reply,) = streamed_replies
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = [line for line in reply.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["object"] == "chat.completion.chunk"
    assert job(stack.listener, "held-stream")["status"] == "succeeded"


def test_deferred_request_gets_202_and_its_answer_by_polling(stack: Stack, sp_model_path: Path) -> None:
    body = chat(text_with_tokens(sp_model_path, 6000), max_tokens=16)
    with Blockers(stack.agents, free=2000) as blockers:
        reply = post(stack.listener, CHAT, body, {"prefer": "respond-async", "x-kvgate-tenant": "acme"})
        assert reply.status == 202, reply
        accepted = reply.json()
        assert reply.headers["location"] == f"/v1/kvgate/jobs/{accepted['id']}"
        # A client does not name its tenant: Envoy removes its x-kvgate-tenant, and with no
        # authentication configured the request is anonymous's.
        assert (accepted["status"], accepted["tenant"]) == ("queued", "anonymous")
        time.sleep(0.3)
        assert job(stack.listener, accepted["id"])["status"] == "queued"
        blockers.release()
        done = until(stack.listener, reply.headers["location"].rsplit("/", 1)[1], "succeeded")
    assert done["response"]["status_code"] == 200
    assert done["response"]["body"]["object"] == "chat.completion"


def test_batch_api_through_the_openai_sdk(stack: Stack, sp_model_path: Path) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.listener}/v1", api_key="unused", max_retries=0)
    text = text_with_tokens(sp_model_path, 3000)
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": json.loads(chat(text, max_tokens=8))}
        for i in range(3)
    ]
    # 3,000 prompt tokens and 20,000 of output: past max_total_tokens (16,384), the gate would say 413.
    lines.append(
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": CHAT,
            "body": json.loads(chat(text, max_tokens=20_000)),
        }
    )
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("batch.jsonl", content), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes) == ("batch", len(content))
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"run": "e2e"}
    )
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == 4
    deadline = time.monotonic() + 30
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status == "in_progress", batch
        time.sleep(0.2)
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    assert batch.output_file_id and batch.error_file_id and batch.metadata == {"run": "e2e"}
    assert batch.id in [listed.id for listed in client.batches.list(limit=5)]
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == ["req-0", "req-1", "req-2"]
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert all(line["response"]["body"]["object"] == "chat.completion" for line in output)
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "too-long" and error["response"] is None
    assert error["error"]["code"] == "context_length_exceeded"
