"""The agent's stream sends on change, at most once a period and at least every heartbeat; it scrapes
its engine every period only under pressure; and a gate judges staleness from the heartbeat
(kvgate.agent.push, kvgate.agent.cadence, kvgate.config.headroom)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
from waiting import PATIENCE_S, until_async

from kvgate.agent.cli import register, settings_from_args
from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.agent.node import NodeSettings
from kvgate.agent.push import USAGE_TOLERANCE, Cause, StreamPacer, changed
from kvgate.agent.server import Agent
from kvgate.agent.sources.engines import EngineKind, EngineReading, PageState
from kvgate.agent.subscribers import Latest, Subscriber
from kvgate.config.headroom import HeadroomSettings, hung_after, stale_after
from kvgate.errors import ConfigError
from kvgate.headroom.snapshot import ExpectedRelease, LedgerFigures, TenantCharge
from kvgate.headroom.view import HeadroomView
from kvgate.headroom.wire import HeadroomEncoder

PERIOD_S = 0.1
CAPACITY = 100_000


class Engine:
    """An engine source whose page says what the test sets, counting the scrapes."""

    def __init__(self) -> None:
        self.used = 10_000
        self.waiting = 0
        self.scrapes = 0

    async def sample(self) -> EngineReading:
        self.scrapes += 1
        return EngineReading(
            EngineKind.VLLM,
            PageState.READY,
            CAPACITY,
            self.used,
            0,
            self.waiting,
            0,
            ("engine 0",),
            "r",
            30.0,
        )

    async def close(self) -> None:
        pass


def settings(**values: object) -> NodeSettings:
    base = NodeSettings("n1", "127.0.0.1:8000", period_s=PERIOD_S, heartbeat_s=1.0, idle_scrape_s=0.5)
    return dataclasses.replace(base, **values)  # type: ignore[arg-type]


async def ticks(agent: Agent, clock: ManualClock, n: int) -> None:
    """`n` more periods of the agent's loop, on the test's clock."""
    for _ in range(n):
        clock.advance(PERIOD_S)
        await agent.tick()


def run(agent_settings: NodeSettings, engine: Engine | None = None) -> tuple[Agent, ManualClock]:
    """An agent on the test's clock, followed by one gate that makes no calls of its own."""
    clock = ManualClock(100.0)
    agent = Agent(agent_settings, engine, clock=clock)
    agent.stream.add("a gate", None)
    return agent, clock


def test_no_change_sends_nothing_until_the_heartbeat() -> None:
    async def scenario() -> None:
        agent, clock = run(settings(capacity_tokens=CAPACITY))
        first = await agent.tick()
        assert agent.stream.published == 1 and first.heartbeat_ms == 1000
        await ticks(agent, clock, 9)  # 0.9 s of a quiet node
        assert agent.stream.published == 1
        await ticks(agent, clock, 1)  # the heartbeat
        assert agent.stream.published == 2
        await ticks(agent, clock, 10)
        assert agent.stream.published == 3

    asyncio.run(scenario())


def test_a_change_is_sent_within_one_period() -> None:
    async def scenario() -> None:
        agent, clock = run(settings(capacity_tokens=CAPACITY))
        await agent.tick()
        await ticks(agent, clock, 3)
        assert agent.state.reserve("r", 5_000, 0).granted
        await ticks(agent, clock, 1)
        assert agent.stream.published == 2
        assert agent.state.release("r").released
        await ticks(agent, clock, 1)
        assert agent.stream.published == 3
        await ticks(agent, clock, 5)  # nothing else changed
        assert agent.stream.published == 3

    asyncio.run(scenario())


def test_a_callers_own_reserve_and_release_send_it_no_message_and_others_still_hear_of_them() -> None:
    async def scenario() -> None:
        clock = ManualClock(100.0)
        # Usage read from an engine that does not move: a reservation-only node's usage is its
        # reservations, which the answers do not tell.
        agent = Agent(settings(idle_scrape_s=None), Engine(), clock=clock)
        caller = agent.stream.add("caller", None)
        await agent.tick()
        await ticks(agent, clock, 3)
        assert caller.sent == 1
        granted = agent.state.reserve("r", 5_000, 0, "caller")
        assert granted.granted and granted.after is not None and granted.after.reserved_tokens == 5_000
        agent.answered("caller", granted.after)
        assert not agent.changed.is_set()  # nobody else to tell: no early tick
        await ticks(agent, clock, 2)
        assert caller.sent == 1
        other = agent.stream.add("another gate", agent.latest())
        assert other.sent == 0 and agent.stream.published == 1  # the latest, put in its mailbox at once
        released = agent.state.release("r", "caller")
        assert released.after is not None and released.after.freed_tokens_total == 5_000
        agent.answered("caller", released.after)
        assert agent.changed.is_set()  # the other gate has yet to hear of it
        await ticks(agent, clock, 1)
        assert (caller.sent, other.sent) == (1, 1)
        # What the caller's calls did not change still reaches it: here, a grant to another holder.
        assert agent.state.reserve("theirs", 5_000, 0, "another gate").granted
        await ticks(agent, clock, 1)
        assert (caller.sent, other.sent) == (2, 2)

    asyncio.run(scenario())


