"""Reservations are the gate's and their holders' (issue 27, "Ids the gate owns").

A client's `x-request-id` keys nothing: five requests that share one are five reservations, and no
more of them run than the node fits. The gate names each reservation to the engine as X-Session-ID,
over whatever the client sent. An agent keeps each reservation for the holder that made it: another
holder's Reserve of the same id is refused, its Release frees nothing, and under mTLS the holder is
the caller's certificate, whatever name it sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path

import pytest
from pki import Authority, Issued
from test_e2e_headroom import burst
from texts import text_with_tokens

from kvgate.agent.ledger import Budget, ReservationLedger
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.gate.reservation_ids import ReservationIds
from kvgate.harness.client import Reply, chat, post, post_until_admitted
from kvgate.harness.envoy import render_envoy
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.headroom.client import AgentClient
from kvgate.headroom.credentials import ChannelSecurity
from kvgate.headroom.snapshot import ReserveReason
from kvgate.localports import free_port
from kvgate.tls import ClientTls, ServerTls

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def budget() -> Budget:
    return Budget(capacity_tokens=40_000, safety_ratio=1.0, observed_tokens=None, healthy=True)


# --- the ledger -----------------------------------------------------------------------------------


def test_a_live_id_is_its_holders_alone() -> None:
    ledger = ReservationLedger(Clock(), 60, 600)
    assert ledger.reserve("r1", 12_000, 0, budget(), "gate-a").granted
    stolen = ledger.reserve("r1", 12_000, 0, budget(), "gate-b")
    assert not stolen.granted and stolen.reason is ReserveReason.REQUEST_ID_CONFLICT
    again = ledger.reserve("r1", 12_000, 0, budget(), "gate-a")
    assert again.granted and again.reason is ReserveReason.ALREADY_RESERVED, "a holder's retry renews"
    assert ledger.reserved_tokens == 12_000 and ledger.count == 1


def test_a_release_from_another_holder_frees_nothing() -> None:
    ledger = ReservationLedger(Clock(), 60, 600)
    ledger.reserve("r1", 12_000, 0, budget(), "gate-a")
    assert not ledger.release("r1", "gate-b")
    assert not ledger.release("r1", "gate-b", unanswered_reserve=True)
    assert ledger.reserved_tokens == 12_000, "the running request keeps its room"
    assert ledger.reserve("r1", 12_000, 0, budget(), "gate-a").reason is ReserveReason.ALREADY_RESERVED
    assert ledger.release("r1", "gate-a") and ledger.reserved_tokens == 0


def test_an_early_release_refuses_only_its_own_holders_late_reserve() -> None:
    ledger = ReservationLedger(Clock(), 60, 600)
    assert not ledger.release("next", "mallory", unanswered_reserve=True)
    assert ledger.reserve("next", 1_000, 0, budget(), "gate-a").granted, "mallory cannot spoil gate-a's id"
    assert not ledger.release("late", "gate-a", unanswered_reserve=True)
    late = ledger.reserve("late", 1_000, 0, budget(), "gate-a")
    assert late.reason is ReserveReason.RELEASED_FIRST


def test_reservation_ids_are_unique_per_process_and_never_the_clients() -> None:
    first, second = ReservationIds(), ReservationIds()
    ids = [first.next() for _ in range(3)] + [second.next()]
    assert len(set(ids)) == 4 and ids[0].endswith("-1") and ids[1].endswith("-2")
    assert first.instance != second.instance, "two gate processes never share ids"
    assert all(len(i.encode()) <= 256 for i in ids)


# --- over gRPC: a real agent server ------------------------------------------------------------------


@asynccontextmanager
async def agent_serving(tls: ServerTls | None = None) -> AsyncIterator[tuple[Agent, str]]:
    agent = Agent(NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=40_000, safety_ratio=1.0))
    port = await agent.start("127.0.0.1:0", tls)
    try:
        yield agent, f"127.0.0.1:{port}"
    finally:
        await agent.stop(grace_s=0.1)


def test_over_grpc_another_holder_neither_shares_nor_frees_a_reservation() -> None:
    async def scenario() -> None:
        async with agent_serving() as (agent, address):
            client = AgentClient(address, 0.05, 0.2)
            try:
                assert (await client.reserve("r1", 12_000, 60, "gate-a", 5.0)).granted
                shared = await client.reserve("r1", 12_000, 60, "mallory", 5.0)
                assert not shared.granted and shared.reason == ReserveReason.REQUEST_ID_CONFLICT
                freed = await client.release("r1", "mallory", 5.0)
                assert not freed.released and freed.reserved_tokens == 12_000
                assert agent.state.ledger.reserved_tokens == 12_000
                assert (await client.release("r1", "gate-a", 5.0)).released
            finally:
                await client.close()

    asyncio.run(scenario())


def test_under_mtls_the_holder_is_the_callers_certificate(tmp_path: Path) -> None:
    """Both callers send the holder name "gate": only the certificate that reserved can release."""
    ca = Authority.create(tmp_path, "ca")
    served = ca.issue(tmp_path, "agent", "DNS:kvgate-agent")
    gate = ca.issue(tmp_path, "gate", "DNS:kvgate-gate")
    other = ca.issue(tmp_path, "other", "DNS:kvgate-queue")

    def channel(issued: Issued) -> ChannelSecurity:
        return ChannelSecurity(ClientTls(str(ca.cert), str(issued.cert), str(issued.key), "kvgate-agent"))

    async def scenario() -> None:
        tls = ServerTls(str(served.cert), str(served.key), client_ca=str(ca.cert))
        async with agent_serving(tls) as (agent, address):
            gates = AgentClient(address, 0.05, 0.2, channel(gate))
            others = AgentClient(address, 0.05, 0.2, channel(other))
            try:
                assert (await gates.reserve("r1", 12_000, 60, "gate", 5.0)).granted
                (held,) = agent.state.ledger.live()
                assert held.holder == "kvgate-gate", "the certificate's name, not the name sent"
                assert not (await others.release("r1", "gate", 5.0)).released
                conflict = await others.reserve("r1", 12_000, 60, "gate", 5.0)
                assert conflict.reason == ReserveReason.REQUEST_ID_CONFLICT
                assert (await gates.release("r1", "any name at all", 5.0)).released
            finally:
                await gates.close()
                await others.close()

    asyncio.run(scenario())


# --- through the real Envoy ------------------------------------------------------------------------


def shared_id_burst(port: int, body: bytes, count: int) -> list[Reply]:
    """`count` concurrent requests that all carry the same x-request-id and a client X-Session-ID."""
    return burst(port, body, count, "6", {"x-request-id": "shared-1", "x-session-id": "client-session"})


@pytest.mark.slow
@pytest.mark.parametrize("envoy_file", ["envoy.yaml", "envoy-one-trip.yaml"])
def test_five_requests_sharing_an_x_request_id_on_a_node_that_fits_three(
    tmp_path: Path, sp_model_path: Path, pools: tuple[dict[str, int], Upstreams], envoy_file: str
) -> None:
    pool_ports, upstreams = pools
    body = chat(text_with_tokens(sp_model_path, 10_996), max_tokens=600)  # about 11.6k tokens
    ports = dict(pool_ports, listener=free_port(), gate=free_port(), admin=free_port())
    with ExitStack() as stack:
        agent = agent_process(
            tmp_path,
            "node-a",
            free_port(),
            f"127.0.0.1:{pool_ports['long']}",
            ["--capacity-tokens", "40000", "--safety-ratio", "1.0"],
        )
        stack.callback(agent.stop)
        config = (
            f"default_model: {{tokenizer: {sp_model_path}}}\n"
            f"headroom: {{agents: [127.0.0.1:{agent.port}]}}\n"
            "admission: {max_wait_s: 0.3}\n"
        )
        envoy_config = render_envoy(ROOT / "envoy" / envoy_file, tmp_path / "envoy.yaml", ports)
        envoy = envoy_process(envoy_config, tmp_path, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        stack.enter_context(gate_process(config, tmp_path, ports["gate"]))
        # Once the gate follows its agent (a long request admitted, run and released), the burst.
        assert post_until_admitted(ports["listener"], body).status == 200
        upstreams.max_in_flight.clear()
        replies = shared_id_burst(ports["listener"], body, 5)
        agent_metrics = post(agent.metrics_port, "/metrics", None).body.decode()
    assert len(replies) == 5, "every request is answered"
    assert upstreams.max_in_flight["long"] == 3, "no more run than the node fits"
    assert sorted(r.status for r in replies) == [200, 200, 200, 429, 429], [r.body[:200] for r in replies]
    assert all(r.headers["x-kvgate-reason"] == "no_capacity" for r in replies if r.status == 429)
    granted = [
        line
        for line in agent_metrics.splitlines()
        if line.startswith("kvgate_agent_reservations_total{") and 'event="granted"' in line
    ]
    assert len(granted) == 1 and granted[0].endswith(" 4.0"), granted  # the first request's and three
    pinned = [
        r for r in upstreams.received if r.pool == "long" and r.headers.get("x-request-id") == "shared-1"
    ]
    assert len(pinned) == 3
    # Two round trips: the gate's header mutation; one: Envoy's header table, from the gate's metadata.
    sessions = {r.headers["x-session-id"] for r in pinned}
    assert len(sessions) == 3, "three reservations, each named by the gate"
    assert "client-session" not in sessions, "the gate's id replaces the client's X-Session-ID"
