"""Count exactly only as far as the decision needs: the job an exact count runs (in a worker process).

The texts are counted chunk by chunk. After each chunk, the tokens counted so far plus the fast band
of what remains bound the total; once no threshold lies inside those bounds, the class is certain and
counting stops. The reported total then is the counted part plus the remainder's estimate, kept
inside the certain bounds, so it always falls in the class that was decided.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.estimate.exact import TokenizerFile, chunks, count_chunk, load_counter
from kvgate.estimate.fast import EMPTY, FastEstimator, TextBand

WORKER_NICENESS = 10


@dataclass(frozen=True, slots=True)
class Counted:
    tokens: int  # prompt text tokens: exact when complete, else a value inside the certain bounds
    complete: bool  # False when counting stopped early because the class was already certain
    counted_chars: int


def settled(low: int, high: int, thresholds: Sequence[int]) -> bool:
    """No threshold separates low from high: every total in [low, high] is in the same class."""
    return all(high <= limit or low > limit for limit in thresholds)


def safe_total(estimate: int, low: int, high: int, thresholds: Sequence[int]) -> int:
    """The total to decide with when nothing can be counted and [low, high] may reach across
    thresholds, given as `policy.thresholds` gives them: pool boundaries, then the refusal limit.

    A band reaching across the limit keeps the total at the limit, so only a band wholly above it is
    refused. A band reaching across a pool boundary below the limit puts the total just above the
    boundary, in the larger pool, which can hold what the smaller would refuse."""
    if not thresholds:
        return estimate
    *pools, limit = thresholds
    total = estimate
    for boundary in pools:
        if boundary < limit and low <= boundary < high:
            total = max(total, boundary + 1)
    if low <= limit < high:
        total = min(total, limit)
    return total


@dataclass(frozen=True, slots=True)
class CountJob:
    """Everything a worker needs, picklable: what to count and when to stop."""

    tokenizer: TokenizerFile
    fast: FastEstimator
    texts: tuple[str, ...]
    extra: int  # tokens outside the texts (fixed prompt costs + output budget)
    thresholds: tuple[int, ...]  # empty: count everything


def run(job: CountJob) -> Counted:
    counter = load_counter(job.tokenizer)
    pieces = [
        (chunk, i == 0, i == len(parts) - 1)
        for text in job.texts
        for parts in [list(chunks(text, counter))]
        for i, chunk in enumerate(parts)
    ]
    remaining = _suffix_bands(job.fast, [chunk for chunk, _, _ in pieces]) if job.thresholds else None
    counted = 0
    chars = 0
    for index, (chunk, first, last) in enumerate(pieces):
        counted += count_chunk(counter, chunk, first, last)
        chars += len(chunk)
        if remaining is None or index + 1 == len(pieces):
            continue
        rest = remaining[index + 1]
        base = job.extra + counted
        if settled(base + rest.low, base + rest.high, job.thresholds):
            return Counted(counted + min(max(rest.tokens, rest.low), rest.high), False, chars)
    return Counted(counted, True, chars)


def _suffix_bands(fast: FastEstimator, pieces: list[str]) -> list[TextBand]:
    """remaining[i]: the fast band of pieces[i:], summed piece by piece (wider than one band)."""
    remaining = [EMPTY] * (len(pieces) + 1)
    for i in range(len(pieces) - 1, -1, -1):
        remaining[i] = remaining[i + 1] + fast.estimate(pieces[i])
    return remaining


def start_worker(tokenizer: TokenizerFile) -> None:
    """Set up a counting process: below the gate in CPU priority, so that on a busy machine the
    scheduler runs the event loop first; tokenizer loaded before the first request needs it."""
    os.nice(WORKER_NICENESS)
    load_counter(tokenizer).count("warm up")
