"""The soak's pure parts (bench/soak_faults.py): which faults come when, what a failed answer or a
lapsed renewal is charged to, and the agents' /metrics lines the soak reads."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from bench.soak_faults import (
    CYCLE,
    MIN_EVERY_S,
    STEADY,
    Chaos,
    Injected,
    charge_events,
    charge_failures,
    holder_tokens,
    new_events,
    reservation_events,
)
from bench.soak_traffic import Failure, failed


@pytest.mark.parametrize("duration_s", [36.0, 45.0, 60.0, 600.0])
def test_every_fault_comes_at_least_once_and_before_the_traffic_ends(duration_s: float) -> None:
    chaos = Chaos.for_duration(duration_s)
    kinds = [p.kind for p in chaos.planned]
    assert set(kinds) == set(CYCLE)
    assert "gate_term" in kinds
    times = [p.at_s for p in chaos.planned]
    assert times == sorted(times)
    assert all(later - earlier >= MIN_EVERY_S for earlier, later in itertools.pairwise(times))
    # Each is over while traffic still flows, so what follows it is seen.
    assert times[-1] <= duration_s - chaos.every_s


def test_the_ten_minute_soak_repeats_every_fault_and_restarts_agents_most() -> None:
    counts = Counter(p.kind for p in Chaos.for_duration(600.0).planned)
    assert min(counts.values()) >= 4
    assert counts["agent"] > max(n for kind, n in counts.items() if kind != "agent")


def test_a_short_run_has_fewer_faults_not_closer_ones() -> None:
    chaos = Chaos.for_duration(20.0)
    assert chaos.every_s == MIN_EVERY_S
    assert [p.kind for p in chaos.planned] == ["agent", "gate_kill"]


def _fault(kind: str, killed_at: float, back_at: float) -> Injected:
    return Injected(kind, killed_at, back_at, (), None, None)  # type: ignore[arg-type]


def test_a_failure_is_charged_to_the_fault_it_followed_by_when_it_was_sent() -> None:
    faults = [_fault("gate_kill", 100.0, 106.0), _fault("node", 130.0, 134.0)]
    failures = [
        Failure("long", "fail_open interactive-0 400", 90.0, 95.0),  # before any fault
        Failure("long", "error 503", 99.0, 100.5),  # in flight on the killed gate
        Failure("long", "fail_open interactive-0 400", 103.0, 103.2),  # sent while it was down
        Failure("long", "fail_open interactive-0 400", 104.0, 104.1),
        Failure("short", "lost TimeoutError", 110.0, 125.0),  # sent after it was back
        Failure("long", "error 503", 129.0, 131.0),  # in flight on the killed node
    ]
    assert charge_failures(failures, faults) == {
        STEADY: {STEADY: {"fail_open interactive-0 400": 1}},
        "gate_kill": {
            "in_flight": {"error 503": 1},
            "while_down": {"fail_open interactive-0 400": 2},
            "after_back": {"lost TimeoutError": 1},
        },
        "node": {"in_flight": {"error 503": 1}},
    }


def test_only_failed_answers_are_failures() -> None:
    assert failed("long", "fail_open interactive-0 400")
    assert failed("short", "lost ClientConnectionError")
    assert failed("short", "error 503")
    assert failed("short", "refused 429 no_capacity")  # a short chat is never refused for capacity
    assert not failed("long_held", "refused 429 no_capacity")
    assert not failed("too_long", "refused 413 too_long")
    assert not failed("short", "ok")


def test_lapsed_renewals_are_charged_to_a_fault_until_a_renewal_period_after_it_was_back() -> None:
    faults = [_fault("agent", 10.0, 11.0), _fault("gate_kill", 40.0, 46.0)]
    period_s = 5.0
    events = [
        (5.0, "lapsed", 1),  # steady: before any fault
        (12.0, "lapsed", 2),  # the restarted agent did not know what its predecessor granted
        (17.5, "lapsed", 1),  # a renewal period and the scrape's slack after the agent was back
        (19.0, "lapsed", 4),  # past that: steady again
        (50.0, "lapsed", 1),
    ]
    assert charge_events(events, faults, period_s) == {
        STEADY: {"lapsed": 5},
        "agent": {"lapsed": 3},
        "gate_kill": {"lapsed": 1},
    }


AGENT_PAGE = """\
# HELP kvgate_agent_holder_tokens Tokens charged to the live reservations of each holder
# TYPE kvgate_agent_holder_tokens gauge
kvgate_agent_holder_tokens{holder="host:101"} 8192.0
kvgate_agent_holder_tokens{holder="host:1011"} 4096.0
kvgate_agent_holder_tokens{holder="host:102"} 1024.0
# TYPE kvgate_agent_reservations_total counter
kvgate_agent_reservations_total{event="granted",reason=""} 12.0
kvgate_agent_reservations_total{event="refused",reason="no_capacity"} 3.0
kvgate_agent_reservations_total{event="refused",reason="holder_cap"} 1.0
kvgate_agent_reservations_total{event="lapsed",reason=""} 2.0
"""


def test_a_holder_is_matched_by_its_whole_name() -> None:
    # host:101 is not host:1011: a pid that is a prefix of another must not add its tokens.
    assert holder_tokens(AGENT_PAGE, ["host:101"]) == 8192
    assert holder_tokens(AGENT_PAGE, ["host:101", "host:102"]) == 9216
    assert holder_tokens(AGENT_PAGE, ["host:999"]) == 0


def test_reservation_events_add_up_reasons_and_count_only_what_is_new() -> None:
    counts = reservation_events(AGENT_PAGE)
    assert counts == {"granted": 12, "refused": 4, "lapsed": 2}
    assert new_events({"granted": 10, "refused": 4}, counts) == {"granted": 2, "lapsed": 2}
