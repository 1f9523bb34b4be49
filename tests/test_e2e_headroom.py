"""Headroom admission end to end: real Envoy, real gates, real agents, recording upstreams."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest
from texts import text_with_tokens
from waiting import PATIENCE_S, until

from kvgate.config.headroom import HeadroomSettings
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
# Reservations hold and release the same way with either shipped set-up; the tests that pin, wait
# and release run with both.
ENVOY_FILES = pytest.mark.parametrize("envoy_file", ["envoy.yaml", "envoy-one-trip.yaml"])
# How long the long pool holds a burst's admitted requests: long enough that each of them is still in
# flight when the last of the burst is decided, however far apart a loaded machine spreads them.
HOLD_S = "6"


@pytest.fixture(scope="module")
def long_body(sp_model_path: Path) -> bytes:
    # 11,000 prompt tokens + 1,000 output: a 12k-token request.
    return chat(text_with_tokens(sp_model_path, 10_996), max_tokens=1000)


def gate_config(tokenizer: Path, agents: list[int], **admission: object) -> str:
    admission_yaml = ", ".join(
        f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in admission.items()
    )
    agent_list = ", ".join(f"127.0.0.1:{p}" for p in agents)
    return (
        f"default_model: {{tokenizer: {tokenizer}}}\n"
        f"headroom: {{agents: [{agent_list}]}}\n"
        f"admission: {{{admission_yaml}}}\n"
    )


def burst(
    port: int, body: bytes, count: int, delay: str, headers: dict[str, str] | None = None
) -> list[Reply]:
    """`count` concurrent requests the upstream holds `delay` seconds, each with `headers` too."""
    replies: list[Reply] = []
    lock = threading.Lock()

    def one() -> None:
        reply = post(port, CHAT, body, {**(headers or {}), "x-test-delay": delay}, timeout=30)
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(40)
    return replies


def wait_reserved(agent_port: int, wanted: Callable[[int], bool], timeout_s: float) -> int:
    """Follow the agent's stream until its reserved tokens satisfy `wanted`; the last value seen."""

    async def follow() -> int:
        view = HeadroomView(HeadroomSettings(agents=(f"127.0.0.1:{agent_port}",)))
        await view.start()
        reserved = -1
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                await view.wait_update(0.2)
                (node,) = view.snapshot()
                if node.headroom is not None:
                    reserved = node.headroom.reserved_tokens
                    if wanted(reserved):
                        break
            return reserved
        finally:
            await view.stop()

    return asyncio.run(follow())


def node_with_40k_tokens(stack: ExitStack, tmp: Path, pool_ports: dict[str, int]) -> Service:
    """An agent for the long pool's node with 40,000 tokens of capacity, all admissible."""
    port = free_port()
    agent = agent_process(
        tmp,
        "node-a",
        port,
        f"127.0.0.1:{pool_ports['long']}",
        ["--capacity-tokens", "40000", "--safety-ratio", "1.0"],
    )
    stack.callback(agent.stop)
    return agent


def front(
    stack: ExitStack,
    tmp: Path,
    pool_ports: dict[str, int],
    config: str,
    name: str,
    *,
    envoy_file: str = "envoy.yaml",
) -> tuple[int, Service]:
    """An Envoy + gate pair sharing the upstream pools: the Envoy listener port, and the gate."""
    ports = dict(pool_ports, listener=free_port(), gate=free_port(), admin=free_port())
    sub = tmp / name
    sub.mkdir()
    config_path = render_envoy(ROOT / "envoy" / envoy_file, sub / "envoy.yaml", ports)
    envoy = envoy_process(config_path, sub, ports["admin"], ports["listener"])
    stack.callback(envoy.stop)
    return ports["listener"], stack.enter_context(gate_process(config, sub, ports["gate"]))


