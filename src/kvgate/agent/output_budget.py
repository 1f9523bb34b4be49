"""How much output a node's requests really generate: what a reservation's output budget is projected
at, in place of the `max_tokens` it declared (or the gate's default when it named none).

Pure. Reasoning models and agents declare `max_tokens` 10-100x above what they generate; holding the
declared budget makes a node look full while most of it will never be written. The node learns the
output of each reservation that ended (its hold time x the measured per-sequence decode rate, at most
its declared budget) into a histogram of the last `keep` ends, and projects a request at
min(declared, q99 of that history), never below `floor`. A request that generates past its projection
is projected again, at the next level: q99.9, then q99.9 more than it has generated (a rolling clip),
always within what it declared.

Until the history holds `min_samples` ends, the projection is SGLang's clip: at most 4,096 tokens more
than generated (sgl-project/sglang `python/sglang/srt/managers/schedule_policy.py` charges running
requests min(max_new_tokens - generated, CLIP_MAX_NEW_TOKENS_ESTIMATION), 4,096 by default, read from
SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION).

An under-projection is not a preemption: the engine's usage still bounds admission, so a request that
holds more than projected shows up at once as drift (kvgate.agent.ledger).
"""

from __future__ import annotations

import math
from collections import deque

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION default
# Ends remembered: enough for q99.9 to mean something, small enough to follow a change of traffic
# within minutes on a busy node.
KEEP = 1024
# Ends needed before the history replaces the clip: q99 of fewer than 100 is its maximum, by luck.
MIN_SAMPLES = 100
# No learned projection below a short chat answer, whatever the history says.
FLOOR = 256
Q_PROJECT = 0.99
Q_OVERRUN = 0.999
# Histogram buckets: 4 a doubling from 16 tokens (each edge 19% above the last), up to 16 x 2^20
# tokens, above any model's context. A quantile reads as its bucket's upper edge: at most 19% high.
_FIRST_EDGE = 16
_PER_DOUBLING = 4
_BUCKETS = 81
_EDGES = tuple(math.ceil(_FIRST_EDGE * 2 ** (i / _PER_DOUBLING)) for i in range(_BUCKETS))


def _bucket(tokens: int) -> int:
    if tokens <= _FIRST_EDGE:
        return 0
    i = math.ceil(_PER_DOUBLING * math.log2(tokens / _FIRST_EDGE))
    while i > 0 and _EDGES[i - 1] >= tokens:  # float log2 may land one bucket high
        i -= 1
    return min(i, _BUCKETS - 1)


class OutputHistory:
    """The outputs of the last `keep` ended reservations, as a histogram: O(1) to learn, a fixed
    `keep` + 81 integers of memory, a quantile in one pass over 81 buckets."""

    def __init__(self, keep: int = KEEP, min_samples: int = MIN_SAMPLES, floor: int = FLOOR) -> None:
        if keep < 1 or not 1 <= min_samples <= keep or floor < 1:
            raise ValueError("need keep >= 1, 1 <= min_samples <= keep and floor >= 1")
        self._min_samples = min_samples
        self._floor = floor
        self._ends: deque[int] = deque(maxlen=keep)  # bucket of each remembered end, oldest first
        self._counts = [0] * _BUCKETS

    def __len__(self) -> int:
        return len(self._ends)

    def learn(self, tokens: int) -> None:
        """One ended reservation generated `tokens`."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if len(self._ends) == self._ends.maxlen:
            self._counts[self._ends[0]] -= 1
        bucket = _bucket(tokens)
        self._ends.append(bucket)
        self._counts[bucket] += 1

    def quantile(self, q: float) -> int | None:
        """The `q` quantile's bucket edge (never below it), or None before `min_samples` ends."""
        n = len(self._ends)
        if n < self._min_samples:
            return None
        rank = math.ceil(q * n)
        seen = 0
        for bucket, count in enumerate(self._counts):
            seen += count
            if seen >= rank:
                return _EDGES[bucket]
        return _EDGES[-1]

    def levels(self) -> tuple[int, ...]:
        """The projections a request climbs as it generates past each: q99 then q99.9 (at least
        `floor`), or SGLang's clip before there is history."""
        first = self.quantile(Q_PROJECT)
        if first is None:
            return (CLIP_MAX_NEW_TOKENS,)
        second = self.quantile(Q_OVERRUN) or first
        return (max(self._floor, first), max(self._floor, second))

    def projected(self, declared: int, generated: int, levels: tuple[int, ...] | None = None) -> int:
        """The output a request that declared `declared` and has generated `generated` is projected
        to generate in all: the first level above what it has, else a rolling last level more than it
        has, within `declared`. `levels` from `levels()`, taken once for many requests."""
        steps = levels if levels is not None else self.levels()
        for level in steps:
            if generated < level:
                return min(declared, level)
        return min(declared, generated + steps[-1])
