"""When the agent's stream sends: when something a gate acts on changed, at most once a period, and
at least every heartbeat.

Pure. The sampling loop builds the node's NodeHeadroom every period; this says whether to send it to
one subscriber (each has its own pacer: kvgate.agent.subscribers). Encoding and sending a message to
each subscriber is most of an idle agent's cost (about 0.5 ms per message per subscriber, against
0.06 ms to build it: shared/research/admission-efficiency.md, section 2), and an idle node's figures
do not move. So a message goes out when, against what the subscriber knows (the last message sent to
it, and the figures the answers to its own calls told it since: `told`):
- anything the gates' policy or ledger view reads changed: health and its reason, capacity and where
  it comes from, the admissible ratio, reserved tokens, reservations, tokens freed, the prefix
  summary's generation, the soft-pool role and lend cap, the waiter a head claim is for, the engine
  read;
- engine usage, headroom or what the node lends moved by more than `USAGE_TOLERANCE` of capacity
  (1 %: engine usage creeps by a few hundred tokens a period while requests decode; a gate's node
  choice compares headroom with requests thousands of tokens large, and a Reserve is checked against
  the agent's exact figures anyway);
- the decode rate moved by more than 10 %, or the release forecast or the head claim's slot by more
  than a quarter second (or 10 %) once the time since the last message is taken off it (the forecast
  counts from its sample, and a gate ages it by the message's age: kvgate.policy.retry_forecast);
- or a heartbeat has passed since the last message (`heartbeat_s`), so a gate tells a quiet agent
  from a hung one (kvgate.config.headroom: a node is fresh for a few heartbeats).
Messages not sent still take a sample number: a gap in `seq` is samples the agent kept to itself.
A heartbeat of 0 sends every period: what agents did before, and the compatibility mode.
"""

from __future__ import annotations

from enum import StrEnum

from kvgate.headroom.snapshot import ExpectedRelease, HeadClaim, LedgerFigures, NodeHeadroom

USAGE_TOLERANCE = 0.01
DECODE_RATE_TOLERANCE = 0.1
RELEASE_SLACK_S = 0.25
RELEASE_SLACK = 0.1


class Cause(StrEnum):
    FIRST = "first"
    CHANGE = "change"
    HEARTBEAT = "heartbeat"
    PERIOD = "period"  # heartbeat 0: every period


class StreamPacer:
    def __init__(self, period_s: float, heartbeat_s: float, usage_tolerance: float = USAGE_TOLERANCE) -> None:
        if heartbeat_s and heartbeat_s < period_s:
            raise ValueError(f"a heartbeat ({heartbeat_s} s) is 0 or at least a period ({period_s} s)")
        self._period_s = period_s
        self._heartbeat_s = heartbeat_s
        self._tolerance = usage_tolerance
        self._last: NodeHeadroom | None = None
        self._sent_at = float("-inf")

    def due(self, headroom: NodeHeadroom, now: float) -> Cause | None:
        """Why `headroom` should be sent now, or None to keep it."""
        if self._last is None:
            return Cause.FIRST
        if not self._heartbeat_s:
            return Cause.PERIOD
        if changed(self._last, headroom, now - self._sent_at, self._tolerance):
            return Cause.CHANGE
        # Ticks come on the period's grid: half a period of slack keeps a 1 s heartbeat at 1 s.
        if now - self._sent_at + self._period_s / 2 >= self._heartbeat_s:
            return Cause.HEARTBEAT
        return None

    def sent(self, headroom: NodeHeadroom, now: float) -> None:
        self._last = headroom
        self._sent_at = now

    def told(self, figures: LedgerFigures, now: float) -> None:
        """The subscriber had `figures` at `now` in the answer to a call of its own, and took them into its
        view: from now on they are what it knows of them, as if sent with its last message (so the
        forecast is kept counting from that message, as the subscriber ages it)."""
        if self._last is not None:
            self._last = figures.onto(self._last, now - self._sent_at)


def changed(before: NodeHeadroom, after: NodeHeadroom, elapsed_s: float, tolerance: float) -> str:
    """What a gate would see differently in `after` than in `before`, sent `elapsed_s` earlier ("" when
    nothing worth a message)."""
    for name, a, b in (
        ("health", before.healthy, after.healthy),
        ("reason", before.reason, after.reason),
        ("endpoint", before.endpoint, after.endpoint),
        ("capacity", before.capacity_tokens, after.capacity_tokens),
        ("capacity source", before.capacity_source, after.capacity_source),
        ("usage source", before.usage_source, after.usage_source),
        ("safety ratio", before.safety_ratio, after.safety_ratio),
        ("reserved", before.reserved_tokens, after.reserved_tokens),
        ("reservations", before.reservations, after.reservations),
        ("freed", before.freed_tokens_total, after.freed_tokens_total),
        ("prefix summary", before.prefix.generation, after.prefix.generation),
        ("role", before.role, after.role),
        ("lend cap", before.lend_max_prompt_tokens, after.lend_max_prompt_tokens),
        ("engine", (before.engine_kind, before.engines), (after.engine_kind, after.engines)),
    ):
        if a != b:
            return name
    slack = tolerance * max(before.capacity_tokens, after.capacity_tokens, 1)
    for name, x, y in (
        ("used", before.used_tokens, after.used_tokens),
        ("headroom", before.headroom_tokens, after.headroom_tokens),
        ("lend", before.lend_tokens, after.lend_tokens),
    ):
        if (x is None) != (y is None) or (x is not None and y is not None and abs(x - y) > slack):
            return name
    if _moved(before.decode_tokens_per_s, after.decode_tokens_per_s):
        return "decode rate"
    if _forecast_moved(before.releases, after.releases, elapsed_s):
        return "releases"
    if _head_moved(before.head, after.head, elapsed_s):
        return "head"
    return ""


def _moved(before: float | None, after: float | None) -> bool:
    if before is None or after is None:
        return (before is None) != (after is None)
    return abs(after - before) > DECODE_RATE_TOLERANCE * before


def _late(was: float, now: float, elapsed_s: float) -> bool:
    """Whether a time `now` s ahead differs from one `was` s ahead `elapsed_s` ago by more than the slack."""
    expected = max(0.0, was - elapsed_s)
    return abs(now - expected) > max(RELEASE_SLACK_S, RELEASE_SLACK * expected)


def _head_moved(before: HeadClaim | None, after: HeadClaim | None, elapsed_s: float) -> bool:
    """A new head, or its slot moved. A head's fair service drifts as its tenant is served: that goes
    out with the next message, not as a change of its own."""
    if before is None or after is None:
        return before is not after
    if (before.tokens, before.waiting_since_unix_ns, before.rank) != (
        after.tokens,
        after.waiting_since_unix_ns,
        after.rank,
    ):
        return True
    if before.slot_after_s is None or after.slot_after_s is None:
        return (before.slot_after_s is None) != (after.slot_after_s is None)
    return _late(before.slot_after_s, after.slot_after_s, elapsed_s)


def _forecast_moved(
    before: tuple[ExpectedRelease, ...], after: tuple[ExpectedRelease, ...], elapsed_s: float
) -> bool:
    if len(before) != len(after):
        return True
    for was, now in zip(before, after, strict=True):
        if was.tokens != now.tokens or _late(was.after_s, now.after_s, elapsed_s):
            return True
    return False
