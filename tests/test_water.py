"""Water levels, the breaker and shedding: pure rules with time passed in."""

from __future__ import annotations

import asyncio
import dataclasses
import math

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.config import WaterThresholds
from kvgate.gate.waitqueue import WaitQueue
from kvgate.headroom.snapshot import CapacitySource, NodeHeadroom, NodeView
from kvgate.policy.nodes import choose_nodes
from kvgate.policy.shedding import PoolKind, Verdict, verdict
from kvgate.policy.water import Breaker, BreakerState, Level, PoolSignals, WaterLevel, pool_signals


def node(
    name: str, headroom: int, *, fresh: bool = True, healthy: bool = True, connected: bool = True
) -> NodeView:
    data = NodeHeadroom(
        node=name,
        endpoint=f"{name}:8000",
        seq=1,
        sample_time_unix_ns=0,
        capacity_tokens=40000,
        safety_ratio=1.0,
        used_tokens=40000 - headroom,
        reserved_tokens=0,
        reservations=0,
        headroom_tokens=headroom,
        healthy=healthy,
        reason="",
        capacity_source=CapacitySource.MANUAL,
        kv_usage=None,
        running=None,
        waiting=None,
        preemptions_total=None,
        gpus=(),
        period_ms=100,
    )
    return NodeView(f"{name}:9100", data, 0.05 if fresh else 5.0, connected, fresh, healthy)


def test_most_headroom_first_and_only_nodes_that_fit() -> None:
    choice = choose_nodes([node("a", 5000), node("b", 30000), node("c", 12000)], 10000, "probe")
    assert [n.agent for n in choice.candidates] == ["b:9100", "c:9100"]
    assert choice.any_usable


def test_stale_nodes_are_probed_last_or_excluded() -> None:
    nodes = [node("a", 30000, fresh=False), node("b", 20000)]
    assert [n.agent for n in choose_nodes(nodes, 1000, "probe").candidates] == ["b:9100", "a:9100"]
    assert [n.agent for n in choose_nodes(nodes, 1000, "exclude").candidates] == ["b:9100"]
    only_stale = [node("a", 30000, fresh=False)]
    assert not choose_nodes(only_stale, 1000, "exclude").any_usable
    assert choose_nodes(only_stale, 1000, "probe").any_usable


def test_unhealthy_and_disconnected_nodes_are_never_asked() -> None:
    choice = choose_nodes([node("a", 30000, healthy=False), node("b", 30000, connected=False)], 1, "probe")
    assert choice.candidates == ()
    assert not choice.any_usable


def test_a_node_is_usable_once_it_has_reported_while_connected_and_healthy_fresh_or_not() -> None:
    assert node("a", 1).usable and node("a", 1, fresh=False).usable
    assert not node("a", 1, healthy=False).usable and not node("a", 1, connected=False).usable
    assert not NodeView("a:9100", None, math.inf, True, False, True).usable


def test_freshness_and_health_are_read_from_the_agents_latest_message_by_one_rule() -> None:
    """NodeView.seen: what the gate's HeadroomView and the in-process agents both answer."""
    report = node("a", 1).headroom
    assert report is not None
    at_limit = NodeView.seen("a:9100", report, received_at=10.0, now=10.5, connected=True, stale_after_s=0.5)
    assert at_limit.fresh and at_limit.age_s == 0.5 and at_limit.healthy and at_limit.usable
    late = NodeView.seen("a:9100", report, received_at=10.0, now=10.6, connected=True, stale_after_s=0.5)
    assert not late.fresh and late.usable
    sick = dataclasses.replace(report, healthy=False)
    assert not NodeView.seen("a:9100", sick, 10.0, now=10.0, connected=True, stale_after_s=0.5).healthy
    never = NodeView.seen("a:9100", None, -math.inf, now=10.0, connected=False, stale_after_s=0.5)
    assert (never.fresh, never.healthy, never.usable, never.age_s) == (False, False, False, math.inf)


def test_the_fake_agents_and_the_gates_view_age_their_nodes_alike() -> None:
    clock = ManualClock(100.0)
    source = FakeHeadroom(clock, stale_after_s=0.5)
    source.add_node("a", 40_000)
    clock.advance(0.5)
    assert [(v.fresh, v.age_s) for v in source.snapshot()] == [(True, 0.5)]
    clock.advance(0.25)
    (stale,) = source.snapshot()
    assert not stale.fresh and stale.usable


def test_pool_signals() -> None:
    signals = pool_signals([node("a", 10000), node("b", 30000), node("c", 0, fresh=False)])
    assert signals.kv == 0.5, "(30000 + 10000 used) / (2 x 40000), from the engines' usage"
    assert abs(signals.stale - 1 / 3) < 1e-9


def test_level_rises_at_once_and_falls_with_hysteresis() -> None:
    water = WaterLevel(WaterThresholds())
    assert water.update(PoolSignals(0.5, 0)) is Level.GREEN
    assert water.update(PoolSignals(0.96, 0)) is Level.RED
    assert water.update(PoolSignals(0.90, 0)) is Level.RED, "inside the hysteresis band: stays red"
    assert water.update(PoolSignals(0.84, 0)) is Level.YELLOW
    assert water.update(PoolSignals(0.76, 0)) is Level.YELLOW
    assert water.update(PoolSignals(0.74, 0)) is Level.GREEN
    assert water.update(PoolSignals(0.1, 0.8)) is Level.RED, "most agents stale alone makes it red"