def test_a_forecast_an_answer_told_counts_from_the_subscribers_last_message() -> None:
    agent, _ = run(settings(capacity_tokens=CAPACITY))
    base = agent.state.snapshot(0)
    pacer = StreamPacer(PERIOD_S, 5.0)
    pacer.sent(base, 10.0)
    told = LedgerFigures(50_000, 40_000, 2, 0, (ExpectedRelease(2.0, 20_000), ExpectedRelease(5.0, 20_000)))
    pacer.told(told, 10.5)
    same = dataclasses.replace(
        base,
        headroom_tokens=50_000,
        reserved_tokens=40_000,
        reservations=2,
        releases=(ExpectedRelease(1.5, 20_000), ExpectedRelease(4.5, 20_000)),
    )
    assert pacer.due(same, 11.0) is None  # 1 s after the message, 0.5 s after the answer: as told
    late = dataclasses.replace(same, releases=(ExpectedRelease(2.5, 20_000), ExpectedRelease(4.5, 20_000)))
    assert pacer.due(late, 11.0) == Cause.CHANGE


def test_usage_that_creeps_within_the_tolerance_sends_nothing() -> None:
    async def scenario() -> None:
        engine = Engine()
        agent, clock = run(settings(idle_scrape_s=None), engine)  # scrapes every period
        await agent.tick()
        engine.used += int(USAGE_TOLERANCE * CAPACITY) // 2
        await ticks(agent, clock, 3)
        assert agent.stream.published == 1
        engine.used += int(USAGE_TOLERANCE * CAPACITY)
        await ticks(agent, clock, 1)
        assert agent.stream.published == 2

    asyncio.run(scenario())


def test_heartbeat_zero_sends_every_period() -> None:
    """The compatibility mode: what agents did before they sent on change."""

    async def scenario() -> None:
        agent, clock = run(settings(capacity_tokens=CAPACITY, heartbeat_s=0.0))
        await agent.tick()
        await ticks(agent, clock, 9)
        assert agent.stream.published == 10 and agent.state.snapshot(0).heartbeat_ms == 0

    asyncio.run(scenario())


def test_what_a_gate_reads_counts_as_a_change_and_what_it_does_not_does_not() -> None:
    agent, _ = run(settings(capacity_tokens=CAPACITY))
    before = agent.state.snapshot(0)
    assert (
        changed(before, dataclasses.replace(before, seq=9, sample_time_unix_ns=5, waiting=3), 0.1, 0.01) == ""
    )
    assert changed(before, dataclasses.replace(before, safety_ratio=0.905), 0.1, 0.01) == "safety ratio"
    assert changed(before, dataclasses.replace(before, healthy=False), 0.1, 0.01) == "health"


def test_the_engine_is_scraped_every_period_only_under_pressure() -> None:
    async def scenario() -> None:
        engine = Engine()
        agent, clock = run(settings(), engine)
        await agent.tick()
        await ticks(agent, clock, 10)  # a quiet node at 10 % KV: every 500 ms
        assert engine.scrapes == 3
        engine.used = 80_000  # 0.89 of admissible (90,000): pressure from the next scrape on
        await ticks(agent, clock, 5)
        assert engine.scrapes == 4  # the slow scrape that saw it
        await ticks(agent, clock, 10)
        assert engine.scrapes == 14
        engine.used = 10_000
        await ticks(agent, clock, 11)  # one fast scrape sees it fall, then every 500 ms again
        assert engine.scrapes == 17

    asyncio.run(scenario())


def test_a_wait_makes_the_scrape_fast_for_a_second_and_a_grant_does_not() -> None:
    async def scenario() -> None:
        engine = Engine()
        agent, clock = run(settings(), engine)
        await agent.tick()
        await ticks(agent, clock, 5)
        assert engine.scrapes == 2
        assert agent.state.reserve("r", 1_000, 0).granted
        await ticks(agent, clock, 10)  # the ledger holds the grant: no fast scrape for it
        assert engine.scrapes == 4
        # Nor for one that names the time it waits since: a gate names its arrival on every try.
        assert agent.state.reserve("named", 1_000, 0, waiting_since_unix_ns=1).granted
        await ticks(agent, clock, 10)
        assert engine.scrapes == 6
        assert not agent.state.reserve("too-big", 90_000, 0).granted  # a request waits for room
        await ticks(agent, clock, 10)  # every period for the second after the wait
        assert engine.scrapes == 16
        await ticks(agent, clock, 10)
        assert engine.scrapes == 18
        # A waiter that holds its place here (a head claim): every period for as long as it holds it.
        assert not agent.state.reserve("head", 90_000, 0, waiting_since_unix_ns=1, hold_slot=True).granted
        await ticks(agent, clock, 20)  # the refusal's second, then the claim's, to its 2 s time to live
        assert engine.scrapes == 38
        await ticks(agent, clock, 10)  # lapsed (its gate renews it while it waits): every 500 ms again
        assert engine.scrapes == 40
        engine.waiting = 2  # the engine queues requests: pressure once a slow scrape has seen it
        await ticks(agent, clock, 5)
        seen = engine.scrapes
        await ticks(agent, clock, 20)
        assert engine.scrapes == seen + 20

    asyncio.run(scenario())


