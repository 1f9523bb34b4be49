"""Retry-After from the agents' expected releases (kvgate.policy.retry_forecast): where and when a
refused request fits, promises that spread a burst, jitter and bounds, and the check of each answer."""

from __future__ import annotations

import dataclasses

import pytest
from test_water import node as water_node

from kvgate.agent.in_process import ManualClock
from kvgate.headroom.snapshot import ExpectedRelease, NodeView
from kvgate.policy.retry_forecast import (
    PROMISE_GRACE_S,
    WATCH_HORIZON_S,
    Basis,
    Promise,
    RetryPlanner,
    RetrySettings,
    forecast_fit,
)

T = 30_000  # one long request's tokens


def node(
    agent: str,
    headroom: int,
    releases: tuple[tuple[float, int], ...] = (),
    *,
    rate: float | None = 50.0,
    capacity: int = 80_000,
    freed: int = 0,
    age_s: float = 0.0,
    healthy: bool = True,
) -> NodeView:
    """test_water's node, with this module's capacity, expected releases, decode rate and freed tokens."""
    view = water_node(agent, headroom, healthy=healthy)
    assert view.headroom is not None
    h = dataclasses.replace(
        view.headroom,
        endpoint=f"{agent}:8000",
        capacity_tokens=capacity,
        used_tokens=None,
        reserved_tokens=capacity - headroom,
        reservations=len(releases),
        decode_tokens_per_s=rate,
        releases=tuple(ExpectedRelease(after, tokens) for after, tokens in releases),
        freed_tokens_total=freed,
    )
    return NodeView(agent, h, age_s, True, True, healthy)


def planner(
    clock: ManualClock,
    mode: str = "forecast",
    jitter: float = 0.0,
    draws: list[float] | None = None,
    **bounds: float,
) -> RetryPlanner:
    settings = RetrySettings(mode, jitter=jitter, **bounds)  # type: ignore[arg-type]
    values = iter(draws or [])
    return RetryPlanner(settings, clock, lambda: next(values, 0.0))


def test_the_earliest_node_whose_releases_cover_the_request_wins() -> None:
    nodes = [
        node("a", 10_000, ((4.0, 30_000), (9.0, 30_000))),
        node("b", 0, ((3.0, 20_000), (5.0, 20_000))),
        node("c", 40_000, rate=None),  # no rate: nothing to forecast from, even with room
    ]
    fit = forecast_fit(nodes, T, output_tokens=250)
    assert fit is not None
    # a: 10,000 + 30,000 at 4 s; b: 20,000 at 3 s is short, 40,000 at 5 s.
    assert (fit.agent, fit.after_s, fit.freed_mark, fit.run_s) == ("a", 4.0, 20_000, 5.0)


def test_a_node_too_small_for_the_request_or_unhealthy_is_never_counted_on() -> None:
    small = node("small", 0, ((1.0, 50_000),), capacity=20_000)
    sick = node("sick", 0, ((1.0, 50_000),), healthy=False)
    assert forecast_fit([small, sick], T, 250) is None


def test_release_times_count_from_the_agents_sample() -> None:
    fit = forecast_fit([node("a", 0, ((3.0, T),), age_s=0.4)], T, 250)
    assert fit is not None and fit.after_s == pytest.approx(2.6)


def test_a_request_that_fits_now_is_due_at_once_and_short_releases_are_no_forecast() -> None:
    now = forecast_fit([node("a", 50_000)], T, 250)
    assert now is not None and (now.after_s, now.freed_mark) == (0.0, 0)
    assert forecast_fit([node("a", 0, ((2.0, 10_000), (3.0, 10_000)))], T, 250) is None


def test_promises_queue_later_clients_behind_earlier_ones_and_end_again() -> None:
    """Two releases of 30k at 3 s: two clients are due at 3 s; the next two when those, admitted then,
    are expected to end (3 s + 250 tokens at 50 tokens/s)."""
    releases = ((3.0, T), (3.0, T))
    nodes = [node("a", 0, releases, freed=100)]
    ahead: list[Promise] = []
    due = []
    for _ in range(4):
        fit = forecast_fit(nodes, T, 250, ahead, now=0.0)
        assert fit is not None
        due.append((fit.after_s, fit.freed_mark))
        ahead.append(Promise("a", T, fit.after_s + fit.run_s, fit.after_s + PROMISE_GRACE_S))
    assert due == [(3.0, 100 + T), (3.0, 100 + 2 * T), (8.0, 100 + 3 * T), (8.0, 100 + 4 * T)]


def test_a_burst_of_refusals_is_spread_over_the_releases() -> None:
    clock = ManualClock(0.0)
    plan = planner(clock)
    nodes = [node("a", 0, ((3.0, T), (3.5, T))), node("b", 0, ((4.0, T),))]
    answers = [plan.advise(nodes, T, 250).retry_after_s for _ in range(6)]
    # a frees at 3 and 3.5, b at 4; then the first three, admitted then, end 5 s later.
    assert answers == [3.0, 3.5, 4.0, 8.0, 8.5, 9.0]


