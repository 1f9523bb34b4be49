"""The locally kept histograms: Prometheus bucket semantics and what the metrics endpoint renders."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvgate.telemetry import Histogram


def rendered(histogram_: Histogram) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=True)

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            yield histogram_.family()

    registry.register(Collector())
    samples = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_buckets_are_cumulative_and_a_value_on_a_bound_counts_in_that_bucket() -> None:
    h = Histogram("demo_seconds", "A demo", "method", (0.001, 0.01))
    for value in (0.0005, 0.001, 0.005, 3.0):
        h.record(value, "fast")
    h.record(0.002, "exact")
    samples = rendered(h)
    assert samples['demo_seconds_bucket{le="0.001",method="fast"}'] == 2
    assert samples['demo_seconds_bucket{le="0.01",method="fast"}'] == 3
    assert samples['demo_seconds_bucket{le="+Inf",method="fast"}'] == 4
    assert samples['demo_seconds_count{method="fast"}'] == 4
    assert abs(samples['demo_seconds_sum{method="fast"}'] - 3.0065) < 1e-9
    assert samples['demo_seconds_bucket{le="0.001",method="exact"}'] == 0
    assert samples['demo_seconds_count{method="exact"}'] == 1
