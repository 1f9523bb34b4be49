"""The figures of one trace replay per run, and the table that puts the runs side by side (pure).

Per run, from the requests' results, the nodes' counters after the replay and the routing layer's CPU:
- `requests_total`, `requests_lost` (no answer, a cut stream, a timeout), `refused_413`, `refused_429`,
  `refused_503`, `other_errors` (an engine's own error, such as a 400 for a request too long for it),
  `served`, and `queued`: served after kvgate's queue held them until a node had room;
- `short_*` / `long_*` TTFT: requests whose prompt and output fit the interactive limit, and the rest;
  `ttft_by_class`: p50 / p99 by prompt length (<= 4k, 4k-16k, > 16k tokens), served requests only,
  admission waits included; milliseconds of the replay's own clock (the nodes run `speed` times faster
  than the trace, so a prefill's share of a TTFT is `speed` times shorter than it would be);
- `oom_crashes`, `preemptions`, `prefix_hit_tokens` (prompt tokens the engines found in their prefix
  caches), summed over the nodes; `kv_peak`: the highest KV use of any node, as a fraction;
- `goodput_tokens_per_s`: prompt and generated tokens of the requests served, per second of the
  trace (replay seconds x speed), from the first request sent to the last one finished;
- `routing_cpu_ms_per_request`: CPU of the routing layer's processes while the replay ran, per
  request (`routing_cpu_s` per process): Envoy + gate + agents + queue for kvgate, the router for a
  peer, Envoy for the baseline;
- `nodes_stalled_pct`: the share of the replay the simulated nodes lost because this host ran their
  engine steps late (its CPU busy), summed over the nodes over nodes x the replay's span: above a few
  percent the nodes were slower than their rates, and a run's latencies say as much about the host as
  about what routed it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvgate.demo.load import Result
from kvgate.demo.report import cell, percentile, render_rows, served_ttfts
from kvgate.demo.scrape import NodeMetrics
from kvgate.demo.trace import CLASSES, prompt_class

_SERVED = ("ok", "async")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _class_ttfts(results: Sequence[Result], name: str) -> list[float]:
    return [
        r.ttft_s
        for r in results
        if r.outcome in _SERVED and r.ttft_s is not None and prompt_class(r.planned.prompt_tokens) == name
    ]


def goodput(results: Sequence[Result], speed: float) -> float:
    served = [r for r in results if r.outcome in _SERVED and r.finished_s is not None]
    if not served:
        return 0.0
    start = min(r.sent_s for r in results)
    end = max(r.sent_s + (r.finished_s or 0.0) for r in served)
    tokens = sum(r.planned.prompt_tokens + r.completion_tokens for r in served)
    return tokens / max((end - start) * speed, 1e-9)


def _span_s(results: Sequence[Result]) -> float:
    ends = [r.sent_s + (r.finished_s or 0.0) for r in results]
    return max(ends, default=0.0) - min((r.sent_s for r in results), default=0.0)


def summarize_trace_run(
    results: Sequence[Result],
    nodes: Mapping[str, NodeMetrics | None],
    cpu_s: Mapping[str, float],
    speed: float,
) -> dict[str, Any]:
    counts = {o: sum(1 for r in results if r.outcome == o) for o in ("lost", "413", "429", "503", "other")}
    known = [m for m in nodes.values() if m is not None]
    peaks = [m.peak_kv_tokens / m.capacity_tokens for m in known]
    shorts, longs = served_ttfts(results, "short"), served_ttfts(results, "long")
    cpu_total = sum(cpu_s.values())
    return {
        "oom_crashes": sum(m.oom_crashes for m in known),
        "preemptions": sum(m.preemptions for m in known),
        "requests_total": len(results),
        "requests_lost": counts["lost"],
        "refused_413": counts["413"],
        "refused_429": counts["429"],
        "refused_503": counts["503"],
        "other_errors": counts["other"],
        "served": sum(1 for r in results if r.outcome in _SERVED),
        "queued": sum(1 for r in results if r.outcome in _SERVED and r.queued),
        "short_ttft_p50_ms": _ms(percentile(shorts, 50)),
        "short_ttft_p99_ms": _ms(percentile(shorts, 99)),
        "long_ttft_p50_ms": _ms(percentile(longs, 50)),
        "long_ttft_p99_ms": _ms(percentile(longs, 99)),
        "ttft_by_class": {
            name: {
                "served": len(ttfts := _class_ttfts(results, name)),
                "p50_ms": _ms(percentile(ttfts, 50)),
                "p99_ms": _ms(percentile(ttfts, 99)),
            }
            for name, _ in CLASSES
        },
        "prefix_hit_tokens": sum(m.prefix_hit_tokens for m in known),
        "kv_peak": round(max(peaks), 3) if peaks else None,
        "kv_peak_by_node": {
            name: None if m is None else round(m.peak_kv_tokens / m.capacity_tokens, 3)
            for name, m in nodes.items()
        },
        "nodes_unreadable": sorted(name for name, m in nodes.items() if m is None),
        "nodes_stalled_pct": (
            round(100 * sum(m.stalled_s for m in known) / (len(known) * span), 1)
            if known and (span := _span_s(results)) > 0
            else None
        ),
        "goodput_tokens_per_s": round(goodput(results, speed), 1),
        "routing_cpu_s": dict(cpu_s),
        "routing_cpu_ms_per_request": round(cpu_total * 1000 / len(results), 3) if results else None,
    }


def _class_cell(name: str, stat: str) -> Callable[[Mapping[str, Any]], object]:
    def get(run: Mapping[str, Any]) -> object:
        return run.get("ttft_by_class", {}).get(name, {}).get(stat)

    return get


def _load(run: Mapping[str, Any]) -> object:
    load = run.get("load_average_1m")
    return None if not load else " / ".join(f"{value:.1f}" for value in load)


def _rows(bound: int) -> list[tuple[str, Callable[[Mapping[str, Any]], object]]]:
    def key(name: str) -> Callable[[Mapping[str, Any]], object]:
        return lambda run: run.get(name)

    def share(run: Mapping[str, Any]) -> object:
        hits = run.get("prefix_hit_tokens")
        return None if not bound or hits is None else f"{100 * hits / bound:.0f}%"

    rows = [
        (name, key(name))
        for name in (
            "oom_crashes", "preemptions", "requests_total", "requests_lost", "refused_413", "refused_429",
            "queued", "short_ttft_p50_ms", "short_ttft_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms",
        )
    ]  # fmt: skip
    for name, _ in CLASSES:
        for stat in ("p50_ms", "p99_ms"):
            rows.append((f"ttft {name} {stat}", _class_cell(name, stat)))
    rows += [
        ("prefix_hit_tokens", key("prefix_hit_tokens")),
        ("prefix hits / bound", share),
        ("kv_peak", key("kv_peak")),
        ("goodput_tokens_per_s", key("goodput_tokens_per_s")),
        ("routing_cpu_ms_per_request", key("routing_cpu_ms_per_request")),
        ("nodes_stalled_pct", key("nodes_stalled_pct")),
        ("load average, start / end", _load),
    ]
    return rows


def _table(report: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    runs: Mapping[str, Mapping[str, Any]] = report["runs"]
    rows = [
        (label, [_format(get(runs[run])) for run in runs])
        for label, get in _rows(int(report.get("prefix_bound_tokens") or 0))
    ]
    return list(runs), rows


def _format(value: object) -> str:
    if isinstance(value, float) and value < 10:
        return f"{value:.3f}".rstrip("0").rstrip(".") if value else "0"
    return cell(value)


def format_trace_table(report: Mapping[str, Any]) -> str:
    runs, rows = _table(report)
    return render_rows(runs, rows)


def markdown_trace_table(report: Mapping[str, Any]) -> str:
    """The same table in Markdown (for a README)."""
    runs, rows = _table(report)
    lines = ["| | " + " | ".join(f"`{run}`" for run in runs) + " |", "|---|" + "---:|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)