def test_breaker_opens_on_red_half_opens_and_closes_after_good_probes() -> None:
    breaker = Breaker(open_s=2.0, probes=1)
    assert breaker.observe(Level.RED, 0.0) is BreakerState.OPEN
    assert breaker.observe(Level.GREEN, 1.0) is BreakerState.OPEN
    assert breaker.observe(Level.GREEN, 2.0) is BreakerState.HALF_OPEN
    assert breaker.probes_left == 1
    breaker.spend_probe()
    assert breaker.probes_left == 0
    assert breaker.observe(Level.YELLOW, 2.1) is BreakerState.CLOSED
    assert breaker.probes_left == 0, "only a half-open breaker offers probes"


def test_breaker_reopens_when_the_probe_finds_red() -> None:
    breaker = Breaker(open_s=1.0, probes=1)
    breaker.observe(Level.RED, 0.0)
    breaker.observe(Level.RED, 1.0)
    breaker.spend_probe()
    assert breaker.observe(Level.RED, 1.1) is BreakerState.OPEN
    assert breaker.observe(Level.GREEN, 1.5) is BreakerState.OPEN


def _long(level: Level, breaker: BreakerState = BreakerState.CLOSED, probes_left: int = 0) -> list[Verdict]:
    return [
        verdict(PoolKind.LONG, level, breaker=breaker, probes_left=probes_left, rank=rank, ranks=3)
        for rank in range(3)
    ]


A, P, S = Verdict.ADMIT, Verdict.PROBE, Verdict.SHED


def test_lower_priorities_are_shed_first_in_the_long_pool() -> None:
    assert _long(Level.GREEN) == [A, A, A]
    assert _long(Level.YELLOW) == [A, A, S]
    assert _long(Level.RED) == [A, S, S]
    assert _long(Level.GREEN, BreakerState.OPEN) == [A, S, S]
    assert _long(Level.GREEN, BreakerState.HALF_OPEN, probes_left=1) == [A, P, P]
    assert _long(Level.GREEN, BreakerState.HALF_OPEN, probes_left=0) == [A, S, S]


def test_the_interactive_pool_sheds_only_its_lowest_priority_and_only_when_red() -> None:
    def interactive(level: Level, ranks: int = 3) -> list[Verdict]:
        return [
            verdict(
                PoolKind.INTERACTIVE, level, breaker=BreakerState.OPEN, probes_left=0, rank=r, ranks=ranks
            )
            for r in range(ranks)
        ]

    assert interactive(Level.YELLOW) == [A, A, A], "its breaker does not shed"
    assert interactive(Level.RED) == [A, A, S]
    assert interactive(Level.RED, ranks=1) == [A], "a single priority is never shed"


def test_wait_queue_orders_by_priority_then_arrival() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        queue = WaitQueue(size=3, clock=clock)
        low = queue.join(2, 100, 1000)
        normal = queue.join(1, 300, 1000)
        older = queue.join(1, 200, 1000)
        assert queue.join(2, 150, 1000) is None, "bounded: one that would stand last is turned away"
        assert low is not None and normal is not None and older is not None
        assert queue.is_head(older), "a rank, then since when it waits"
        queue.leave(older)
        assert queue.is_head(normal)
        woke = asyncio.create_task(queue.wait_change(low, clock() + 5))
        await asyncio.sleep(0)
        queue.leave(normal)
        await asyncio.wait_for(woke, 1)  # the head left: the new head is woken
        assert queue.is_head(low)

    asyncio.run(scenario())


def test_a_full_queue_gives_a_newcomer_ahead_of_the_last_waiter_its_place() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        queue = WaitQueue(size=2, clock=clock)
        low = queue.join(2, 100, 1000)
        normal = queue.join(1, 300, 1000)
        assert low is not None and normal is not None
        woke = asyncio.create_task(queue.wait_change(low, clock() + 5))
        await asyncio.sleep(0)
        urgent = queue.join(0, 400, 1000)
        assert urgent is not None and queue.is_head(urgent) and len(queue) == 2
        await asyncio.wait_for(woke, 1)  # the one pushed out is woken to leave
        assert queue.pushed_out(low) and not queue.pushed_out(normal)
        queue.leave(low)
        assert len(queue) == 2 and not queue.pushed_out(low)

    asyncio.run(scenario())


def test_a_wait_in_the_queue_ends_when_its_clock_reaches_the_deadline() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        queue = WaitQueue(size=1, clock=clock)
        place = queue.join(1, 100, 1000)
        assert place is not None
        waiting = asyncio.create_task(queue.wait_change(place, clock() + 5))
        while clock.sleeping == 0:
            await asyncio.sleep(0)
        clock.advance(4)
        await asyncio.sleep(0)
        assert not waiting.done()
        clock.advance(1)
        await asyncio.wait_for(waiting, 1)
        assert clock.sleeping == 0

    asyncio.run(scenario())
