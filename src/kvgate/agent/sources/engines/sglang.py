"""SGLang's /metrics page, read as SGLang writes it.

Rules, from SGLang's source (sgl-project/sglang v0.5.23 unless said otherwise):
- Scheduler gauges carry `model_name, engine_type, tp_rank, pp_rank, moe_ep_rank`, plus `dp_rank` when
  the server runs data parallelism, `priority` when priority scheduling is on, and any
  --extra-metric-labels (python/sglang/srt/observability/metrics_collector.py,
  SchedulerMetricsCollectorContext.init_new). With priorities, running and queued counts are written
  twice: the total under priority="" and a breakdown under priority="<n>" (_log_gauge_queue_count).
- `sglang:max_total_num_tokens` is written once at start by EVERY scheduler process, one per TP rank,
  PP stage and DP rank (python/sglang/srt/managers/scheduler.py, Scheduler.emit_metrics_constants).
- The per-step gauges (`num_used_tokens`, `num_running_reqs`, `num_queue_reqs`, ...) come only from
  schedulers with attention-TP rank 0 (and attention-CP rank 0), one per PP stage, unless
  --enable-metrics-for-all-schedulers makes every rank write them (metrics_collector.py,
  current_scheduler_metrics_enabled).
- The ranks of one DP rank (TP shards, PP stages) share one token pool: each rank's
  max_total_num_tokens is the same pool seen from its shard. Each DP rank, DP attention included,
  has its own pool, told apart by `dp_rank` (python/sglang/srt/managers/data_parallel_controller.py,
  launch_tensor_parallel_group). So: one pool per dp_rank; pools add up, ranks within one do not.
- Those gauges are written on every prefill batch, every --decode-log-interval (40) decode batches,
  and when idle once 30 s have passed since the last write
  (python/sglang/srt/managers/scheduler_components/metrics_reporter.py, report_prefill_stats,
  report_decode_stats, _maybe_log_idle_metrics). A labelled gauge has no series until first written:
  a fresh server shows max_total_num_tokens but no num_used_tokens until its first request (or 30 s
  of idling).
- Older versions wrote max_total_num_tokens from the per-step stats only, whose field defaults to 0,
  and their idle path (every 30 s) did not set it: 0 while idle before any request
  (python/sglang/srt/metrics/collector.py @00ae9c15, SchedulerStats.max_total_num_tokens = 0).
- `num_used_tokens` counts the tokens running requests hold; radix-cache tokens that can be evicted
  are not in it (metrics_collector.py, SchedulerStats). Requests retracted when the pool runs out
  during decode are counted by `sglang:num_retracted_requests_total`.
- `sglang:cache_hit_rate` is the prefix-cache hit rate of the latest prefill batch (cached tokens over
  cached + new), written with the other per-step gauges; the periodic decode write sets it to 0
  (python/sglang/srt/managers/scheduler_components/metrics_reporter.py @00df707,
  report_prefill_stats and report_decode_stats; the gauge: metrics_collector.py @016d860).
- The radix cache shares cached prefixes among requests unless the server runs with
  --disable-radix-cache (python/sglang/srt/server_args.py @469c63e, `disable_radix_cache = False`),
  which the page does not show: a SGLang page is taken to share prefixes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from kvgate.agent.sources.engines import promtext
from kvgate.agent.sources.engines.promtext import Sample
from kvgate.agent.sources.engines.reading import EngineKind, EngineReading, PageState
from kvgate.digits import INT64_MAX, whole_number

CAPACITY = "sglang:max_total_num_tokens"
USED = "sglang:num_used_tokens"
RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
RETRACTIONS = "sglang:num_retracted_requests_total"
HIT_RATE = "sglang:cache_hit_rate"
# While requests run, a write every 40 decode batches: 30 s allows 0.75 s per batch, and is the bound
# SGLang keeps even when idle.
BUSY_REFRESH_S = 30.0


def read(text: str) -> EngineReading | None:
    """The page as SGLang's, or None when it holds neither of SGLang's KV families."""
    capacity_samples = promtext.samples(text, CAPACITY)
    used_samples = promtext.samples(text, USED)
    if not capacity_samples and not used_samples:
        return None
    capacity = _per_pool(capacity_samples, CAPACITY, min, positive_only=True)
    used = _per_pool(used_samples, USED, max)
    running = _per_pool(promtext.samples(text, RUNNING), RUNNING, max)
    waiting = _per_pool(promtext.samples(text, WAITING), WAITING, max)
    retracted = _per_pool(promtext.samples(text, RETRACTIONS), RETRACTIONS, max)
    # One pool's new hits are what the audit looks for: the highest rate of any pool.
    rates = [promtext.finite(s, HIT_RATE) for s in promtext.samples(text, HIT_RATE)]
    hit_rate = max(rates) if rates else None
    found = capacity_samples + used_samples
    pools = sorted({promtext.label(s, "dp_rank") or "" for s in found}, key=_rank)
    engines = tuple(_describe(pool, found) for pool in pools)
    if any(pool not in capacity for pool in pools):
        state, total, in_use = PageState.NOT_READY, None, _total(used, pools)
        rule = (
            f"{CAPACITY} is 0: older SGLang writes it from its first request on"
            if capacity_samples
            else f"no {CAPACITY} on the page yet"
        )
    else:
        state = PageState.READY if all(pool in used for pool in pools) else PageState.IDLE
        total = sum(capacity[p] for p in pools)
        # An idle pool that has not written its usage yet holds nothing.
        in_use = sum(used.get(p, 0) for p in pools)
        rule = f"{CAPACITY} {'/'.join(str(c) for c in sorted({capacity[p] for p in pools}))}"
        if len(pools) > 1:
            rule += f" x {len(pools)} dp ranks"
    return EngineReading(
        EngineKind.SGLANG,
        state,
        total,
        in_use,
        _total(running, pools),
        _total(waiting, pools),
        _total(retracted, pools),
        engines,
        rule,
        BUSY_REFRESH_S,
        cache_hit_rate=hit_rate,
        prefix_caching=True,
    )


def _per_pool(
    found: Iterable[Sample], name: str, pick: Callable[[list[int]], int], positive_only: bool = False
) -> dict[str, int]:
    """One figure per pool (dp_rank): the ranks of a pool repeat it, `pick` chooses among them."""
    values: dict[str, list[int]] = defaultdict(list)
    for sample in found:
        if promtext.label(sample, "priority") not in (None, ""):
            continue  # a per-priority breakdown of the total beside it
        value = round(promtext.finite(sample, name))
        if value > 0 or not positive_only:
            values[promtext.label(sample, "dp_rank") or ""].append(value)
    return {pool: pick(numbers) for pool, numbers in values.items()}


def _total(per_pool: dict[str, int], pools: list[str]) -> int | None:
    if not any(pool in per_pool for pool in pools):
        return None
    return sum(per_pool.get(pool, 0) for pool in pools)


def _describe(pool: str, found: list[Sample]) -> str:
    """ "dp 1: tp 0-3, pp 0-1" from the ranks the page showed for one pool."""
    tp: set[int] = set()
    pp: set[int] = set()
    for sample in found:
        if (promtext.label(sample, "dp_rank") or "") != pool:
            continue
        for ranks, key in ((tp, "tp_rank"), (pp, "pp_rank")):
            rank = whole_number(promtext.label(sample, key), maximum=INT64_MAX)
            if rank is not None:
                ranks.add(rank)
    parts = [f"{key} {_span(ranks)}" for key, ranks in (("tp", tp), ("pp", pp)) if ranks]
    return (f"dp {pool}: " if pool else "") + ", ".join(parts or ["one scheduler"])


def _span(ranks: set[int]) -> str:
    low, high = min(ranks), max(ranks)
    if len(ranks) == high - low + 1:
        return str(low) if low == high else f"{low}-{high}"
    return ",".join(str(r) for r in sorted(ranks))


def _rank(pool: str) -> tuple[int, str]:
    rank = whole_number(pool, maximum=INT64_MAX)
    return (rank, "") if rank is not None else (-1, pool)
