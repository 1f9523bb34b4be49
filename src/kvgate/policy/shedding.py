"""Who is shed as a pool heats up: both rules, side by side. Lower priorities always go first.

Priorities are ranked 0 (most important) to n-1 (`ranks` = n).

The long-context pool (reserved per request): green sheds nobody; yellow sheds the lowest rank;
red sheds everything but rank 0; an open breaker sheds everything but rank 0; a half-open breaker
lets its probes through and sheds the rest but rank 0.

The interactive pool (not reserved per request; its max-model-len already bounds each request):
only red sheds, and only the lowest rank, so chat keeps flowing while the pool is merely busy.
"""

from __future__ import annotations

import enum

from kvgate.policy.water import BreakerState, Level


class PoolKind(enum.StrEnum):
    LONG = "long"
    INTERACTIVE = "interactive"


class Verdict(enum.Enum):
    ADMIT = "admit"
    PROBE = "probe"  # admitted as one of a half-open breaker's probes
    SHED = "shed"


def verdict(
    kind: PoolKind, level: Level, *, breaker: BreakerState, probes_left: int, rank: int, ranks: int
) -> Verdict:
    lowest = ranks > 1 and rank == ranks - 1
    if kind is PoolKind.INTERACTIVE:
        return Verdict.SHED if level is Level.RED and lowest else Verdict.ADMIT
    if rank == 0:
        return Verdict.ADMIT
    if breaker is BreakerState.OPEN:
        return Verdict.SHED
    if breaker is BreakerState.HALF_OPEN:
        return Verdict.PROBE if probes_left > 0 else Verdict.SHED
    if level is Level.RED or (level is Level.YELLOW and lowest):
        return Verdict.SHED
    return Verdict.ADMIT
