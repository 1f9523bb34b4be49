"""The admissible ratio steered by the engine's preemption counter (kvgate.agent.ratio), alone and
through the node's state: what the ledger grants against and what the stream publishes."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.ratio import RatioSettings, SteeredRatio, Step
from kvgate.agent.sources.engines import EngineKind, EngineReading, PageState
from kvgate.headroom.snapshot import ReserveReason

START = RatioSettings.around(0.9)  # 0.80 .. 0.98, +0.005 per 10 s of waiting, -0.05 and 60 s still


def windows_with_waits(ratio: SteeredRatio, start: float, n: int, counter: int | None = 0) -> float:
    """`n` windows in which a request waits and the engine's counter stays put; the time after them."""
    now = start
    for _ in range(n):
        ratio.waited()
        now += START.window_s
        ratio.observe(now, counter)
    return now


def test_a_preemption_drops_the_ratio_at_once() -> None:
    ratio = SteeredRatio(START, 0.0)
    assert ratio.observe(0.0, 7) is None and ratio.value == 0.9  # the counter's first value: a baseline
    assert ratio.observe(0.1, 8) is Step.DOWN
    assert ratio.value == pytest.approx(0.85)
    assert ratio.steps == {"up": 0, "down": 1}


def test_the_ratio_is_frozen_after_a_preemption() -> None:
    ratio = SteeredRatio(START, 0.0)
    ratio.observe(0.0, 0)
    ratio.observe(1.0, 1)
    # Requests wait through the whole freeze: nothing rises.
    now = windows_with_waits(ratio, 1.0, 5, counter=1)
    assert now < 1.0 + START.freeze_s and ratio.value == pytest.approx(0.85)
    ratio.waited()
    ratio.observe(1.0 + START.freeze_s - 0.1, 1)
    assert ratio.value == pytest.approx(0.85)
    # The first full window after the freeze, with a wait in it, is the first step up.
    thawed = 1.0 + START.freeze_s
    ratio.observe(thawed, 1)
    ratio.waited()
    assert ratio.observe(thawed + START.window_s - 0.1, 1) is None
    assert ratio.observe(thawed + START.window_s, 1) is Step.UP
    assert ratio.value == pytest.approx(0.855)


def test_the_engines_usage_leads_the_ratio_before_any_preemption() -> None:
    full = SteeredRatio(START, 0.0)
    assert full.observe(0.0, 0, 0.99) is None and full.value == 0.9  # the first reading: a baseline
    ratio = SteeredRatio(START, 0.0)
    ratio.observe(0.0, 0, 0.5)
    # A window with a wait whose usage peaked past 0.92 teaches no rise, though nothing preempted.
    ratio.waited()
    ratio.observe(5.0, 0, 0.93)
    assert ratio.observe(10.0, 0, 0.6) is None and ratio.value == 0.9
    # The next window stays under it: the rise comes.
    ratio.waited()
    assert ratio.observe(20.0, 0, 0.91) is Step.UP and ratio.value == pytest.approx(0.905)
    # Usage at 0.97 is a preemption about to happen: down at once, frozen, the counter still.
    assert ratio.observe(20.5, 0, 0.97) is Step.DOWN and ratio.value == pytest.approx(0.855)
    assert ratio.observe(21.0, 0, 0.99) is None and ratio.value == pytest.approx(0.855)  # frozen: once
    now = windows_with_waits(ratio, 21.0, 5)
    assert now < 20.5 + START.freeze_s and ratio.value == pytest.approx(0.855)


def test_the_ratio_rises_only_while_requests_wait() -> None:
    ratio = SteeredRatio(START, 0.0)
    for second in range(0, 300, 1):
        ratio.observe(float(second), 0)  # five minutes without anyone waiting
    assert ratio.value == 0.9 and ratio.steps["up"] == 0
    windows_with_waits(ratio, 300.0, 2)
    assert ratio.value == pytest.approx(0.91) and ratio.steps["up"] == 2


def test_the_ratio_never_passes_its_bounds() -> None:
    ratio = SteeredRatio(START, 0.0)
    ratio.observe(0.0, 0)
    now = windows_with_waits(ratio, 0.0, 100)  # 1,000 s of waiting: 20 steps would be enough
    assert ratio.value == pytest.approx(START.ceiling) and ratio.value <= START.ceiling
    counter = 0
    for _ in range(10):  # a preemption every minute and more: never under the floor
        counter += 3
        now += 61.0
        ratio.observe(now, counter)
    assert ratio.value == pytest.approx(START.floor) and ratio.value >= START.floor
    with pytest.raises(ValueError, match="floor <= start <= ceiling"):
        RatioSettings(start=0.9, floor=0.95)


def test_a_level_that_preempted_is_not_reached_again_soon() -> None:
    ratio = SteeredRatio(START, 0.0)
    ratio.observe(0.0, 0)
    now = windows_with_waits(ratio, 0.0, 10)  # 0.95
    assert ratio.value == pytest.approx(0.95)
    now += 1.0
    ratio.observe(now, 1)  # preempted at 0.95
    assert ratio.value == pytest.approx(0.90) and ratio.ceiling == pytest.approx(0.945)
    now = windows_with_waits(ratio, now + START.freeze_s, 40, counter=1)  # 400 s of waiting
    assert ratio.value == pytest.approx(0.945)
    # Ten minutes without a preemption give one step of the old ceiling back.
    windows_with_waits(ratio, now, 30, counter=1)
    assert ratio.ceiling == pytest.approx(0.95) and ratio.value == pytest.approx(0.95)


