"""When a client refused for want of capacity should come back: a forecast, and a check of it.

Pure, over the gate's headroom view; time and randomness are injected.

Each node's agent says when its live reservations are expected to end and what each frees
(kvgate.agent.releases), and how many tokens ended reservations have freed in all. A request of
`tokens` fits a node once its headroom plus what has ended since covers it: the forecast is the
earliest such moment over the nodes whose whole capacity can ever hold it.

Refused clients come back, so each answer is a promise: the tokens it counts on are taken from what
the node frees for everyone answered after it (first come, first served), and its request is expected
to run from then for its output budget at the node's decode rate and free its tokens again. So a burst
of refusals is told to come back one after the other as the capacity each needs frees, not all at once.
A promise lapses a moment after its client was due (`PROMISE_GRACE_S`): by then it came back, was
admitted or refused, and holds a reservation of its own or a new promise.

The answer is the forecast made later by up to `jitter` of itself (never earlier: a client that comes
back early is held by admission or refused again), within [min_s, max_s]. When nothing can be forecast
(no node has measured its decode rate, or what is expected to end does not cover the request) it is
`fixed_s`, jittered the same way; in `fixed` mode it is always `fixed_s`, as is, and promises nothing.

The check: each forecast from expected releases is watched until the node it counted on has freed the
tokens it needed (its agent's freed-tokens counter reaching the mark), and the error is that moment
less the moment the client was told to come back: positive when the client came back too early,
negative when the capacity waited for it. A fixed answer is checked the same way, against the first
moment enough freed for its request alone (its clients keep no promises). Watches are bounded in
number and time; one that runs out unresolved is reported as such.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from kvgate.headroom.snapshot import NodeView

RetryMode = Literal["forecast", "fixed"]

# How long after its client was due a promise still holds the capacity it counted on.
PROMISE_GRACE_S = 1.0
# Promises and watches kept at once (past it the oldest go) and how long a watch waits past its due.
MAX_PENDING = 1024
WATCH_HORIZON_S = 120.0


class Basis(StrEnum):
    """What a Retry-After was made from (a metric label)."""

    FORECAST = "forecast"  # the agents' expected releases
    FALLBACK = "fallback"  # forecast mode, nothing to forecast from: fixed_s, jittered
    FIXED = "fixed"  # fixed mode


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """admission.retry_after and its bounds (kvgate.config.AdmissionConfig)."""

    mode: RetryMode = "forecast"
    fixed_s: float = 2.0  # admission.retry_after_s
    min_s: float = 0.5
    max_s: float = 60.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.min_s <= self.max_s or self.jitter < 0 or self.fixed_s <= 0:
            raise ValueError(
                f"retry bounds need 0 <= min_s <= max_s, jitter >= 0, fixed_s > 0: got min_s {self.min_s}, "
                f"max_s {self.max_s}, jitter {self.jitter}, fixed_s {self.fixed_s}"
            )


@dataclass(frozen=True, slots=True)
class Fit:
    """Where and when a request is expected to fit."""

    agent: str
    after_s: float  # from now
    # The node's freed-tokens counter once enough has ended for the request (its share included).
    freed_mark: int
    run_s: float  # how long the request, once admitted there, is expected to run


@dataclass(frozen=True, slots=True)
class Promise:
    """Capacity a refused client was told it would find: `tokens` on `agent`, taken from what the node
    frees for the clients answered after it, and freed again at `ends_at`."""

    agent: str
    tokens: int
    ends_at: float
    holds_until: float


@dataclass(frozen=True, slots=True)
class RetryAdvice:
    retry_after_s: float
    basis: Basis


@dataclass(frozen=True, slots=True)
class Checked:
    """A watched answer resolved: the capacity freed `error_s` after the client was told to come back
    (negative: before). `error_s` is None when the watch ran out first."""

    basis: Basis
    error_s: float | None


@dataclass(frozen=True, slots=True)
class _Watch:
    agent: str
    freed_mark: int
    answered_at: float  # when its client was told to come back
    until: float
    basis: Basis


def forecast_fit(
    nodes: Sequence[NodeView],
    tokens: int,
    output_tokens: int,
    promises: Sequence[Promise] = (),
    now: float = 0.0,
) -> Fit | None:
    """The earliest node and moment `tokens` fit, counting expected releases and earlier `promises`
    (those held at `now`, on the clock their times are on); None when no node's expected releases
    cover them."""
    best: Fit | None = None
    for node in nodes:
        h = node.headroom
        if not node.usable or h is None or not h.decode_tokens_per_s:
            continue
        if h.admissible_tokens < tokens:
            continue  # the node could never hold it
        ahead = [p for p in promises if p.agent == node.agent]
        # What the node must free, beyond its headroom now, for this request and those promised before.
        need = tokens - h.headroom_tokens + sum(p.tokens for p in ahead)
        at = _first_reaching(_freeing(node, ahead, now), need)
        if at is not None and (best is None or at < best.after_s):
            mark = h.freed_tokens_total + max(need, 0)
            best = Fit(node.agent, at, mark, output_tokens / h.decode_tokens_per_s)
    return best


def _closest(nodes: Sequence[NodeView], tokens: int) -> tuple[str, int] | None:
    """The usable node that must free the fewest tokens for `tokens` to fit, and its freed-tokens mark
    once it has; None when no node could ever hold them."""
    best: tuple[int, str, int] | None = None
    for node in nodes:
        h = node.headroom
        if not node.usable or h is None:
            continue
        if h.admissible_tokens < tokens:
            continue
        need = max(tokens - h.headroom_tokens, 0)
        if best is None or need < best[0]:
            best = (need, node.agent, h.freed_tokens_total + need)
    return None if best is None else (best[1], best[2])


def _freeing(node: NodeView, ahead: Sequence[Promise], now: float) -> list[tuple[float, int]]:
    """(seconds from now, tokens) the node is expected to free: its reservations, then its promises."""
    assert node.headroom is not None
    # Release times count from the agent's sample, which is age_s old.
    age = node.age_s if math.isfinite(node.age_s) else 0.0
    freeing = [(max(0.0, r.after_s - age), r.tokens) for r in node.headroom.releases]
    freeing += [(max(0.0, p.ends_at - now), p.tokens) for p in ahead]
    freeing.sort()
    return freeing


def _first_reaching(freeing: list[tuple[float, int]], need: int) -> float | None:
    if need <= 0:
        return 0.0
    total = 0
    for after_s, tokens in freeing:
        total += tokens
        if total >= need:
            return after_s
    return None


class RetryPlanner:
    """Retry-After for capacity refusals, and the check of each one (see the module doc)."""

    def __init__(
        self,
        settings: RetrySettings,
        clock: Callable[[], float],
        rng: Callable[[], float],
        *,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._settings = settings
        self._clock = clock
        self._rng = rng
        self._promises: deque[Promise] = deque(maxlen=max_pending)
        self._watches: deque[_Watch] = deque(maxlen=max_pending)

    @property
    def watching(self) -> int:
        return len(self._watches)

    def advise(self, nodes: Sequence[NodeView], tokens: int, output_tokens: int) -> RetryAdvice:
        """When a refused request of `tokens` (`output_tokens` of them its output budget) should come
        back; its promise and its watch are recorded."""
        now = self._clock()
        self._drop_lapsed(now)
        fixed_s = self._settings.fixed_s
        if self._settings.mode == "fixed":
            # Its clients keep no promise (they all come back after fixed_s): checked against the first
            # moment enough frees for the request alone.
            fit = forecast_fit(nodes, tokens, output_tokens)
            advice = RetryAdvice(fixed_s, Basis.FIXED)
        else:
            fit = forecast_fit(nodes, tokens, output_tokens, self._promises, now)
            if fit is None:
                advice = RetryAdvice(self._bounded(fixed_s * self._spread()), Basis.FALLBACK)
            else:
                advice = RetryAdvice(self._bounded(fit.after_s * self._spread()), Basis.FORECAST)
        answered = now + advice.retry_after_s
        if fit is not None:
            # The client's request runs from whichever comes later: the capacity or the client.
            starts = now + max(fit.after_s, advice.retry_after_s)
            if advice.basis is Basis.FORECAST:
                self._promises.append(
                    Promise(fit.agent, tokens, starts + fit.run_s, starts + PROMISE_GRACE_S)
                )
            self._watches.append(
                _Watch(fit.agent, fit.freed_mark, answered, starts + WATCH_HORIZON_S, advice.basis)
            )
        elif (target := _closest(nodes, tokens)) is not None:
            # No forecast to go by (no measured rate): the answer is still checked, against the node
            # that needs to free the least for the request.
            agent, mark = target
            self._watches.append(_Watch(agent, mark, answered, answered + WATCH_HORIZON_S, advice.basis))
        return advice

    def check(self, nodes: Sequence[NodeView]) -> list[Checked]:
        """Resolve the watches whose node has freed what they needed, and those that ran out."""
        if not self._watches:
            return []
        now = self._clock()
        freed = {n.agent: n.headroom.freed_tokens_total for n in nodes if n.headroom is not None}
        done: list[Checked] = []
        keep: list[_Watch] = []
        for w in self._watches:
            if w.freed_mark <= freed.get(w.agent, -1):
                done.append(Checked(w.basis, now - w.answered_at))
            elif now > w.until:
                done.append(Checked(w.basis, None))
            else:
                keep.append(w)
        if done:
            self._watches = deque(keep, maxlen=self._watches.maxlen)
        return done

    def _drop_lapsed(self, now: float) -> None:
        if any(p.holds_until <= now for p in self._promises):
            held = [p for p in self._promises if p.holds_until > now]
            self._promises = deque(held, maxlen=self._promises.maxlen)

    def _spread(self) -> float:
        return 1.0 + self._settings.jitter * self._rng()

    def _bounded(self, seconds: float) -> float:
        return min(self._settings.max_s, max(self._settings.min_s, seconds))
