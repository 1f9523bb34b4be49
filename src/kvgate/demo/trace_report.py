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
  peer, Envoy for the baseline. Split (`cpu_split`) into a fixed part, what the stack spends with no
  traffic (`routing_cpu_fixed_ms_per_s`, measured before the replay: agents' sampling and streams,
  the queue's store polls), charged for the replay's length, and the variable rest, what the requests
  cost: `routing_cpu_fixed_ms_per_request` + `routing_cpu_variable_ms_per_request`, and both per
  process in `routing_cpu_split`. The fixed part per request depends on `--speed`: the same trace
  replayed twice as fast lasts half as long, so its fixed share per request halves; the variable part
  does not (to first order);
- `nodes_stalled_pct`: the share of the replay the simulated nodes lost because this host ran their
  engine steps late (its CPU busy), summed over the nodes over nodes x the replay's span: above a few
  percent the nodes were slower than their rates, and a run's latencies say as much about the host as
  about what routed it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
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


def cpu_split(
    cpu_s: Mapping[str, float], idle_cpu_per_s: Mapping[str, float], metered_s: float, requests: int
) -> dict[str, Any]:
    """The routing layer's CPU in a fixed part (each process's idle rate x the metered seconds, at most
    what it spent) and a variable part (the rest), in milliseconds per request, in all and per process.
    """
    per_request = 1000 / max(requests, 1)
    split: dict[str, dict[str, float]] = {}
    for name, spent in cpu_s.items():
        fixed = min(spent, idle_cpu_per_s.get(name, 0.0) * metered_s)
        split[name] = {
            "ms_per_request": round(spent * per_request, 3),
            "fixed_ms_per_s": round(idle_cpu_per_s.get(name, 0.0) * 1000, 2),
            "fixed_ms_per_request": round(fixed * per_request, 3),
            "variable_ms_per_request": round((spent - fixed) * per_request, 3),
        }
    return {
        "routing_cpu_fixed_ms_per_s": round(sum(p["fixed_ms_per_s"] for p in split.values()), 2),
        "routing_cpu_fixed_ms_per_request": round(sum(p["fixed_ms_per_request"] for p in split.values()), 3),
        "routing_cpu_variable_ms_per_request": round(
            sum(p["variable_ms_per_request"] for p in split.values()), 3
        ),
        "routing_cpu_split": split,
    }


def summarize_trace_run(
    results: Sequence[Result],
    nodes: Mapping[str, NodeMetrics | None],
    cpu_s: Mapping[str, float],
    speed: float,
    *,
    idle_cpu_per_s: Mapping[str, float] | None = None,
    metered_s: float = 0.0,
) -> dict[str, Any]:
    """One run's figures (the module doc); with `idle_cpu_per_s` (each routing process's CPU seconds
    per second before the replay) and `metered_s` (the seconds `cpu_s` was metered over), the CPU's
    split too."""
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
        **(cpu_split(cpu_s, idle_cpu_per_s, metered_s, len(results)) if idle_cpu_per_s is not None else {}),
    }


def _class_cell(name: str, stat: str) -> Callable[[Mapping[str, Any]], object]:
    def get(run: Mapping[str, Any]) -> object:
        return run.get("ttft_by_class", {}).get(name, {}).get(stat)

    return get


def _process_cell(name: str) -> Callable[[Mapping[str, Any]], object]:
    """One process's CPU per request: total (fixed + variable), '-' where the run has no such process."""

    def get(run: Mapping[str, Any]) -> object:
        split = run.get("routing_cpu_split", {}).get(name)
        if split is None:
            return None
        total, fixed, variable = (
            split[k] for k in ("ms_per_request", "fixed_ms_per_request", "variable_ms_per_request")
        )
        return f"{total:.2f} ({fixed:.2f} + {variable:.2f})"

    return get


def _processes(runs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The routing processes of every run, in the order the runs name them, each once."""
    return list(dict.fromkeys(name for run in runs for name in run.get("routing_cpu_split", {})))


def _load(run: Mapping[str, Any]) -> object:
    load = run.get("load_average_1m")
    return None if not load else " / ".join(f"{value:.1f}" for value in load)


def _rows(
    bound: int, processes: Sequence[str] = ()
) -> list[tuple[str, Callable[[Mapping[str, Any]], object]]]:
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
        ("  fixed: idle ms/s", key("routing_cpu_fixed_ms_per_s")),
        ("  fixed ms/request (x 1/speed)", key("routing_cpu_fixed_ms_per_request")),
        ("  variable ms/request", key("routing_cpu_variable_ms_per_request")),
    ]
    rows += [(f"  {name} ms/request (fixed + var)", _process_cell(name)) for name in processes]
    rows += [
        ("nodes_stalled_pct", key("nodes_stalled_pct")),
        ("load average, start / end", _load),
    ]
    return rows


def _table(report: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    runs: Mapping[str, Mapping[str, Any]] = report["runs"]
    rows = [
        (label, [_format(get(runs[run])) for run in runs])
        for label, get in _rows(int(report.get("prefix_bound_tokens") or 0), _processes(runs.values()))
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
