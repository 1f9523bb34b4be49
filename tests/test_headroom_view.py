"""The gate's HeadroomView against real agents on 127.0.0.1: freshness, reconnects, DNS, slow agents."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import pytest
from waiting import PATIENCE_S, until_async

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate._proto.headroom.v1 import headroom_pb2_grpc as pb_grpc
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.agent.sources.fake_engine import FakeEngineMetrics
from kvgate.agent.sources.scrape import EngineScraper
from kvgate.config.headroom import HeadroomSettings
from kvgate.errors import ConfigError, HeadroomError
from kvgate.headroom.snapshot import NodeView
from kvgate.headroom.view import HeadroomView

FAST = {"stale_after_s": 0.2, "idle_timeout_s": 0.5, "reconnect_initial_s": 0.05, "reconnect_max_s": 0.2}


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(scenario)


def settings(**overrides: Any) -> NodeSettings:
    values: dict[str, Any] = {"period_s": 0.05, "capacity_tokens": 40_000} | overrides
    return NodeSettings("n1", "127.0.0.1:8000", **values)


async def view_until(view: HeadroomView, check: Any, timeout_s: float = PATIENCE_S) -> tuple[NodeView, ...]:
    async with asyncio.timeout(timeout_s):
        while not check(snapshot := view.snapshot()):
            await view.wait_update(0.05)
    return snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_settings_validate_addresses() -> None:
    HeadroomSettings(agents=("10.0.0.1:9100", "[::1]:9100"), dns="agents.kvgate.svc:9100")
    with pytest.raises(ConfigError, match=r"headroom.agents\[1\]"):
        HeadroomSettings(agents=("a:1", "no-port"))
    with pytest.raises(ConfigError, match=r"headroom\.dns"):
        HeadroomSettings(dns="agents:99999")


def test_view_follows_an_agent_and_ages_on_the_injected_clock() -> None:
    async def scenario() -> None:
        agent = Agent(settings())
        port = await agent.start("127.0.0.1:0")
        clock = Clock()
        view = HeadroomView(HeadroomSettings(agents=(f"127.0.0.1:{port}",), **FAST), clock=clock)
        assert view.snapshot() == ()
        await view.start()
        try:
            (node,) = await view_until(view, lambda s: s[0].connected)
            assert node.fresh and node.healthy and node.age_s == 0.0
            assert node.headroom is not None and node.headroom.headroom_tokens == 36_000
            await agent.stop(grace_s=0.1)
            await view_until(view, lambda s: not s[0].connected)
            clock.now += 0.25
            (stale,) = view.snapshot()
            assert not stale.fresh and stale.age_s == 0.25
            assert stale.headroom is not None  # the last known figures stay visible, marked stale
        finally:
            await view.stop()

    run(scenario())


def test_view_reconnects_to_a_restarted_agent() -> None:
    async def scenario() -> None:
        first = Agent(settings())
        port = await first.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        view = HeadroomView(HeadroomSettings(agents=(address,), **FAST))
        await view.start()
        try:
            await view_until(view, lambda s: s[0].connected)
            assert (await view.reserve(address, "r1", 10_000)).granted
            await first.stop(grace_s=0)
            await view_until(view, lambda s: not s[0].connected)
            with pytest.raises(HeadroomError):
                await view.reserve(address, "r2", 10_000)
            second = Agent(settings())
            await second.start(address)
            try:
                (node,) = await view_until(view, lambda s: s[0].connected and s[0].fresh)
                assert (
                    node.headroom is not None and node.headroom.reserved_tokens == 0
                )  # a new agent, a new ledger
                assert (await view.reserve(address, "r2", 10_000)).granted
            finally:
                await second.stop(grace_s=0)
        finally:
            await view.stop()

    run(scenario())


def test_reserve_updates_the_view_at_once() -> None:
    async def scenario() -> None:
        agent = Agent(settings(period_s=10.0))  # no second push during the test
        port = await agent.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        view = HeadroomView(HeadroomSettings(agents=(address,), **FAST | {"idle_timeout_s": 20.0}))
        await view.start()
        try:
            await view_until(view, lambda s: s[0].connected)
            outcome = await view.reserve(address, "r1", 12_000)
            assert outcome.granted and outcome.headroom_tokens == 24_000
            (node,) = view.snapshot()
            assert node.headroom is not None and node.headroom.headroom_tokens == 24_000
            released = await view.release(address, "r1")
            assert released.released and view.snapshot()[0].headroom.headroom_tokens == 36_000  # type: ignore[union-attr]
            with pytest.raises(HeadroomError, match="no agent"):
                await view.reserve("127.0.0.1:1", "r", 1)
        finally:
            await view.stop()
            await agent.stop(grace_s=0)

    run(scenario())


def test_view_sees_an_engine_usage_change() -> None:
    """How many periods the change takes to reach the view is `python -m bench agent`'s figure."""

    async def scenario() -> None:
        engine = FakeEngineMetrics()
        url = await engine.start()
        agent = Agent(settings(capacity_tokens=None), EngineScraper(url, 0.025))
        port = await agent.start("127.0.0.1:0")
        view = HeadroomView(HeadroomSettings(agents=(f"127.0.0.1:{port}",), **FAST))
        await view.start()
        try:
            await view_until(view, lambda s: s[0].healthy)
            engine.kv_usage = 0.75
            (node,) = await view_until(view, lambda s: s[0].headroom.used_tokens == 30_000)
            assert node.headroom is not None and node.headroom.headroom_tokens == 6_000
        finally:
            await view.stop()
            await agent.stop(grace_s=0)
            await engine.stop()

    run(scenario())


