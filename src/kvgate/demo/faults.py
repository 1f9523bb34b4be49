"""`kvgate demo --trace FILE --faults SPEC`: processes killed during a replay, and what each one cost.

SPEC is a comma-separated list of `TARGET:AT[:SIGNAL]`, for example
`gate:40s,agent:100s,queue:160s:TERM,node:220s`:
- TARGET: `gate` (the gate process), `agent` (the first long node's agent), `queue` (`kvgate queue`) or
  `node` (the first long node's engine);
- AT: seconds since the run's first request, as the replay runs (after --speed), with or without the
  `s`;
- SIGNAL: `KILL` (the default: an OOM kill, a node lost) or `TERM` (a rolling update's graceful stop).
Each killed process starts again RESTART_S later, as Kubernetes restarts a container, and a node
comes back with an empty cache (kvgate.demo.fault_injection does it). What a fault cost is read off
the replay's requests, attributed to the latest fault before each one ended (`fault_figures`):
- `lost`: requests lost, and `lost_not_in_flight`: of them, those that were not in flight on the
  killed process when it died (the bar: none);
- `long_to_interactive`: long prompts that reached an interactive node without the gate's answer
  (Envoy failed open) or were refused there for their length;
- `held_tokens_back_s`: how long after the kill the dead gate's reservations were free on every agent
  (null when it held none, and for the other targets, which hold nothing of their own: an agent's
  ledger dies with it, and the queue's replicas share one holder whose jobs run again elsewhere);
- `admission_back_s`: how long after the kill long requests were admitted at their pre-fault rate
  again (the share of long arrivals admitted in a 10 s window against the 30 s before the kill).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.demo.load import Result
from kvgate.errors import ConfigError

Target = Literal["gate", "agent", "queue", "node"]
TARGETS: tuple[Target, ...] = ("gate", "agent", "queue", "node")
Signal = Literal["KILL", "TERM"]
# A killed process comes back this long after it died: a container restart's back-off and start.
RESTART_S = 5.0
# Admission is back when the share of long arrivals admitted over ADMISSION_WINDOW_S reaches
# ADMISSION_BACK of the share over BEFORE_S before the kill.
ADMISSION_WINDOW_S = 10.0
BEFORE_S = 30.0
ADMISSION_BACK = 0.9

_PART = re.compile(r"(?P<target>[a-z]+):(?P<at>\d+(?:\.\d+)?)s?(?::(?P<signal>[A-Za-z]+))?")


@dataclass(frozen=True, slots=True)
class Fault:
    target: Target
    at_s: float  # since the run's first request
    signal: Signal = "KILL"


@dataclass(frozen=True, slots=True)
class Injected:
    """What happened to one fault during the replay, on the requests' clock (Result.sent_s)."""

    fault: Fault
    killed_s: float
    back_s: float  # when the restarted process listened again
    target_node: str | None  # the node whose agent or engine was killed
    held_tokens: int | None  # what the killed gate held on the agents when it died
    held_back_s: float | None  # after the kill, when the agents showed none of it held any more


def parse_faults(spec: str, replay_s: float) -> tuple[Fault, ...]:
    """The faults of `spec`, in time order; ConfigError naming the part that is wrong."""
    faults = []
    for part in (p.strip() for p in spec.split(",")):
        match = _PART.fullmatch(part)
        if match is None:
            raise ConfigError(f"--faults: {part!r} is not TARGET:SECONDS[:KILL|TERM] (e.g. gate:40s)")
        target, signal = match["target"], (match["signal"] or "KILL").upper()
        if target not in TARGETS:
            raise ConfigError(f"--faults: {part!r}: the target is one of {', '.join(TARGETS)}")
        if signal not in ("KILL", "TERM"):
            raise ConfigError(f"--faults: {part!r}: the signal is KILL or TERM")
        at_s = float(match["at"])
        if at_s >= replay_s:
            raise ConfigError(f"--faults: {part!r} comes after the replay's {replay_s:.0f} s")
        faults.append(Fault(target, at_s, signal))  # type: ignore[arg-type]
    return tuple(sorted(faults, key=lambda f: f.at_s))


