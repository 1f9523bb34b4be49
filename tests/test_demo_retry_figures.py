"""The demo's Retry-After figures, read from a gate's /metrics page as the gate renders it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily

from kvgate.demo.report import RETRY_KEYS, format_table, summarize_run
from kvgate.demo.retry_figures import RetryFigures, read_retry_figures
from kvgate.telemetry import Histogram


def gate_page(errors: dict[str, list[float]], answers: dict[str, list[float]], unresolved: int = 0) -> str:
    """What the gate's endpoint renders for these answers and checked errors (telemetry.Histogram, as
    the gate keeps them), plus the OpenTelemetry exporter's line of the unresolved counter."""
    error = Histogram("kvgate_gate_retry_after_error_seconds", "", "basis", (-1, -0.5, 0, 0.5, 1, 5))
    answer = Histogram("kvgate_gate_retry_after_seconds", "", "basis", (1, 5, 60))
    for basis, values in errors.items():
        for value in values:
            error.record(value, basis)
    for basis, values in answers.items():
        for value in values:
            answer.record(value, basis)

    class Collector:
        def collect(self) -> list[HistogramMetricFamily]:
            return [error.family(), answer.family()]

    registry = CollectorRegistry()
    registry.register(Collector())  # type: ignore[arg-type]
    page = generate_latest(registry).decode()
    if unresolved:
        labels = 'basis="forecast",otel_scope_name="kvgate.gate"'
        page += f"kvgate_gate_retry_after_unresolved_total{{{labels}}} {unresolved}.0\n"
    return page


def test_signed_errors_are_read_from_the_buckets_of_every_basis() -> None:
    page = gate_page(
        {"forecast": [-0.3, -0.2, 0.1, 0.7], "fixed": [-3.0, 4.0]},
        {"forecast": [3.0, 3.5, 7.0, 8.0], "fixed": [2.0, 2.0]},
        unresolved=2,
    )
    assert "kvgate_gate_retry_after_error_seconds_count" not in page, "no count with negative buckets"
    assert read_retry_figures(page) == RetryFigures(
        answers=6,
        checked=6,
        unresolved=2,
        within_half_s=0.5,  # -0.3, -0.2, 0.1 of six
        within_1_s=round(4 / 6, 3),
        median_bound_s=0.0,
    )


def test_a_page_without_answers_has_no_figures_to_give() -> None:
    figures = read_retry_figures(gate_page({}, {}))
    assert figures == RetryFigures(0, 0, 0, None, None, None)


def test_the_report_has_a_key_and_a_row_for_each_figure() -> None:
    figures = RetryFigures(8, 8, 0, 0.75, 1.0, 0.0)
    kvgate = summarize_run([], [], {}, {}, 0.0, retry=figures)
    baseline = summarize_run([], [], {}, {}, 0.0)
    assert [kvgate[key] for key in RETRY_KEYS] == [8, 8, 0, 75.0, 100.0, 0.0]
    assert [baseline[key] for key in RETRY_KEYS] == [None] * len(RETRY_KEYS)
    rows = {
        line.split()[0]: line.split()[1:]
        for line in format_table({"baseline": baseline, "kvgate": kvgate}).splitlines()[2:]
    }
    assert rows["retry_error_within_0_5_s_pct"] == ["-", "75.0"]
    assert rows["retry_checked"] == ["-", "8"]