def test_staleness_follows_the_heartbeat_in_the_gates_view() -> None:
    clock = ManualClock(0.0)
    fake = FakeHeadroom(clock, stale_after_s=0.35)
    fake.add_node("quiet", 1000, heartbeat_ms=1000)
    fake.add_node("every-period", 1000)
    clock.advance(2.9)
    assert [v.fresh for v in fake.snapshot()] == [False, True]  # every-period, quiet (sorted by name)
    clock.advance(0.2)
    assert [v.fresh for v in fake.snapshot()] == [False, False]
    assert stale_after(0.35, 0) == 0.35 and stale_after(0.35, 1000) == 3.0
    # A heartbeat is believed up to 10 s: no agent stays fresh for long by claiming a longer one.
    assert stale_after(0.35, 3_600_000) == 30.0
    assert hung_after(1.0, 0) == 1.0 and hung_after(1.0, 1000) == 5.0


def test_a_quiet_agent_is_neither_stale_nor_dropped_as_hung_by_a_real_view() -> None:
    """The gate's view, told to drop a stream silent for 0.2 s and to call a node stale after 0.1 s,
    keeps an agent that sends every 0.5 s at the least: fresh, on the one stream it opened."""

    async def scenario() -> None:
        agent = Agent(settings(capacity_tokens=CAPACITY, heartbeat_s=0.5))
        listens = 0
        listen = agent.stream.listen

        def counting(holder: str, latest: Latest) -> AsyncIterator[bytes]:
            nonlocal listens
            listens += 1
            return listen(holder, latest)

        agent.stream.listen = counting  # type: ignore[method-assign]
        port = await agent.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        fast = {"stale_after_s": 0.1, "idle_timeout_s": 0.2, "reconnect_initial_s": 0.05}
        view = HeadroomView(HeadroomSettings(agents=(address,), **fast))  # type: ignore[arg-type]
        await view.start()
        try:
            await until_async(lambda: view.snapshot()[0].connected, "the view's first message")
            sent = agent.stream.published
            # Two heartbeats later (about 1 s, five idle timeouts), the same stream and a fresh node.
            await until_async(lambda: agent.stream.published >= sent + 2, "two heartbeats", PATIENCE_S)
            await until_async(lambda: view.snapshot()[0].age_s < 0.5, "the heartbeat to reach the view")
            node = view.snapshot()[0]
            assert node.connected and node.fresh and listens == 1
        finally:
            await view.stop()
            await agent.stop(grace_s=0.1)

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def followed(agent: Agent) -> AsyncIterator[tuple[HeadroomView, str]]:
    """`agent` serving on 127.0.0.1 and a gate's view following it as "gate-1", the name its calls are
    made as too; the view and the agent's node."""
    port = await agent.start("127.0.0.1:0")
    view = HeadroomView(HeadroomSettings(agents=(f"127.0.0.1:{port}",)), subscriber="gate-1")
    await view.start()
    try:
        await until_async(lambda: view.snapshot()[0].connected, "the view's first message")
        yield view, view.snapshot()[0].agent
    finally:
        await view.stop()
        await agent.stop(grace_s=0.1)


def test_a_view_takes_its_own_calls_figures_from_the_answers_and_is_sent_no_message_for_them() -> None:
    """Through gRPC: the gate's view reserves and releases as the name it subscribes with, so the
    agent counts the answers as told to that subscription."""

    async def scenario() -> None:
        engine = Engine()
        agent = Agent(settings(idle_scrape_s=None, heartbeat_s=10.0), engine)
        async with followed(agent) as (view, node):
            sent = agent.stream.published
            assert (await view.reserve(node, "r", 5_000)).granted
            reserved = view.snapshot()[0].headroom
            assert reserved is not None and (reserved.reserved_tokens, reserved.reservations) == (5_000, 1)
            assert (await view.release(node, "r")).released
            released = view.snapshot()[0].headroom
            assert released is not None and (released.reserved_tokens, released.reservations) == (0, 0)
            assert released.freed_tokens_total == 5_000
            for _ in range(3):
                await agent.tick()
            assert agent.stream.published == sent
            engine.used += 2 * int(USAGE_TOLERANCE * CAPACITY)  # what the calls did not change is sent
            await until_async(lambda: agent.stream.published == sent + 1, "the usage's message", PATIENCE_S)

    asyncio.run(scenario())


