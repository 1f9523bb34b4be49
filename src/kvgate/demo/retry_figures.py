"""What the gate's /metrics says of its Retry-After answers (kvgate.policy.retry_forecast), as the
demo reports it: how many capacity refusals were answered, how many of those answers were checked
against when their capacity freed, and how close they came.

The error histogram is signed (positive: the capacity freed after the client was due back), so its
exposition has buckets but no `_sum` or `_count` (prometheus_client leaves them out of histograms with
negative buckets, as OpenMetrics asks): the count is the +Inf bucket, and closeness is read from the
buckets, as shares within ±0.5 s and ±1 s and the bucket bound the median falls in. Pure.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

from kvgate.telemetry import RETRY_AFTER, RETRY_AFTER_ERROR

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} (\S+)$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_UNRESOLVED = "kvgate_gate_retry_after_unresolved_total"


@dataclass(frozen=True, slots=True)
class RetryFigures:
    answers: int  # capacity refusals answered with a Retry-After, on every basis
    checked: int  # answers whose capacity has freed since (their error is known)
    unresolved: int  # answers whose capacity had not freed when their watch ran out
    within_half_s: float | None  # of the checked, the share within ±0.5 s
    within_1_s: float | None  # within ±1 s
    # The smallest bucket bound at or under which half the errors fall (signed seconds); None past
    # the last finite bucket.
    median_bound_s: float | None


def read_retry_figures(page: str) -> RetryFigures:
    """The figures over every basis (forecast, fallback, fixed) on a gate's /metrics page."""
    answers = 0.0
    unresolved = 0.0
    buckets: dict[float, float] = defaultdict(float)  # le -> cumulative count, summed over bases
    for name, labels, value in _SAMPLE.findall(page):
        if name == f"{RETRY_AFTER}_count":
            answers += float(value)
        elif name == _UNRESOLVED:
            unresolved += float(value)
        elif name == f"{RETRY_AFTER_ERROR}_bucket":
            bound = dict(_LABEL.findall(labels)).get("le", "+Inf")
            buckets[math.inf if bound == "+Inf" else float(bound)] += float(value)
    checked = buckets.get(math.inf, 0.0)
    return RetryFigures(
        answers=round(answers),
        checked=round(checked),
        unresolved=round(unresolved),
        within_half_s=_within(buckets, 0.5, checked),
        within_1_s=_within(buckets, 1.0, checked),
        median_bound_s=_median_bound(buckets, checked),
    )


def _within(buckets: dict[float, float], bound: float, checked: float) -> float | None:
    if not checked or bound not in buckets or -bound not in buckets:
        return None
    return round((buckets[bound] - buckets[-bound]) / checked, 3)


def _median_bound(buckets: dict[float, float], checked: float) -> float | None:
    if not checked:
        return None
    bound = next(bound for bound in sorted(buckets) if buckets[bound] >= checked / 2)
    return bound if math.isfinite(bound) else None  # past the last bucket: no bound to give
