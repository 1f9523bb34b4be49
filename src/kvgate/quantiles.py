"""Quantiles of small samples, by nearest rank: the answer is always one of the values seen.

Pure. Used where a limit is sized from recent history (an interactive node's chat reserve,
kvgate.agent.lending; the learned output budget, kvgate.policy.output_lengths): a value that was
seen, never one interpolated between two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def nearest_rank(values: Iterable[int], q: float) -> int:
    """The `q` quantile of `values` (0 for none)."""
    ordered = sorted(values)
    if not ordered:
        return 0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