def test_jitter_only_ever_delays_and_the_bounds_hold() -> None:
    clock = ManualClock(0.0)
    plan = planner(clock, jitter=0.2, draws=[0.999, 0.5, 0.999], min_s=1.0, max_s=5.0)
    soon, later, last = node("a", 0, ((0.1, T),)), node("b", 0, ((2.0, T),)), node("c", 0, ((4.6, T),))
    answers = [plan.advise([n], T, 250).retry_after_s for n in (soon, later, last)]
    # 0.1 s x 1.2 is under min_s; 2 s x 1.1; 4.6 s x 1.2 is past max_s.
    assert answers == pytest.approx([1.0, 2.2, 5.0])


def test_without_a_forecast_the_fixed_value_is_jittered_and_fixed_mode_answers_it_as_is() -> None:
    clock = ManualClock(0.0)
    nothing = [node("a", 0, rate=None)]
    fallback = planner(clock, jitter=0.5, draws=[0.5], fixed_s=2.0).advise(nothing, T, 250)
    assert (fallback.retry_after_s, fallback.basis) == (2.5, Basis.FALLBACK)
    fixed = planner(clock, "fixed", jitter=0.5, fixed_s=2.0)
    forecastable = [node("a", 0, ((7.0, T),))]
    answers = [fixed.advise(forecastable, T, 250) for _ in range(3)]
    assert {(a.retry_after_s, a.basis) for a in answers} == {(2.0, Basis.FIXED)}


def test_each_answer_is_checked_when_its_node_has_freed_what_it_needed() -> None:
    clock = ManualClock(0.0)
    plan = planner(clock)
    nodes = [node("a", 0, ((3.0, T), (3.0, T)), freed=500)]
    assert [plan.advise(nodes, T, 250).retry_after_s for _ in range(2)] == [3.0, 3.0]
    clock.advance(2.0)
    assert plan.check([node("a", 0, freed=500)]) == []
    clock.advance(1.4)  # one reservation ended at 3.4 s: 0.4 s after the first client was due
    (first,) = plan.check([node("a", T, freed=500 + T)])
    assert first.basis is Basis.FORECAST and first.error_s == pytest.approx(0.4)
    clock.advance(0.2)
    (second,) = plan.check([node("a", T, freed=500 + 2 * T)])
    assert second.error_s == pytest.approx(0.6)
    assert plan.watching == 0


def test_fixed_answers_promise_nothing_and_are_checked_when_their_request_alone_fits() -> None:
    clock = ManualClock(0.0)
    plan = planner(clock, "fixed", fixed_s=2.0)
    nodes = [node("a", 0, ((5.0, T), (9.0, T)))]
    assert [plan.advise(nodes, T, 250).retry_after_s for _ in range(2)] == [2.0, 2.0]
    clock.advance(5.0)
    checked = plan.check([node("a", T, freed=T)])
    assert [(c.basis, c.error_s) for c in checked] == [(Basis.FIXED, 3.0)] * 2


def test_answers_without_a_forecast_are_checked_too() -> None:
    """No measured rate (a reservation-only node): the fallback answer is still measured, against the
    node that needs to free the least."""
    clock = ManualClock(0.0)
    plan = planner(clock, fixed_s=2.0)
    nodes = [node("a", 5_000, rate=None, freed=100), node("b", 20_000, rate=None, freed=0)]
    assert plan.advise(nodes, T, 250).basis is Basis.FALLBACK
    clock.advance(1.0)
    assert plan.check([node("b", 20_000, rate=None, freed=T - 20_001)]) == []
    (checked,) = plan.check([node("b", T, rate=None, freed=T - 20_000)])
    assert (checked.basis, checked.error_s) == (Basis.FALLBACK, -1.0)


def test_watches_that_run_out_are_reported_and_memory_is_bounded() -> None:
    clock = ManualClock(0.0)
    settings = RetrySettings("forecast", jitter=0.0)
    plan = RetryPlanner(settings, clock, lambda: 0.0, max_pending=3)
    nodes = [node("a", 0, tuple((1.0 + i, T) for i in range(10)))]
    for _ in range(5):
        plan.advise(nodes, T, 250)
    assert plan.watching == 3
    clock.advance(WATCH_HORIZON_S + 20)
    checked = plan.check([node("a", 0)])
    assert [c.error_s for c in checked] == [None, None, None] and plan.watching == 0


def test_promises_lapse_once_their_client_was_due() -> None:
    clock = ManualClock(0.0)
    plan = planner(clock)
    nodes = [node("a", 0, ((3.0, T),))]
    assert plan.advise(nodes, T, 250).retry_after_s == 3.0
    clock.advance(3.0 + PROMISE_GRACE_S + 0.1)
    # The first client came back and holds a reservation the agent now publishes.
    later = [node("a", 0, ((4.0, T),))]
    assert plan.advise(later, T, 250).retry_after_s == pytest.approx(4.0)


def test_settings_reject_incoherent_bounds() -> None:
    with pytest.raises(ValueError, match="min_s"):
        RetrySettings(min_s=5.0, max_s=1.0)
    with pytest.raises(ValueError, match="jitter"):
        dataclasses.replace(RetrySettings(), jitter=-0.1)
