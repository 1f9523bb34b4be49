"""Who is shed first as a pool heats up. The one rule: lower priorities go first.

Priorities are ranked 0 (most important) to n-1. Green sheds nobody; yellow sheds the lowest rank;
an open breaker sheds everything but rank 0; a half-open breaker admits its probes and sheds the rest
but rank 0.
"""

from __future__ import annotations

from kvgate.policy.water import Breaker, BreakerState, Level


def should_shed(level: Level, breaker: Breaker, rank: int, ranks: int) -> bool:
    if breaker.state is BreakerState.OPEN:
        return rank > 0
    if breaker.state is BreakerState.HALF_OPEN:
        return rank > 0 and not breaker.allow_probe()
    if level is Level.RED:
        return rank > 0
    if level is Level.YELLOW:
        return ranks > 1 and rank == ranks - 1
    return False