def test_an_engine_without_a_preemption_counter_keeps_the_fixed_share() -> None:
    ratio = SteeredRatio(START, 0.0)
    windows_with_waits(ratio, 0.0, 50, counter=None)
    assert ratio.value == 0.9 and ratio.steps == {"up": 0, "down": 0}


def test_a_counter_that_vanishes_stops_the_rise_and_one_that_appears_counts() -> None:
    ratio = SteeredRatio(START, 0.0)
    now = windows_with_waits(ratio, 0.0, 4)
    assert ratio.value == pytest.approx(0.92)
    ratio.observe(now + 1, None)  # the page lost its counter: back to the fixed share, no higher
    assert ratio.value == 0.9
    # A labelled counter is written from its first increment: appearing at 2, it is 2 preemptions.
    assert ratio.observe(now + 2, 2) is Step.DOWN and ratio.value == pytest.approx(0.85)


def test_an_engine_restart_is_not_a_preemption() -> None:
    ratio = SteeredRatio(START, 0.0)
    ratio.observe(0.0, 40)
    assert ratio.observe(1.0, 0) is None  # the counter went back: the engine restarted
    assert ratio.value == 0.9 and ratio.steps["down"] == 0
    assert ratio.observe(2.0, 1) is Step.DOWN  # counted from the new baseline


def test_bounds_equal_to_the_start_fix_the_ratio() -> None:
    fixed = SteeredRatio(RatioSettings.around(0.9, floor=0.9, ceiling=0.9), 0.0)
    now = windows_with_waits(fixed, 0.0, 20)
    fixed.observe(now + 1, 5)
    assert fixed.value == 0.9 and fixed.steps == {"up": 0, "down": 0}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reading(preemptions: int | None, used: int = 10_000) -> EngineReading:
    # No running request: figures that stay put for longer than 30 s are then no sign of a stuck engine.
    return EngineReading(
        EngineKind.VLLM, PageState.READY, 100_000, used, 0, 0, preemptions, ("engine 0",), "rule", 30.0
    )


def steer(node: NodeState, clock: Clock, windows: int, tokens: int, preemptions: int = 0) -> None:
    """`windows` step windows, in each of which a Reserve of `tokens` is refused for room."""
    for i in range(windows):
        refused = node.reserve(f"wait-{clock.now}-{i}", tokens, 0)
        assert refused.reason == ReserveReason.INSUFFICIENT_HEADROOM
        clock.now += START.window_s
        node.observe_engine(reading(preemptions))


def test_a_grant_the_raised_ratio_allows_was_refused_before() -> None:
    clock = Clock()
    node = NodeState(NodeSettings("n", "e:1", safety_ratio=0.9), clock, uses_engine=True, uses_nvml=False)
    node.observe_engine(reading(0))
    # 82,000 + 10,000 in use = 92,000 > 0.90 x 100,000: refused, and the refusal is a wait for room.
    steer(node, clock, 4, 82_000)
    published = node.snapshot(0)
    assert published.safety_ratio == pytest.approx(0.92) and published.admissible_tokens == 92_000
    assert node.reserve("now-it-fits", 82_000, 0).granted


def test_a_waiter_that_held_its_place_raises_the_ratio_when_granted_and_a_first_try_does_not() -> None:
    """A grant to a waiter that held its place here (its claim) is demand met. A grant to a try that
    only names the time it waits since is not: a gate names its request's arrival on every try."""
    clock = Clock()
    node = NodeState(NodeSettings("n", "e:1"), clock, uses_engine=True, uses_nvml=False)
    idle = reading(0, used=0)
    node.observe_engine(idle)
    assert node.reserve("first-try", 1_000, 0, waiting_since_unix_ns=1).granted
    clock.now += START.window_s
    node.observe_engine(idle)
    assert node.budget().safety_ratio == pytest.approx(0.9), "a grant on arrival is no wait"

    # 89,500 > 0.90 x 100,000 - 1,000: refused near the window's end, and it holds its place here.
    clock.now += START.window_s - 1
    node.observe_engine(idle)
    assert not node.reserve("big", 89_500, 0, waiting_since_unix_ns=2, hold_slot=True).granted
    clock.now += 1  # the refusal's window: up
    node.observe_engine(idle)
    assert node.budget().safety_ratio == pytest.approx(0.905)
    clock.now += 0.5  # within the claim's 2 s: the next window's only Reserve is its grant
    node.observe_engine(idle)
    node.release("first-try")
    assert node.reserve("big", 89_500, 0, waiting_since_unix_ns=2, hold_slot=True).granted
    clock.now += START.window_s - 0.5
    node.observe_engine(idle)
    assert node.budget().safety_ratio == pytest.approx(0.91)


def test_a_preemption_cuts_what_the_node_grants_at_once() -> None:
    clock = Clock()
    node = NodeState(NodeSettings("n", "e:1"), clock, uses_engine=True, uses_nvml=False)
    node.observe_engine(reading(3))
    assert node.snapshot(0).headroom_tokens == 80_000
    clock.now += 0.1
    node.observe_engine(reading(4))
    after = node.snapshot(0)
    assert after.safety_ratio == pytest.approx(0.85) and after.headroom_tokens == 75_000
    assert not node.reserve("r", 76_000, 0).granted


def test_settings_bounds_are_checked() -> None:
    base = NodeSettings("n", "e:1")
    with pytest.raises(ValueError, match="floor <= start <= ceiling"):
        dataclasses.replace(base, safety_ratio_max=0.85)
    assert NodeSettings("n", "e:1", safety_ratio=1.0).ratio().ceiling == 1.0