class _SlowAgent(pb_grpc.AgentServicer):  # type: ignore[misc]
    """Answers Reserve late; streams one message on the first subscription, then nothing (wedged)."""

    def __init__(self) -> None:
        self.subscriptions = 0

    async def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> AsyncIterator[pb.NodeHeadroom]:
        self.subscriptions += 1
        if self.subscriptions == 1:
            yield pb.NodeHeadroom(node="slow", seq=1, healthy=True, capacity_tokens=1000, headroom_tokens=900)
        await asyncio.sleep(30)

    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        await asyncio.sleep(30)  # far past the gate's deadline: only the deadline can end the call
        return pb.ReserveResponse(granted=True)


def test_a_slow_agent_times_out_and_a_silent_stream_is_reopened() -> None:
    async def scenario() -> None:
        servicer = _SlowAgent()
        server = grpc.aio.server()
        pb_grpc.add_AgentServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        config = HeadroomSettings(
            agents=(address,), **FAST | {"idle_timeout_s": 0.2, "reserve_timeout_s": 0.05}
        )
        view = HeadroomView(config)
        await view.start()
        try:
            await view_until(view, lambda s: s[0].connected)
            with pytest.raises(HeadroomError, match="DEADLINE_EXCEEDED"):
                await view.reserve(address, "r", 10)
            await until_async(lambda: servicer.subscriptions >= 3, "the silent stream reopened twice")
            (node,) = view.snapshot()
            assert not node.fresh and not node.connected and node.age_s > 0.4
        finally:
            await view.stop()
            await server.stop(0)

    run(scenario())


def test_dns_adds_and_removes_agents_and_survives_lookup_failures() -> None:
    async def scenario() -> None:
        agents = [Agent(settings()) for _ in range(2)]
        addresses = [f"127.0.0.1:{await a.start('127.0.0.1:0')}" for a in agents]
        answers: list[frozenset[str] | HeadroomError] = [
            frozenset(addresses[:1]),
            frozenset(addresses),
            HeadroomError("cannot resolve agents at agents:9100: temporary failure"),
            frozenset(addresses[1:]),
        ]
        lookups: list[tuple[str, int]] = []

        async def resolver(host: str, port: int) -> frozenset[str]:
            lookups.append((host, port))
            answer = answers[min(len(lookups), len(answers)) - 1]
            if isinstance(answer, HeadroomError):
                raise answer
            return answer

        config = HeadroomSettings(dns="agents:9100", resolve_interval_s=0.1, **FAST)
        view = HeadroomView(config, resolver=resolver)
        await view.start()
        try:
            assert [n.agent for n in view.snapshot()] == addresses[:1]
            await view_until(view, lambda s: len(s) == 2 and all(n.connected for n in s))
            await until_async(lambda: len(lookups) >= 3, "the failed lookup")
            assert len(view.snapshot()) == 2  # a failed lookup keeps the agents known
            await view_until(view, lambda s: [n.agent for n in s] == addresses[1:])
            assert lookups[0] == ("agents", 9100)
        finally:
            await view.stop()
            for agent in agents:
                await agent.stop(grace_s=0)

    run(scenario())


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    view = HeadroomView(HeadroomSettings(reconnect_initial_s=0.1, reconnect_max_s=1.0), rng=lambda: 1.0)
    assert [view._backoff(n) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    low = HeadroomView(HeadroomSettings(reconnect_initial_s=0.1, reconnect_max_s=1.0), rng=lambda: 0.0)
    assert low._backoff(2) == pytest.approx(0.2)


def test_an_on_demand_view_follows_the_agents_only_while_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvgate queue's view: no stream (and no message to decode) while no job waits; Reserve works
    either way, and a demand brings the stream back at once."""
    monkeypatch.setattr("kvgate.headroom.view.LINGER_S", 0.2)

    async def scenario() -> None:
        agent = Agent(settings())
        port = await agent.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        view = HeadroomView(HeadroomSettings(agents=(address,), **FAST), on_demand=True)
        await view.start()
        try:
            assert not await view.wait_update(0.3)  # nothing followed: not a message
            (node,) = view.snapshot()
            assert not node.connected and node.headroom is None
            assert (await view.reserve(address, "r1", 10_000)).granted
            view.demand(True)
            await view_until(view, lambda s: s[0].connected)
            view.demand(False)
            view.demand(True)  # wanted again before the linger ends: it keeps following
            await asyncio.sleep(0.3)
            assert view.snapshot()[0].connected
            view.demand(False)
            await view_until(view, lambda s: not s[0].connected)
            assert not await view.wait_update(0.3)
            (paused,) = view.snapshot()
            assert paused.headroom is not None and paused.headroom.reserved_tokens == 10_000  # kept
        finally:
            await view.stop()
            await agent.stop(grace_s=0)

    run(scenario())
