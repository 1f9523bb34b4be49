"""Whether the engine's prefix cache still holds what the agent believes, by the engine's own counts.

When the agent grants a reservation whose prefix it believes cached, it expects the engine to find
those tokens. vLLM counts, per engine, the prompt tokens it looked up and those it found in its cache
(counters `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`, vllm/v1/metrics/loggers.py
@ 005a810; a request is counted once, when first scheduled, and a preempted one apart:
vllm/v1/core/kv_cache_manager.py `get_computed_blocks`, vllm/v1/metrics/stats.py
`PrefixCacheStats.record` @ 003df29). SGLang publishes only the hit rate of its latest prefill batch
(`sglang:cache_hit_rate`), and writes 0 with its periodic decode figures
(python/sglang/srt/managers/scheduler_components/metrics_reporter.py, `report_prefill_stats`,
`report_decode_stats` @ 00df707).

The audit compares over windows that close once every expected request has had `arrival_s` to reach
the engine and the engine has none waiting (a waiting request has not been looked up yet):
- vLLM: the engine found D tokens fewer than expected, beyond a fifth of what was expected (the
  expectation is in the gate's estimated tokens): D tokens of idle blocks are forgotten;
- SGLang, which gives no count: hits were expected but the hit rate never took a new value above 0:
  everything expected is forgotten.
Hits of requests the agent did not grant can only hide a shortfall, never invent one.
"""

from __future__ import annotations

from collections import deque

# Estimated tokens are off by a few percent at these sizes (10-18% at worst): a shortfall counts
# beyond 1/_TOLERANCE of what was expected.
_TOLERANCE = 5


class PrefixAudit:
    def __init__(self, arrival_s: float) -> None:
        self._arrival_s = arrival_s
        self._pending: deque[tuple[float, int]] = deque()  # (granted at, expected tokens)
        self._expected = 0  # expected tokens of requests that have reached the engine, this window
        self._hits_mark: int | None = None  # the engine's hit counter when the window opened
        self._rate: float | None = None
        self._rate_seen = False  # the hit rate took a new value above 0 in this window

    def expect(self, now: float, tokens: int) -> None:
        if tokens > 0:
            self._pending.append((now, tokens))

    def observe(self, now: float, hits_total: int | None, hit_rate: float | None, waiting: int | None) -> int:
        """One engine sample; the tokens of idle prefix blocks to forget (0 when none)."""
        if hits_total is None and hit_rate is None:
            self._pending.clear()  # the engine counts nothing: nothing to audit against
            self._expected = 0
            return 0
        if hits_total is not None and (self._hits_mark is None or hits_total < self._hits_mark):
            self._hits_mark = hits_total if self._hits_mark is None else 0  # first sight, or a restart
        if hit_rate is not None and hit_rate != self._rate:
            self._rate_seen = self._rate_seen or hit_rate > 0
            self._rate = hit_rate
        while self._pending and self._pending[0][0] <= now - self._arrival_s:
            self._expected += self._pending.popleft()[1]
        if self._pending or (waiting or 0) > 0 or self._expected == 0:
            if not self._pending and self._expected == 0:
                self._open(hits_total)
            return 0
        if hits_total is not None:
            assert self._hits_mark is not None
            found = hits_total - self._hits_mark
            shortfall = (
                0 if found >= self._expected - self._expected // _TOLERANCE else self._expected - found
            )
        else:
            shortfall = 0 if self._rate_seen else self._expected
        self._open(hits_total)
        return shortfall

    def _open(self, hits_total: int | None) -> None:
        self._expected = 0
        self._hits_mark = hits_total
        self._rate_seen = False
