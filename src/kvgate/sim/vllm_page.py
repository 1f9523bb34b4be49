"""A vLLM API server's /metrics page for simulated engines, rendered by prometheus_client.

A single front-end: prometheus_client's default collectors (process, platform, GC) and vLLM's
families, counters with their `_created` samples, one series per engine core (label `engine`), and
`vllm:cache_config_info` once per engine with num_gpu_blocks summed over them and
kv_cache_size_tokens of one engine (the rules and their sources: kvgate.agent.sources.engines.vllm), and
the prefix cache's counters `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (tokens, per engine;
vllm/v1/metrics/loggers.py @ 005a810, PrometheusStatLogger).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kvgate.sim.engine import EngineConfig, EngineStats, Step
from kvgate.sim.layout import Finished, Layout
from kvgate.sim.series import Deltas, SimSeries

# Bucket lists as vLLM writes them (vllm/v1/metrics/loggers.py @ v0.33.0).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def _one_two_five(limit: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return buckets
            buckets.append(float(value))
        exponent += 1


class VllmPage:
    def __init__(self, config: EngineConfig, layout: Layout, model_name: str) -> None:
        self.registry = CollectorRegistry()
        # A single vLLM API server uses prometheus_client's default registry, which holds these.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        engines = layout.data_parallel
        names = ["model_name", "engine"]
        per_engine = [(model_name, str(i)) for i in range(engines)]
        r = self.registry

        def gauge(name: str, doc: str) -> list[Gauge]:
            family = Gauge(name, doc, names, registry=r, multiprocess_mode="mostrecent")
            return [family.labels(*values) for values in per_engine]

        def counter(name: str, doc: str) -> list[Counter]:
            family = Counter(name, doc, names, registry=r)
            return [family.labels(*values) for values in per_engine]

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> list[Histogram]:
            family = Histogram(name, doc, names, registry=r, buckets=buckets)
            return [family.labels(*values) for values in per_engine]

        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self._prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self._success = {
            (i, reason): success.labels(model_name, str(i), reason)
            for i in range(engines)
            for reason in ("stop", "length")
        }
        token_buckets = _one_two_five(config.max_model_len)
        self._prompt_hist = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._generation_hist = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LATENCY_BUCKETS,
        )
        # The API server's CacheConfig: num_gpu_blocks summed over its engines, kv_cache_size_tokens
        # that of the first engine to report (vllm/v1/engine/core_client.py, _apply_ready_response).
        engine_tokens = config.num_gpu_blocks * config.block_size
        cache = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "is_attention_free": "False",
            "kv_cache_max_concurrency": str(engine_tokens / config.max_model_len),
            "kv_cache_size_tokens": str(engine_tokens),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.num_gpu_blocks * engines),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
            "engine": "",
        }
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(cache),
            registry=r,
            multiprocess_mode="mostrecent",
        )
        for i in range(engines):
            info.labels(**{**cache, "engine": str(i)}).set(1)
        self._sim = SimSeries(r, model_name, engines)
        self._deltas = Deltas()

    def stepped(self, engine: int, step: Step, stats: EngineStats) -> None:
        """vLLM sets its gauges from every step's stats: rendering reads the engine directly."""

    def stalled(self, engine: int, seconds: float) -> None:
        self._sim.stall(engine, seconds)

    def finished(self, done: Finished) -> None:
        self._success[done.engine, done.reason].inc()
        self._prompt_hist[done.engine].observe(done.prompt_tokens)
        self._generation_hist[done.engine].observe(done.output_tokens)
        self._ttft[done.engine].observe(done.ttft_s)
        self._e2e[done.engine].observe(done.e2e_s)

    def render(self, stats: Sequence[EngineStats]) -> str:
        for i, s in enumerate(stats):
            self._running[i].set(s.running)
            self._waiting[i].set(s.waiting)
            self._usage[i].set(s.kv_usage)
            self._deltas.step(self._preemptions[i], "preemptions", i, s.preemptions_total)
            self._deltas.step(self._prompt[i], "prompt", i, s.prompt_tokens_total)
            self._deltas.step(self._generation[i], "generation", i, s.generation_tokens_total)
            self._deltas.step(self._prefix_queries[i], "prefix_queries", i, s.prefix_queries_total)
            self._deltas.step(self._prefix_hits[i], "prefix_hits", i, s.prefix_hits_total)
        self._sim.update(stats)
        return generate_latest(self.registry).decode()
