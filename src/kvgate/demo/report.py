"""The figures of one demo run, computed from the request results and the nodes' counters (pure).

Request counts, outcomes and TTFTs are those of the burst phase; `short_ttft_p99_ms_no_burst` comes
from the same short traffic replayed alone on the same stack just before. Node counters (OOM crashes,
preemptions, peak KV) cover the whole run.

`short_ttft_*` and `long_ttft_*` cover the short and long requests that were served (a long request's
TTFT includes any wait for admission); `long_goodput_tokens_per_s` counts prompt and generated tokens
of long requests served in full, over the window from the first long request sent to the last one
finished; `long_capacity_tokens_per_s` is what the pool serving long requests would do at full use
over the same kind of traffic (see `capacity`). `prefix_hit_tokens` is what the nodes' engines found
in their prefix caches (vllm:prefix_cache_hits), over the whole run. `long_refused` counts long
requests answered with an explicit refusal (413, 429 or 503, each with its reason; 429 and 503 with
Retry-After). `short_prompt_tokens` and `long_prompt_tokens` are the prompt tokens of the served requests
as the engine counted them (each stream's `usage`). With real engines `long_capacity_tokens_per_s` is
None: the simulator's capacity model does not describe them. `retry_*` are the gate's
Retry-After answers to capacity refusals over the whole run, and how close each came to when the
capacity it counted on freed (kvgate.demo.retry_figures); None for the baseline.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.demo.load import Outcome, Result
from kvgate.demo.retry_figures import RetryFigures
from kvgate.demo.scrape import NodeMetrics, Sample

REPORTED_OUTCOMES: tuple[Outcome, ...] = ("ok", "413", "429", "503", "async", "other")


@dataclass(frozen=True, slots=True)
class RunTrace:
    """Everything one run produced, for the report and the plot."""

    summary: dict[str, Any]
    burst: list[Result]
    timeline: Mapping[str, list[Sample]]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def short_ttfts(results: Sequence[Result]) -> list[float]:
    return served_ttfts(results, "short")


def served_ttfts(results: Sequence[Result], kind: str) -> list[float]:
    return [
        r.ttft_s for r in results if r.planned.kind == kind and r.outcome == "ok" and r.ttft_s is not None
    ]


def long_goodput(results: Sequence[Result]) -> float:
    longs = [r for r in results if r.planned.kind == "long"]
    served = [r for r in longs if r.outcome == "ok" and r.finished_s is not None]
    if not served:
        return 0.0
    start = min(r.sent_s for r in longs)
    end = max(r.sent_s + (r.finished_s or 0.0) for r in served)
    tokens = sum(r.planned.prompt_tokens + r.completion_tokens for r in served)
    return tokens / max(end - start, 1e-9)


def summarize_run(
    burst: Sequence[Result],
    no_burst: Sequence[Result],
    nodes: Mapping[str, NodeMetrics | None],
    pools: Mapping[str, str],
    long_capacity_tokens_per_s: float | None,
    *,
    retry: RetryFigures | None = None,
) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in burst)
    ttfts = short_ttfts(burst)
    known = [m for m in nodes.values() if m is not None]
    return {
        "oom_crashes": sum(m.oom_crashes for m in known),
        "preemptions": sum(m.preemptions for m in known),
        "requests_total": len(burst),
        "requests_lost": outcomes["lost"],
        "outcomes": {o: outcomes[o] for o in REPORTED_OUTCOMES},
        "short_ttft_p50_ms": milliseconds(percentile(ttfts, 50)),
        "short_ttft_p99_ms": milliseconds(percentile(ttfts, 99)),
        "short_ttft_p99_ms_no_burst": milliseconds(percentile(short_ttfts(no_burst), 99)),
        "peak_kv_fraction": {
            name: None if m is None else round(m.peak_kv_tokens / m.capacity_tokens, 3)
            for name, m in nodes.items()
        },
        "long_goodput_tokens_per_s": round(long_goodput(burst), 1),
        "long_capacity_tokens_per_s": (
            None if long_capacity_tokens_per_s is None else round(long_capacity_tokens_per_s, 1)
        ),
        "nodes_unreadable": sorted(name for name, m in nodes.items() if m is None),
        "pools": dict(pools),
        "long_requests": sum(1 for r in burst if r.planned.kind == "long"),
        "long_served": sum(1 for r in burst if r.planned.kind == "long" and r.outcome == "ok"),
        # Of those, the ones kvgate's queue held until a node had room (instead of a 429).
        "long_queued": sum(1 for r in burst if r.planned.kind == "long" and r.outcome == "ok" and r.queued),
        "long_refused": sum(1 for r in burst if r.planned.kind == "long" and r.outcome in _REFUSED),
        "short_prompt_tokens": _served_prompt_tokens(burst, "short"),
        "long_prompt_tokens": _served_prompt_tokens(burst, "long"),
        "long_ttft_p50_ms": milliseconds(percentile(served_ttfts(burst, "long"), 50)),
        "long_ttft_p99_ms": milliseconds(percentile(served_ttfts(burst, "long"), 99)),
        "prefix_hit_tokens": sum(m.prefix_hit_tokens for m in known),
        "retry_answers": retry.answers if retry else None,
        "retry_checked": retry.checked if retry else None,
        "retry_unresolved": retry.unresolved if retry else None,
        "retry_error_within_0_5_s_pct": _percent(retry.within_half_s) if retry else None,
        "retry_error_within_1_s_pct": _percent(retry.within_1_s) if retry else None,
        "retry_error_median_bound_s": retry.median_bound_s if retry else None,
    }


_REFUSED = frozenset({"413", "429", "503"})


def _served_prompt_tokens(results: Sequence[Result], kind: str) -> int:
    return sum(r.prompt_tokens for r in results if r.planned.kind == kind and r.outcome == "ok")


RETRY_KEYS = (
    "retry_answers",
    "retry_checked",
    "retry_unresolved",
    "retry_error_within_0_5_s_pct",
    "retry_error_within_1_s_pct",
    "retry_error_median_bound_s",
)


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else round(fraction * 100, 1)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_table(report: Mapping[str, Mapping[str, Any]]) -> str:
    runs = list(report)
    rows: list[tuple[str, list[str]]] = []
    for key in ("oom_crashes", "preemptions", "requests_total", "requests_lost"):
        rows.append((key, [_cell(report[r].get(key)) for r in runs]))
    for outcome in REPORTED_OUTCOMES:
        rows.append((f"outcome {outcome}", [_cell(report[r]["outcomes"].get(outcome)) for r in runs]))
    for key in ("short_ttft_p50_ms", "short_ttft_p99_ms", "short_ttft_p99_ms_no_burst"):
        rows.append((key, [_cell(report[r].get(key)) for r in runs]))
    rows.append(("peak_kv_fraction (max node)", [_cell(_max_peak(report[r])) for r in runs]))
    for key in ("long_goodput_tokens_per_s", "long_capacity_tokens_per_s"):
        rows.append((key, [_cell(report[r].get(key)) for r in runs]))
    keys = (
        "long_requests",
        "long_served",
        "long_queued",
        "long_refused",
        "long_ttft_p50_ms",
        "long_ttft_p99_ms",
        "prefix_hit_tokens",
        "short_prompt_tokens",
        "long_prompt_tokens",
    )
    for key in keys:
        rows.append((key, [_cell(report[r].get(key)) for r in runs]))
    for key in RETRY_KEYS:
        rows.append((key, [_cell(report[r].get(key)) for r in runs]))
    rows += _fairness_rows(report, runs)
    return render_rows(runs, rows)


FAIRNESS_KEYS = (
    "jain_mean",
    "jain_min",
    "service_gap_max",
    "largest_request_cost",
    "kv_occupancy_mean",
    "output_tokens_per_s",
    "chat_ttft_p99_ms",
)
TENANT_KEYS = ("share", "fair_share", "long_ttft_p99_ms", "refused_429")
IDLE_FILL_KEYS = (
    "kv_occupancy_off",
    "kv_occupancy_on",
    "kv_occupancy_ratio",
    "filler_share_off",
    "filler_share_on",
)


def _fairness_rows(
    report: Mapping[str, Mapping[str, Any]], runs: Sequence[str]
) -> list[tuple[str, list[str]]]:
    """The fairness scenario's figures (kvgate.demo.fairness, kvgate.demo.idle_fill), where a run has
    them."""
    if not any("jain_mean" in report[r] for r in runs):
        return []
    rows = [(key, [_figure(key, report[r].get(key)) for r in runs]) for key in FAIRNESS_KEYS]
    tenants = sorted({t for r in runs for t in report[r].get("tenants", {})})
    for tenant in tenants:
        for key in TENANT_KEYS:
            cells = [_figure(key, report[r].get("tenants", {}).get(tenant, {}).get(key)) for r in runs]
            rows.append((f"{tenant} {key}", cells))
    quiet = sorted({t for r in runs for t in report[r].get("idle_fill", {})})
    for tenant in quiet:
        for key in IDLE_FILL_KEYS:
            cells = [_figure(key, report[r].get("idle_fill", {}).get(tenant, {}).get(key)) for r in runs]
            rows.append((f"while {tenant} is off: {key}", cells))
    return rows


# Indexes, shares, occupancies and ratios: to four places (one place would print a Jain's index of
# 0.9975 as 1.0 and a share of 0.164 as 0.2).
FRACTION_KEYS = frozenset(
    {"jain_mean", "jain_min", "kv_occupancy_mean", "share", "fair_share", *IDLE_FILL_KEYS}
)


def _figure(key: str, value: object) -> str:
    if key in FRACTION_KEYS and isinstance(value, float):
        return f"{value:.4f}"
    return _cell(value)


def cell(value: object) -> str:
    """A table cell: '-' for None, thousands separated, one decimal for floats."""
    return _cell(value)


def render_rows(runs: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]) -> str:
    """A table: one column per run, one labelled row of cells per figure, right-aligned."""
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(run), *(len(cells[i]) for _, cells in rows)) for i, run in enumerate(runs)]
    header = " " * label_width + "  " + "  ".join(run.rjust(w) for run, w in zip(runs, widths, strict=True))
    lines = [header, "-" * len(header)]
    for label, cells in rows:
        lines.append(
            label.ljust(label_width)
            + "  "
            + "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
        )
    return "\n".join(lines)


def _max_peak(run: Mapping[str, Any]) -> float | None:
    peaks = [v for v in run.get("peak_kv_fraction", {}).values() if v is not None]
    return max(peaks) if peaks else None
