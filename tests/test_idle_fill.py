"""Who takes the KV a tenant leaves idle while it is off (kvgate.demo.idle_fill): issue 30's "F fills
the idle KV while A is off"."""

from __future__ import annotations

import pytest

from kvgate.demo.idle_fill import idle_fill, quiet_at_end
from kvgate.demo.load import Result
from kvgate.demo.report import format_table
from kvgate.demo.scenario import Planned, TenantTraffic, builtin_scenario, load_scenario, plan
from kvgate.demo.scrape import NodeMetrics, Sample


def served(tenant: str, sent: float, ttft: float, done: float, *, prompt: int = 1_000) -> Result:
    planned = Planned(sent, "long", prompt, 1, 0, tenant=tenant)
    return Result(planned, sent, "ok", 200, ttft, done, 0, prompt_tokens=prompt)


def refused(tenant: str, sent: float, after: float) -> Result:
    planned = Planned(sent, "long", 1_000, 1, 0, tenant=tenant)
    return Result(planned, sent, "429", 429, None, after, 0, prompt_tokens=1_000)


def usage(*points: tuple[float, float]) -> list[Sample]:
    return [Sample(t, NodeMetrics(u, 0, 0, 0, 0, 0, 1_000)) for t, u in points]


WEIGHTS = {"A": 1.0, "C": 1.0, "F": 1.0}


def test_a_schedule_s_stretches_are_cut_at_the_end_of_the_traffic() -> None:
    on, off = TenantTraffic(first_at_s=0.0, on_s=60.0, off_s=60.0).stretches(180.0)
    assert on == [(0.0, 60.0), (120.0, 180.0)]
    assert off == [(60.0, 120.0)]
    on, off = TenantTraffic(first_at_s=10.0, on_s=170.0, off_s=60.0).stretches(240.0)
    assert on == [(10.0, 180.0)]
    assert off == [(180.0, 240.0)]


def test_the_off_stretch_starts_once_the_tenant_s_last_requests_have_ended() -> None:
    """A flood's last requests wait and run on after it stops sending: the pool is not idle of it until
    they end. A's request sent at 9 s ends at 13 s (and one refused at 12.5 s), so A counts as off from
    13 s, and the usage sampled at 11 s, while A still ran, is not counted as off."""
    results = [
        served("A", 9.0, 1.0, 4.0),
        refused("A", 9.0, 3.5),
        served("F", 14.0, 0.5, 2.0),
    ]
    timeline = {"long-0": usage((5.0, 0.8), (11.0, 0.9), (15.0, 0.6), (18.0, 0.4))}
    figures = idle_fill(
        results,
        timeline,
        ["long-0"],
        WEIGHTS,
        tenants=[TenantTraffic("A", on_s=10.0, off_s=10.0)],
        traffic_s=20.0,
        lower_priority={"F"},
    )
    a = figures["A"]
    assert a["off_s"] == pytest.approx(7.0)
    assert a["kv_occupancy_off"] == pytest.approx(0.5)
    assert a["kv_occupancy_on"] == pytest.approx(0.8)
    assert a["kv_occupancy_ratio"] == pytest.approx(0.625)


def test_the_filler_s_share_is_of_the_service_given_in_each_stretch() -> None:
    """While A is on, A and C take it all; while A is off, F (lower priority) gets half of what is given.
    Samples past the traffic's end (the drain) count in neither stretch."""
    results = [
        served("A", 1.0, 1.0, 1.0, prompt=3_000),
        served("C", 2.0, 1.0, 1.0, prompt=1_000),
        served("C", 12.0, 1.0, 1.0, prompt=2_000),
        served("F", 13.0, 1.0, 1.0, prompt=2_000),
    ]
    timeline = {
        "long-0": usage((1.0, 0.9), (12.5, 0.7), (25.0, 0.0)),
        "long-1": usage((1.0, 0.7), (12.5, 0.9), (25.0, 0.0)),
    }
    figures = idle_fill(
        results,
        timeline,
        ["long-0", "long-1"],
        WEIGHTS,
        tenants=[TenantTraffic("A", on_s=10.0, off_s=10.0)],
        traffic_s=20.0,
        lower_priority={"F"},
    )
    a = figures["A"]
    assert a["filler_share_on"] == 0.0
    assert a["filler_share_off"] == pytest.approx(0.5)
    assert a["kv_occupancy_on"] == pytest.approx(0.8)
    assert a["kv_occupancy_off"] == pytest.approx(0.8)
    assert a["kv_occupancy_ratio"] == pytest.approx(1.0)


def test_a_tenant_that_never_goes_quiet_within_the_traffic_has_no_figures() -> None:
    """A's last request runs past the end of its off stretch, so it is never off; a tenant without an
    off stretch before the traffic ends is not asked about."""
    results = [served("A", 9.0, 1.0, 15.0)]
    figures = idle_fill(
        results,
        {"long-0": usage((5.0, 0.8))},
        ["long-0"],
        WEIGHTS,
        tenants=[TenantTraffic("A", on_s=10.0, off_s=10.0), TenantTraffic("C", on_s=30.0, off_s=10.0)],
        traffic_s=20.0,
    )
    assert figures == {}


def test_the_report_table_shows_the_figures_to_four_places() -> None:
    """One place printed a Jain's index of 0.9975 as 1.0 and a share of 0.164 as 0.2."""
    run = {
        "outcomes": {},
        "jain_mean": 0.9975,
        "tenants": {"A": {"share": 0.164, "fair_share": 0.162, "long_ttft_p99_ms": 4129.3}},
        "idle_fill": {
            "A": {"kv_occupancy_off": 0.7012, "kv_occupancy_ratio": 0.933, "filler_share_off": 0.1}
        },
    }
    rows = {
        line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1]
        for line in format_table({"run": run}).splitlines()[2:]
    }
    assert rows["jain_mean"] == "0.9975"
    assert (rows["A share"], rows["A fair_share"], rows["A long_ttft_p99_ms"]) == (
        "0.1640",
        "0.1620",
        "4,129.3",
    )
    assert rows["while A is off: kv_occupancy_off"] == "0.7012"
    assert rows["while A is off: kv_occupancy_ratio"] == "0.9330"
    assert rows["while A is off: filler_share_off"] == "0.1000"
    assert rows["while A is off: filler_share_on"] == "-"


def test_the_flood_goes_quiet_for_the_last_window_and_nobody_else_changes() -> None:
    scenario = load_scenario(builtin_scenario("fairness"))
    quiet = quiet_at_end(scenario, "A")
    (a,) = [t for t in quiet.tenants if t.name == "A"]
    assert (a.on_s, a.off_s) == (120.0, 60.0)
    assert [t for t in quiet.tenants if t.name != "A"] == [t for t in scenario.tenants if t.name != "A"]
    planned = [
        r for r in plan(quiet, quiet.timing.burst_phase_s, True) if r.tenant == "A" and r.kind == "long"
    ]
    assert planned and max(r.at_s for r in planned) < 120.0
    with pytest.raises(ValueError, match="no tenant 'Z'"):
        quiet_at_end(scenario, "Z")
