"""One pool's pressure: its water level, its breaker, and the shedding verdict for each request.

`judge` is the one place where a pool's level and breaker change: it takes the pool's signals and
the time, moves the level (with hysteresis) and the breaker, and answers for one request by the
rules of `kvgate.policy.shedding`, spending a probe when it lets one through. Pure: time is passed
in, nothing is awaited.
"""

from __future__ import annotations

from kvgate.config import AdmissionConfig
from kvgate.policy.shedding import PoolKind, Verdict, verdict
from kvgate.policy.water import Breaker, BreakerState, Level, PoolSignals, WaterLevel


class PoolPressure:
    def __init__(self, kind: PoolKind, config: AdmissionConfig) -> None:
        self.kind = kind
        self._water = WaterLevel(config.water)
        self._breaker = Breaker(config.breaker_open_s, config.breaker_probes)
        self._ranks = len(config.priorities)

    @property
    def level(self) -> Level:
        return self._water.level

    @property
    def breaker(self) -> BreakerState:
        return self._breaker.state

    def judge(self, signals: PoolSignals, now: float, rank: int) -> Verdict:
        level = self._water.update(signals)
        state = self._breaker.observe(level, now)
        answer = verdict(
            self.kind,
            level,
            breaker=state,
            probes_left=self._breaker.probes_left,
            rank=rank,
            ranks=self._ranks,
        )
        if answer is Verdict.PROBE:
            self._breaker.spend_probe()
        return answer