def fault_figures(
    injected: Sequence[Injected],
    results: Sequence[Result],
    *,
    interactive_nodes: frozenset[str],
    interactive_max_tokens: int,
    first_s: float,
) -> list[dict[str, Any]]:
    """report.json's `faults` of a run: per fault, what it cost (module doc). `first_s`: the first
    request's sent_s, which fault times count from."""
    figures = []
    for i, event in enumerate(injected):
        until = injected[i + 1].killed_s if i + 1 < len(injected) else float("inf")
        mine = [r for r in results if event.killed_s <= _ended(r) < until]
        lost = [r for r in mine if r.outcome == "lost"]
        on_it = [r for r in lost if _in_flight_on(r, event)]
        wrong_pool = [r for r in mine if _long_on_interactive(r, interactive_nodes, interactive_max_tokens)]
        figures.append(
            {
                "target": event.fault.target,
                "signal": event.fault.signal,
                "at_s": round(event.killed_s - first_s, 1),
                "restarted_after_s": round(event.back_s - event.killed_s, 1),
                "lost": len(lost),
                "lost_not_in_flight": len(lost) - len(on_it),
                "long_to_interactive": len(wrong_pool),
                "held_tokens": event.held_tokens,
                "held_tokens_back_s": None if event.held_back_s is None else round(event.held_back_s, 1),
                "admission_back_s": _admission_back_s(results, event.killed_s),
            }
        )
    return figures


def _ended(result: Result) -> float:
    return result.sent_s + (result.finished_s or 0.0)


def _in_flight_on(result: Result, event: Injected) -> bool:
    """Whether a lost request was in flight on the killed process when it died."""
    if result.sent_s > event.killed_s:
        return False
    target = event.fault.target
    if target == "gate":
        return True  # the gate holds every request's ext_proc stream while it runs
    if target == "queue":
        return result.queued or result.node is None
    return result.node in (event.target_node, None)


def _long_on_interactive(
    result: Result, interactive_nodes: frozenset[str], interactive_max_tokens: int
) -> bool:
    if result.node not in interactive_nodes or result.planned.prompt_tokens <= interactive_max_tokens:
        return False
    return result.gate_reason == "" or result.status == 400


def _admitted_share(results: Sequence[Result], start: float, end: float) -> float | None:
    longs = [r for r in results if r.planned.kind == "long" and start <= r.sent_s < end]
    if not longs:
        return None
    return sum(1 for r in longs if r.outcome == "ok" and r.gate_reason == "long") / len(longs)


def _admission_back_s(results: Sequence[Result], killed_s: float) -> float | None:
    before = _admitted_share(results, killed_s - BEFORE_S, killed_s)
    if not before:
        return None
    last = max((r.sent_s for r in results), default=killed_s)
    t = killed_s
    while t + ADMISSION_WINDOW_S <= last:
        share = _admitted_share(results, t, t + ADMISSION_WINDOW_S)
        if share is not None and share >= ADMISSION_BACK * before:
            return round(t - killed_s, 1)
        t += 1.0
    return None


def fault_lines(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per fault of each run that had faults, for under the demo's table ("" for none)."""
    lines = []
    for run, summary in runs.items():
        for f in summary.get("faults") or ():
            held = "-" if f["held_tokens_back_s"] is None else f"{f['held_tokens_back_s']} s"
            back = "never" if f["admission_back_s"] is None else f"{f['admission_back_s']} s"
            lines.append(
                f"{run}: {f['target']} SIG{f['signal']} at {f['at_s']} s (back after "
                f"{f['restarted_after_s']} s): lost {f['lost']} ({f['lost_not_in_flight']} not in flight), "
                f"long to interactive {f['long_to_interactive']}, held KV free after {held}, "
                f"admission back after {back}"
            )
    return "\n".join(lines)
