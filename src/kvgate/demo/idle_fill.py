"""Who takes the KV a tenant leaves idle when it goes quiet (issue 30: "F fills the idle KV while A is
off"), from a run's request results and its long nodes' samples (pure).

A tenant with an on/off schedule (`TenantTraffic.on_s`, `off_s`; its stretches are
`TenantTraffic.stretches`, the rule the planner sends by) is off from the planned end of each on
stretch, once every request it sent before then has been answered or refused (a flood's last requests
still wait and run for seconds after it stops sending), to the start of its next on stretch or the end
of the traffic. For each such tenant:

- `kv_occupancy_off` / `kv_occupancy_on`: the long nodes' mean KV usage over the samples taken while it
  is off, and while it is on; `kv_occupancy_ratio` is the first over the second. A pool that stays as
  full while the tenant is off leaves no KV idle: work-conserving.
- `filler_share_off` / `filler_share_on`: the part of all long-request service (prompt + 2 x output,
  as the engine did the work: kvgate.demo.fairness) that went to the lower-priority tenants (the
  scenario's batch tenant), which are owed only what the others leave.
- `off_s`: the seconds it counted as off.

The report holds them as `idle_fill.<tenant>` of each run of a scenario with such tenants (the
fairness scenario's D, on and off every minute). The flood A sends all through the scenario;
`quiet_at_end` gives the run that `python -m bench fairness` adds with A off for the last minute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kvgate.demo.fairness import STEP_S, service_by_step
from kvgate.demo.load import Result
from kvgate.demo.scenario import Scenario, TenantTraffic
from kvgate.demo.scrape import Sample

Stretch = tuple[float, float]


def quiet_at_end(scenario: Scenario, tenant: str) -> Scenario:
    """`scenario` with `tenant` off for the last fairness window of its traffic (`python -m bench
    fairness` runs the flood A so). Apart, not in the scenario itself: the fair shares are water-filled
    window by window from what each tenant asked for there, and the flood's last requests, refused
    while it goes quiet, would count as asked for in its minute off."""
    found = next((t for t in scenario.tenants if t.name == tenant), None)
    if found is None:
        raise ValueError(f"the scenario has no tenant {tenant!r}")
    timing = scenario.timing
    on_s = timing.burst_phase_s - timing.fairness_window_s - found.first_at_s
    if on_s <= 0:
        raise ValueError(f"tenant {tenant!r} must send for longer than one fairness window")
    quiet = dataclasses.replace(found, on_s=on_s, off_s=timing.fairness_window_s)
    return dataclasses.replace(scenario, tenants=tuple(quiet if t is found else t for t in scenario.tenants))


def idle_fill(
    results: Sequence[Result],
    timeline: Mapping[str, list[Sample]],
    long_nodes: Sequence[str],
    weights: Mapping[str, float],
    *,
    tenants: Sequence[TenantTraffic],
    traffic_s: float,
    lower_priority: Collection[str] = (),
    step_s: float = STEP_S,
) -> dict[str, dict[str, Any]]:
    """The figures above for each of `tenants` that goes off within `traffic_s`."""
    service = service_by_step(results, weights, step_s)
    # Raw service (the weight taken back out), per step.
    raw = {t: [v * weights.get(t, 1.0) for v in row] for t, row in service.items()}
    samples = [
        (s.t_s, s.metrics.kv_usage)
        for node in long_nodes
        for s in timeline.get(node, [])
        if s.metrics is not None and s.t_s < traffic_s
    ]
    figures: dict[str, dict[str, Any]] = {}
    for tenant in tenants:
        on, planned_off = tenant.stretches(traffic_s)
        off = [s for s in (_quiet(results, tenant.name, stretch) for stretch in planned_off) if s[1] > s[0]]
        if not off:
            continue
        occupancy_off, occupancy_on = _mean_within(samples, off), _mean_within(samples, on)
        figures[tenant.name] = {
            "off_s": round(sum(end - start for start, end in off), 1),
            "kv_occupancy_off": occupancy_off,
            "kv_occupancy_on": occupancy_on,
            "kv_occupancy_ratio": (
                round(occupancy_off / occupancy_on, 3) if occupancy_on and occupancy_off is not None else None
            ),
            "filler_share_off": _share_within(raw, lower_priority, off, step_s),
            "filler_share_on": _share_within(raw, lower_priority, on, step_s),
        }
    return figures


def _quiet(results: Sequence[Result], tenant: str, stretch: Stretch) -> Stretch:
    """The part of a planned off stretch after the tenant's earlier requests have all ended."""
    start, end = stretch
    ends = [
        r.sent_s + (r.finished_s if r.finished_s is not None else (r.ttft_s or 0.0))
        for r in results
        if r.planned.kind == "long" and r.planned.tenant == tenant and r.sent_s < start
    ]
    return max([start, *ends]), end


def _within(t: float, stretches: Sequence[Stretch]) -> bool:
    return any(start <= t < end for start, end in stretches)


def _mean_within(samples: Sequence[tuple[float, float]], stretches: Sequence[Stretch]) -> float | None:
    values = [usage for t, usage in samples if _within(t, stretches)]
    return round(sum(values) / len(values), 4) if values else None


def _share_within(
    raw: Mapping[str, Sequence[float]], tenants: Collection[str], stretches: Sequence[Stretch], step_s: float
) -> float | None:
    """The part of the service given in the steps whose middle falls in `stretches` that `tenants` got."""
    given = 0.0
    theirs = 0.0
    for tenant, row in raw.items():
        for index, amount in enumerate(row):
            if _within((index + 0.5) * step_s, stretches):
                given += amount
                if tenant in tenants:
                    theirs += amount
    return round(theirs / given, 4) if given else None