@ENVOY_FILES
def test_burst_admits_only_what_fits_and_loses_nothing(
    tmp_path: Path,
    sp_model_path: Path,
    long_body: bytes,
    pools: tuple[dict[str, int], Upstreams],
    envoy_file: str,
) -> None:
    pool_ports, upstreams = pools
    with ExitStack() as stack:
        agent = node_with_40k_tokens(stack, tmp_path, pool_ports)
        agent_port = agent.port
        config = gate_config(sp_model_path, [agent_port], max_wait_s=0.3)
        listener, _ = front(stack, tmp_path, pool_ports, config, "g1", envoy_file=envoy_file)
        replies = burst(listener, long_body, 5, delay=HOLD_S)
        agent_metrics = post(agent.metrics_port, "/metrics", None).body.decode()  # type: ignore[arg-type]
    statuses = sorted(r.status for r in replies)
    assert len(replies) == 5, "every request gets an answer"
    assert statuses == [200, 200, 200, 429, 429], [r.body[:200] for r in replies]
    assert upstreams.max_in_flight["long"] == 3
    for refused in (r for r in replies if r.status == 429):
        assert refused.headers["x-kvgate-reason"] == "no_capacity"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "no_capacity"
    granted = [
        line for line in agent_metrics.splitlines() if line.startswith("kvgate_agent_reservations_total{")
    ]
    assert any('event="granted"' in line and line.endswith(" 3.0") for line in granted), granted
    pinned = [r for r in upstreams.received if r.pool == "long"]
    assert all(r.headers["x-kvgate-endpoint"] == f"127.0.0.1:{pool_ports['long']}" for r in pinned)
    # Each reserved request names its reservation (the gate's id, not the client's x-request-id) to the
    # engine, whose KV events then carry it.
    sessions = {r.headers["x-session-id"] for r in pinned}
    assert len(pinned) == 3 and len(sessions) == 3
    assert not sessions & {r.headers["x-request-id"] for r in pinned}


@ENVOY_FILES
def test_waiting_requests_are_admitted_as_capacity_frees(
    tmp_path: Path,
    sp_model_path: Path,
    long_body: bytes,
    pools: tuple[dict[str, int], Upstreams],
    envoy_file: str,
) -> None:
    pool_ports, upstreams = pools
    with ExitStack() as stack:
        agent = node_with_40k_tokens(stack, tmp_path, pool_ports)
        agent_port = agent.port
        config = gate_config(sp_model_path, [agent_port], max_wait_s=5)
        listener, _ = front(stack, tmp_path, pool_ports, config, "g1", envoy_file=envoy_file)
        started = time.monotonic()
        replies = burst(listener, long_body, 5, delay="1.0")
        elapsed = time.monotonic() - started
        assert [r.status for r in replies] == [200] * 5
        assert upstreams.max_in_flight["long"] == 3
        assert elapsed > 1.9, "two of them waited for the first three to finish"
        assert wait_reserved(agent_port, lambda r: r == 0, 5) == 0, "reservations must drain to zero"


def test_async_fallback(
    tmp_path: Path, sp_model_path: Path, long_body: bytes, pools: tuple[dict[str, int], Upstreams]
) -> None:
    pool_ports, _ = pools
    with ExitStack() as stack:
        agent = node_with_40k_tokens(stack, tmp_path, pool_ports)
        agent_port = agent.port
        # Without holding in the gate (tests/test_gate_holds.py): the wait's overflow goes async.
        config = gate_config(sp_model_path, [agent_port], max_wait_s=0.2, async_fallback=True, max_hold_s=0)
        listener, _ = front(stack, tmp_path, pool_ports, config, "g1")
        replies = burst(listener, long_body, 5, delay=HOLD_S)
    pools_hit = sorted(r.json()["pool"] for r in replies)
    assert pools_hit == ["async", "async", "long", "long", "long"]


