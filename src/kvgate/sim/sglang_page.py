"""An SGLang server's /metrics page for simulated engines, rendered by prometheus_client.

SGLang serves its page through prometheus_client's multiprocess collector, which writes no
`_created` samples and no process metrics. Every scheduler (one per TP rank, PP stage and DP rank)
writes sglang:max_total_num_tokens at start; only attention-TP rank 0 of each PP stage writes the
per-step gauges, on SGLang's cadence (`SglangCadence`), not on every scrape (the rules and their
sources: kvgate.agent.sources.engines.sglang). Among them `sglang:cache_hit_rate`: cached over all prompt
tokens of the requests that started in the latest prefill batch, 0 on a decode write.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvgate.sim.engine import EngineConfig, EngineStats, Step
from kvgate.sim.layout import Finished, Layout
from kvgate.sim.series import SimSeries


@dataclass(slots=True)
class SglangCadence:
    """When SGLang's scheduler writes its gauges: after every prefill batch, every `decode_interval`
    decode batches (--decode-log-interval, 40), and when idle once `idle_interval_s` (30 s) passed since
    the last write, counted from the scheduler's start (sglang v0.5.23,
    python/sglang/srt/managers/scheduler_components/metrics_reporter.py)."""

    last_write: float
    decode_interval: int = 40
    idle_interval_s: float = 30.0
    decode_batches: int = 0

    def after_batch(self, prefill_tokens: int, now: float) -> bool:
        if prefill_tokens == 0:
            self.decode_batches += 1
            if self.decode_batches % self.decode_interval:
                return False
        self.last_write = now
        return True

    def while_idle(self, now: float) -> bool:
        if now <= self.last_write + self.idle_interval_s:
            return False
        self.last_write = now
        return True


class _AsMultiprocess(Collector):
    """The page prometheus_client's multiprocess collector, which SGLang's /metrics uses, writes: no
    `_created` samples, and no family that no process has written a sample of."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self._inner = inner

    def collect(self) -> Iterator[Metric]:
        for metric in self._inner.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            if metric.samples:
                yield metric


@dataclass(frozen=True, slots=True)
class _Rank:
    dp: int
    tp: int
    pp: int


class SglangPage:
    def __init__(
        self,
        config: EngineConfig,
        layout: Layout,
        model_name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._store = CollectorRegistry()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_AsMultiprocess(self._store))
        s = self._store
        ranks = [
            _Rank(dp, tp, pp)
            for dp in range(layout.data_parallel)
            for pp in range(layout.pipeline_parallel)
            for tp in range(layout.tensor_parallel)
        ]
        with_dp = layout.data_parallel > 1
        names = [
            "model_name",
            "engine_type",
            "tp_rank",
            "pp_rank",
            "moe_ep_rank",
            *(["dp_rank"] if with_dp else []),
        ]

        def labels(rank: _Rank) -> list[str]:
            return [
                model_name,
                "unified",
                str(rank.tp),
                str(rank.pp),
                "0",
                *([str(rank.dp)] if with_dp else []),
            ]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=s, multiprocess_mode="mostrecent")

        capacity = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        for rank in ranks:  # every scheduler writes it at start (Scheduler.emit_metrics_constants)
            capacity.labels(*labels(rank)).set(config.num_gpu_blocks * config.block_size)
        # Attention-TP rank 0 of each PP stage writes the per-step figures of its DP rank's pool.
        # A labelled series exists only once written: these are labelled when first written.
        self._step_gauges = (
            gauge("sglang:num_used_tokens", "The number of used tokens."),
            gauge("sglang:token_usage", "The token usage."),
            gauge("sglang:num_running_reqs", "The number of running requests."),
            gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
        )
        self._hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self._rates = [0.0] * layout.data_parallel
        self._retracted_family = Counter(
            "sglang:num_retracted_requests_total", "Total number of retracted requests.", names, registry=s
        )
        self._writers: list[list[list[str]]] = [[] for _ in range(layout.data_parallel)]
        for rank in ranks:
            if rank.tp == 0:
                self._writers[rank.dp].append(labels(rank))
        started = clock()
        self._cadence = [SglangCadence(started) for _ in range(layout.data_parallel)]
        self._retractions = [0] * layout.data_parallel
        self._block_size = config.block_size
        tokenizer = ["model_name", "engine_type", "is_streaming"]
        self._ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            tokenizer,
            registry=s,
            buckets=(0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400),
        )
        self._e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            tokenizer,
            registry=s,
            buckets=(
                0.1,
                0.2,
                0.4,
                0.6,
                0.8,
                1,
                2,
                4,
                6,
                8,
                10,
                20,
                40,
                60,
                80,
                100,
                200,
                400,
                600,
                1200,
                1800,
                2400,
            ),
        )
        self._prompt = Counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", tokenizer, registry=s
        )
        self._generation = Counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", tokenizer, registry=s
        )
        self._requests = Counter(
            "sglang:num_requests_total", "Number of requests processed.", tokenizer, registry=s
        )
        self._model_name = model_name
        self._sim = SimSeries(s, model_name, layout.data_parallel)

    def stepped(self, engine: int, step: Step, stats: EngineStats) -> None:
        if not self._cadence[engine].after_batch(step.prefill_tokens, self._clock()):
            return
        # A prefill batch writes its own hit rate; SGLang's decode write sets 0 (report_decode_stats).
        started = step.started_tokens
        self._rates[engine] = step.started_hit_tokens / started if step.prefill_tokens and started else 0.0
        self._write(engine, stats)

    def stalled(self, engine: int, seconds: float) -> None:
        self._sim.stall(engine, seconds)

    def finished(self, done: Finished) -> None:
        values = (self._model_name, "unified", "false")
        self._prompt.labels(*values).inc(done.prompt_tokens)
        self._generation.labels(*values).inc(done.output_tokens)
        self._requests.labels(*values).inc()
        self._ttft.labels(*values).observe(done.ttft_s)
        self._e2e.labels(*values).observe(done.e2e_s)

    def render(self, stats: Sequence[EngineStats]) -> str:
        now = self._clock()
        for i, s in enumerate(stats):
            if s.running == 0 and s.waiting == 0 and self._cadence[i].while_idle(now):
                self._write(i, s)
            if s.preemptions_total > self._retractions[i]:
                for values in self._writers[i]:
                    self._retracted_family.labels(*values).inc(s.preemptions_total - self._retractions[i])
                self._retractions[i] = s.preemptions_total
        self._sim.update(stats)
        return generate_latest(self.registry).decode()

    def _write(self, engine: int, stats: EngineStats) -> None:
        used, usage, running, queued = self._step_gauges
        for values in self._writers[engine]:
            used.labels(*values).set(stats.used_blocks * self._block_size)
            usage.labels(*values).set(stats.kv_usage)
            running.labels(*values).set(stats.running)
            queued.labels(*values).set(stats.waiting)
            self._hit_rate.labels(*values).set(self._rates[engine])
