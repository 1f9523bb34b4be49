"""The soak's faults: when each one comes, and what is charged to it afterwards (pure; no I/O).

Faults, one at a time in a fixed cycle (`CYCLE`), one every `Chaos.every_s`:
- `agent`: a long node's agent SIGKILLed and started again (its ledger dies with it);
- `gate_kill`: the whole gate, supervisor and workers, SIGKILLed and started again RESTART_S later,
  as Kubernetes restarts a container;
- `worker`: the gate worker that holds Envoy's ext_proc connection SIGKILLed (the supervisor starts
  another);
- `node`: a long node's engine SIGKILLed and started again with an empty cache;
- `gate_term`: the gate SIGTERMed (it drains) and started again.
A fault that takes longer than a slot (a gate drains, then starts) delays the ones after it.

What each fault cost is read off the failed answers (`Failure`): each is charged to the latest fault
injected before it ended, as `in_flight` (sent before the kill), `while_down` (sent before the killed
process was back) or `after_back` (sent after: the bar is none), or to `steady` before any fault.
The agents' reservation events (lapsed renewals) are charged to a fault when they come from its kill
until one renewal period after it was back (`EVENT_SLACK_S` more, for the scrape), else to `steady`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from bench.soak_traffic import Failure
from kvgate.agent.sources.engines import promtext

FaultKind = Literal["agent", "gate_kill", "worker", "node", "gate_term"]
# Agent restarts twice a cycle: they were the soak's first fault, and the one memory is judged across.
CYCLE: tuple[FaultKind, ...] = ("agent", "gate_kill", "worker", "node", "gate_term", "agent")
# Slots: DURATION_SLOTS a run, but no closer than a gate's restart needs and no sparser than MAX_EVERY_S.
DURATION_SLOTS = 7
MIN_EVERY_S = 6.0
MAX_EVERY_S = 20.0
STEADY = "steady"
PHASES = ("in_flight", "while_down", "after_back")
# How late the soak's once-a-second scrape of an agent may see an event.
EVENT_SLACK_S = 2.0

HOLDER_TOKENS = "kvgate_agent_holder_tokens"
RESERVATION_EVENTS = "kvgate_agent_reservations_total"


@dataclass(frozen=True, slots=True)
class Planned:
    at_s: float  # since the traffic started
    kind: FaultKind


@dataclass(frozen=True, slots=True)
class Chaos:
    every_s: float
    planned: tuple[Planned, ...]

    @staticmethod
    def for_duration(duration_s: float) -> Chaos:
        """Faults at every_s, 2 every_s, ... up to a slot before the traffic ends (so each is over, and
        its effects seen, while traffic still flows)."""
        every_s = min(max(duration_s / DURATION_SLOTS, MIN_EVERY_S), MAX_EVERY_S)
        slots = int((duration_s - every_s) // every_s)
        planned = tuple(Planned(every_s * (i + 1), CYCLE[i % len(CYCLE)]) for i in range(slots))
        return Chaos(every_s, planned)


@dataclass(frozen=True, slots=True)
class Injected:
    """One fault as it happened, on time.monotonic()."""

    kind: FaultKind
    killed_at: float
    back_at: float  # when the restarted process served again (the kill itself for `worker`)
    holders: tuple[str, ...]  # the killed gate processes' holder names on the agents; () for the rest
    held_tokens: int | None  # what they held on the agents when the signal went; None: an agent was silent
    exit_code: int | None  # gate_term: the gate's exit code after its drain (0: clean)


def charge_failures(
    failures: Iterable[Failure], injected: Sequence[Injected]
) -> dict[str, dict[str, dict[str, int]]]:
    """{fault kind or STEADY: {phase: {outcome: n}}}; STEADY has the one phase `steady` (module doc)."""
    charged: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    by_time = sorted(injected, key=lambda e: e.killed_at)
    for failure in failures:
        event = next((e for e in reversed(by_time) if e.killed_at <= failure.ended_at), None)
        if event is None:
            kind, phase = STEADY, STEADY
        elif failure.sent_at < event.killed_at:
            kind, phase = event.kind, "in_flight"
        elif failure.sent_at <= event.back_at:
            kind, phase = event.kind, "while_down"
        else:
            kind, phase = event.kind, "after_back"
        outcomes = charged[kind][phase]
        outcomes[failure.outcome] = outcomes.get(failure.outcome, 0) + 1
    return {kind: dict(phases) for kind, phases in charged.items()}


def charge_events(
    events: Iterable[tuple[float, str, int]], injected: Sequence[Injected], renew_period_s: float
) -> dict[str, dict[str, int]]:
    """The agents' reservation events (time seen, event, count) as {fault kind or STEADY: {event: n}}."""
    charged: dict[str, dict[str, int]] = defaultdict(dict)
    by_time = sorted(injected, key=lambda e: e.killed_at)
    for seen_at, event, n in events:
        during = next(
            (
                e
                for e in reversed(by_time)
                if e.killed_at <= seen_at <= e.back_at + renew_period_s + EVENT_SLACK_S
            ),
            None,
        )
        counts = charged[STEADY if during is None else during.kind]
        counts[event] = counts.get(event, 0) + n
    return dict(charged)


def holder_tokens(page: str, holders: Iterable[str]) -> int:
    """What `holders` hold on the agent whose /metrics `page` is."""
    wanted = set(holders)
    samples = promtext.samples(page, HOLDER_TOKENS)
    return sum(int(s.value) for s in samples if promtext.label(s, "holder") in wanted)


def reservation_events(page: str) -> dict[str, int]:
    """An agent's reservation events since it started, by event (every reason together)."""
    counts: dict[str, int] = {}
    for sample in promtext.samples(page, RESERVATION_EVENTS):
        event = promtext.label(sample, "event")
        if event is not None:
            counts[event] = counts.get(event, 0) + int(sample.value)
    return counts


def new_events(before: Mapping[str, int], now: Mapping[str, int]) -> dict[str, int]:
    """Events counted between two scrapes of one agent process."""
    return {event: n - before.get(event, 0) for event, n in now.items() if n > before.get(event, 0)}