def test_two_gates_cannot_over_admit_together(
    tmp_path: Path, sp_model_path: Path, long_body: bytes, pools: tuple[dict[str, int], Upstreams]
) -> None:
    pool_ports, upstreams = pools
    with ExitStack() as stack:
        agent = node_with_40k_tokens(stack, tmp_path, pool_ports)
        agent_port = agent.port
        config = gate_config(sp_model_path, [agent_port], max_wait_s=0.2)
        listeners = [front(stack, tmp_path, pool_ports, config, f"g{i}")[0] for i in range(2)]
        results: list[list[Reply]] = [[], []]
        threads = [
            threading.Thread(
                target=lambda i=i: results[i].extend(burst(listeners[i], long_body, 3, delay=HOLD_S))
            )
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(40)
    statuses = sorted(r.status for r in results[0] + results[1])
    assert statuses == [200, 200, 200, 429, 429, 429]
    assert upstreams.max_in_flight["long"] == 3


def test_no_healthy_node_is_503_and_agent_restart_recovers(
    tmp_path: Path, sp_model_path: Path, long_body: bytes, pools: tuple[dict[str, int], Upstreams]
) -> None:
    pool_ports, _ = pools
    agent_port = free_port()
    endpoint = f"127.0.0.1:{pool_ports['long']}"
    args = ["--capacity-tokens", "40000", "--safety-ratio", "1.0"]
    with ExitStack() as stack:
        agent: Service = agent_process(tmp_path, "node-a", agent_port, endpoint, args)
        listener, _ = front(
            stack, tmp_path, pool_ports, gate_config(sp_model_path, [agent_port], max_wait_s=0.2), "g1"
        )
        assert post(listener, CHAT, long_body).status == 200
        agent.signal(signal.SIGKILL)
        agent.stop()

        def refused() -> Reply | None:
            reply = post(listener, CHAT, long_body)
            return reply if reply.status == 503 else None

        # Once the gate has seen its only agent go, a long request finds no healthy node.
        down = until(refused, "a 503 once the agent is gone", interval_s=0.2)
        assert down.status == 503, down.body
        assert down.headers["x-kvgate-reason"] == "no_healthy_node"
        assert "retry-after" in down.headers
        # Short requests do not depend on the agents at all.
        assert post(listener, CHAT, chat("hello")).status == 200
        agent = agent_process(tmp_path, "node-a2", agent_port, endpoint, args)
        stack.callback(agent.stop)
        deadline = time.monotonic() + PATIENCE_S
        while post(listener, CHAT, long_body).status != 200:
            assert time.monotonic() < deadline, "the gate must find the restarted agent again"
            time.sleep(0.3)


@ENVOY_FILES
def test_client_abort_releases_the_reservation(
    tmp_path: Path,
    sp_model_path: Path,
    long_body: bytes,
    pools: tuple[dict[str, int], Upstreams],
    envoy_file: str,
) -> None:
    pool_ports, _ = pools
    with ExitStack() as stack:
        agent = node_with_40k_tokens(stack, tmp_path, pool_ports)
        agent_port = agent.port
        config = gate_config(sp_model_path, [agent_port])
        listener, _ = front(stack, tmp_path, pool_ports, config, "g1", envoy_file=envoy_file)
        request = (
            f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-test-delay: 10\r\n"
            f"content-length: {len(long_body)}\r\n\r\n"
        ).encode() + long_body
        with socket.create_connection(("127.0.0.1", listener)) as client:
            client.sendall(request)
            held = wait_reserved(agent_port, lambda r: r > 0, 5)
            assert 11_000 < held < 14_000, "the long request holds its ~12k-token reservation"
            time.sleep(0.5)
            assert wait_reserved(agent_port, lambda r: r == 0, 0.5) == held, "held while the request runs"
        # The client hung up long before the upstream's 10 s answer: the reservation must go now.
        assert wait_reserved(agent_port, lambda r: r == 0, 6) == 0, (
            "an aborted request releases its reservation"
        )


@ENVOY_FILES
def test_sigterm_waits_for_a_reserved_request_and_releases_it_when_it_ends(
    tmp_path: Path,
    sp_model_path: Path,
    long_body: bytes,
    pools: tuple[dict[str, int], Upstreams],
    envoy_file: str,
) -> None:
    """A request holding a reservation keeps its gate stream to the end (the end releases it): a gate
    told to stop while the engine still answers it waits for that end, then gives the room back."""
    pool_ports, upstreams = pools
    with ExitStack() as stack:
        agent = node_with_40k_tokens(stack, tmp_path, pool_ports)
        config = "server: {drain_seconds: 20}\n" + gate_config(sp_model_path, [agent.port])
        listener, gate = front(stack, tmp_path, pool_ports, config, "g1", envoy_file=envoy_file)
        replies: list[Reply] = []
        worker = threading.Thread(target=lambda: replies.extend(burst(listener, long_body, 1, delay="3")))
        worker.start()
        until(lambda: upstreams.in_flight.get("long", 0) > 0, "the request at the long pool")
        assert wait_reserved(agent.port, lambda r: r > 0, PATIENCE_S) > 0, "reserved while in flight"
        gate.signal(signal.SIGTERM)
        code = gate.process.wait(30)
        assert upstreams.in_flight["long"] == 0, "the gate stopped only once the request had ended"
        worker.join(30)
        assert code == 0, gate.log()
        assert [r.status for r in replies] == [200]
        assert wait_reserved(agent.port, lambda r: r == 0, PATIENCE_S) == 0, "released at its end"
