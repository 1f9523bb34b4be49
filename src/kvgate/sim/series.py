"""The simulator's own series, `kvgate_sim_*`, and counters fed from the engine models' totals.

One series per engine (label `engine`: its DP rank). They exist only here: they let the demo and the
tests count OOM crashes and peak KV demand, which a crashed real engine could not report.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvgate.sim.engine import EngineStats


class SimSeries:
    """kvgate_sim_*: the simulator's own counters, always current."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engines: int) -> None:
        labels = ["model_name", "engine"]
        crashes = Counter(
            "kvgate_sim_oom_crashes", "Simulated CUDA OOM crashes of this engine.", labels, registry=registry
        )
        peak = Gauge(
            "kvgate_sim_peak_kv_tokens",
            "Most KV tokens the engine held or tried to hold (above capacity only at an OOM).",
            labels,
            registry=registry,
        )
        stalled = Counter(
            "kvgate_sim_stalled_seconds",
            "Engine time lost because the simulator's host ran its steps late (a busy CPU): the node "
            "served less than its configured throughput by this much.",
            labels,
            registry=registry,
        )
        self._stalled = [stalled.labels(model_name, str(i)) for i in range(engines)]
        capacity = Gauge(
            "kvgate_sim_kv_capacity_tokens",
            "KV-cache capacity of this engine in tokens.",
            labels,
            registry=registry,
        )
        self._series = [
            (
                crashes.labels(model_name, str(i)),
                peak.labels(model_name, str(i)),
                capacity.labels(model_name, str(i)),
            )
            for i in range(engines)
        ]
        self._crashes = [0] * engines

    def stall(self, engine: int, seconds: float) -> None:
        self._stalled[engine].inc(seconds)

    def update(self, stats: Sequence[EngineStats]) -> None:
        for i, (s, (crashes, peak, capacity)) in enumerate(zip(stats, self._series, strict=True)):
            crashes.inc(s.oom_crashes_total - self._crashes[i])
            self._crashes[i] = s.oom_crashes_total
            peak.set(s.peak_kv_tokens)
            capacity.set(s.total_blocks * s.block_size)


class Deltas:
    """Counters fed from the engine models' running totals."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], int] = {}

    def step(self, counter: Counter, key: str, engine: int, total: int) -> None:
        previous = self._last.get((key, engine), 0)
        if total > previous:
            counter.inc(total - previous)
        self._last[key, engine] = total