def test_a_message_sampled_before_an_answer_the_view_took_keeps_what_the_answer_said() -> None:
    """The stream and the calls travel apart: a message sampled before a grant can reach the gate after
    the grant's answer, and must not take the grant out of its view again (the agent counts it as told,
    so no message would put it back until the heartbeat)."""

    async def scenario() -> None:
        engine = Engine()
        agent = Agent(settings(idle_scrape_s=None, heartbeat_s=10.0), engine)
        followers: list[Subscriber] = []
        add = agent.stream.add

        def following(holder: str, latest: Latest) -> Subscriber:
            followers.append(add(holder, latest))
            return followers[-1]

        agent.stream.add = following  # type: ignore[method-assign]
        async with followed(agent) as (view, node):
            before = agent.state.snapshot(0)
            assert (await view.reserve(node, "r", 5_000)).granted
            (follower,) = followers
            follower.put(HeadroomEncoder().encode(before))
            await until_async(
                lambda: (h := view.snapshot()[0].headroom) is not None and h.seq == before.seq,
                "the earlier sample to arrive",
            )
            kept = view.snapshot()[0].headroom
            assert kept is not None and (kept.reserved_tokens, kept.reservations) == (5_000, 1)
            later = agent.state.snapshot(0)
            follower.put(HeadroomEncoder().encode(later))
            await until_async(lambda: view.snapshot()[0].headroom == later, "a sample taken after the call")

    asyncio.run(scenario())


def test_a_callers_own_release_tells_it_its_tenants_settled_service_held_and_reserved_tokens() -> None:
    """A Release settles its tenant's service and reserved tokens on what ran, which the caller cannot
    work out alone; the agent sends it no message for its own Release, so the answer says them."""

    async def scenario() -> None:
        engine = Engine()
        agent = Agent(settings(idle_scrape_s=None, heartbeat_s=10.0), engine)
        async with followed(agent) as (view, node):
            sent = agent.stream.published
            charge = TenantCharge("acme", 3_000 + 2 * 2_000, output_weight=2.0)
            granted = await view.reserve(node, "r", 5_000, output_tokens=2_000, charge=charge)
            assert granted.granted
            reserved = view.snapshot()[0].headroom
            assert reserved is not None
            assert (reserved.tenant_service, reserved.tenant_held, reserved.tenant_tokens) == (
                {"acme": 7_000.0},
                {"acme": 5_000},
                {"acme": 5_000},
            ), "the grant, counted once"
            assert (await view.release(node, "r", generated_tokens=500)).released
            settled = view.snapshot()[0].headroom
            assert settled is not None
            assert (settled.tenant_service, settled.tenant_held, settled.tenant_tokens) == (
                {"acme": 3_000 + 2 * 500.0},
                {},
                {"acme": 3_000 + 500},
            )
            agent_says = agent.state.snapshot(0)
            assert (settled.tenant_service, settled.tenant_tokens) == (
                agent_says.tenant_service,
                agent_says.tenant_tokens,
            )
            assert agent.stream.published == sent, "no message: the answers said it all"

    asyncio.run(scenario())


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["agent", "--listen", "127.0.0.1:0", "--endpoint", "127.0.0.1:8000", *argv])


def test_flags_for_the_stream_and_the_ratio_name_the_flag_that_is_wrong() -> None:
    engine = ("--engine-metrics", "http://127.0.0.1:8000/metrics")
    built = settings_from_args(parse(*engine))
    assert (built.heartbeat_s, built.idle_scrape_s, built.safety_ratio) == (1.0, 0.5, 0.9)
    assert built.ratio().floor == pytest.approx(0.8) and built.ratio().ceiling == 0.98
    wrong = {
        "--engine-stale-after-s": (*engine, "--engine-stale-after-s", "0.5"),
        "--heartbeat-ms": ("--capacity-tokens", "1", "--heartbeat-ms", "50"),
        "--safety-ratio-max": ("--capacity-tokens", "1", "--safety-ratio-max", "0.85"),
        "--safety-ratio-min": ("--capacity-tokens", "1", "--safety-ratio-min", "0.95"),
    }
    for flag, argv in wrong.items():
        with pytest.raises(ConfigError, match=flag):
            settings_from_args(parse(*argv))
    # Without engine metrics nothing is scraped: no scrape interval to hold against staleness.
    quiet = settings_from_args(parse("--capacity-tokens", "1", "--engine-stale-after-s", "0.5"))
    assert quiet.idle_scrape_s is None
