"""Water levels per pool (green / yellow / red) with hysteresis, and the breaker that red trips.

A level follows what the engines report (their KV usage) and how many agents have gone stale, nothing
else. The gate's own line of requests waiting for room is not a signal: it is the gate working as
intended, and shedding for it would send every normal request away because of a line the gate
itself holds (issue 28, item 3). That line overflows one request at a time instead, by the wait
queue's bound (admission.queue_size: queue_full) and each request's admission.max_wait_s.

A level rises as soon as any signal crosses its rising threshold and falls only once every signal is
back below the falling threshold (rising minus `hysteresis`), so a pool hovering at a threshold does
not flap. Red opens the breaker; after `open_s` it half-opens and lets `probes` requests through; the
level seen after them decides whether it closes or opens again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.config import WaterThresholds
from kvgate.headroom.snapshot import NodeView


class Level(enum.IntEnum):
    GREEN = 0
    YELLOW = 1
    RED = 2


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """kv: the engines' KV usage over the pool's capacity; stale: share of nodes."""

    kv: float
    stale: float


def pool_signals(nodes: Sequence[NodeView]) -> PoolSignals:
    """The pool's signals from its nodes' latest headroom.

    kv is the engines' own KV usage (what the engine reports, else observed tokens over capacity), not
    the reservations: a pool packed with granted reservations is working as intended and must keep
    queueing, while engine usage near the physical limit means pressure the reservations do not
    explain (other traffic, runaway decodes) and is what should shed.
    """
    capacity = used = 0.0
    stale = 0
    for node in nodes:
        data = node.headroom
        if not node.fresh or data is None:
            stale += 1
            continue
        if data.kv_usage is not None:
            used += data.kv_usage * data.capacity_tokens
        elif data.used_tokens is not None:
            used += data.used_tokens
        else:
            continue
        capacity += data.capacity_tokens
    kv = used / capacity if capacity else 0.0
    return PoolSignals(kv=kv, stale=stale / len(nodes) if nodes else 0.0)


def _raw_level(signals: PoolSignals, t: WaterThresholds, slack: float) -> Level:
    if signals.kv >= t.red_kv - slack or signals.stale >= t.red_stale - slack:
        return Level.RED
    if signals.kv >= t.yellow_kv - slack or signals.stale >= t.yellow_stale - slack:
        return Level.YELLOW
    return Level.GREEN


class WaterLevel:
    def __init__(self, thresholds: WaterThresholds) -> None:
        self._thresholds = thresholds
        self.level = Level.GREEN

    def update(self, signals: PoolSignals) -> Level:
        rising = _raw_level(signals, self._thresholds, 0.0)
        if rising > self.level:
            self.level = rising
        else:
            # Falling: judged against thresholds lowered by the hysteresis band.
            self.level = min(self.level, _raw_level(signals, self._thresholds, self._thresholds.hysteresis))
        return self.level


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    def __init__(self, open_s: float, probes: int) -> None:
        self._open_s = open_s
        self._probes = probes
        self.state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probes_left = 0

    def observe(self, level: Level, now: float) -> BreakerState:
        if self.state is BreakerState.CLOSED and level is Level.RED:
            self._open(now)
        elif self.state is BreakerState.OPEN and now - self._opened_at >= self._open_s:
            self.state = BreakerState.HALF_OPEN
            self._probes_left = self._probes
        elif self.state is BreakerState.HALF_OPEN and self._probes_left == 0:
            if level is Level.RED:
                self._open(now)
            else:
                self.state = BreakerState.CLOSED
        return self.state

    @property
    def probes_left(self) -> int:
        """Requests a half-open breaker still lets through; the level after them decides."""
        return self._probes_left if self.state is BreakerState.HALF_OPEN else 0

    def spend_probe(self) -> None:
        assert self.probes_left > 0, "a probe was spent that the breaker did not offer"
        self._probes_left -= 1

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = now
