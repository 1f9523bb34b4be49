"""report.png: per run (a column each), KV usage of every node over time, short- and long-request TTFT
over time, outcomes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.demo.report import REPORTED_OUTCOMES, RunTrace

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_OUTCOME_COLORS = {"ok": "tab:green", "413": "tab:purple", "429": "tab:orange", "503": "tab:brown",
                   "async": "tab:blue", "other": "tab:gray", "lost": "tab:red"}  # fmt: skip


def write_plot(traces: Mapping[str, RunTrace], path: Path) -> bool:
    """Draw the figure with matplotlib's Agg canvas; False when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        return False
    figure = Figure(figsize=(6 * len(traces), 13), layout="constrained")
    # One y scale per row, so the runs read side by side.
    axes = figure.subplots(4, len(traces), squeeze=False, sharey="row")
    for column, (name, trace) in enumerate(traces.items()):
        _kv_usage(axes[0][column], name, trace)
        _ttft(axes[1][column], name, trace)
        _long_ttft(axes[2][column], name, trace)
        _outcomes(axes[3][column], name, trace)
    figure.savefig(path, dpi=90)
    return True


def _kv_usage(ax: Axes, name: str, trace: RunTrace) -> None:
    for node, samples in trace.timeline.items():
        times = [s.t_s for s in samples]
        usage = [s.metrics.kv_usage if s.metrics is not None else float("nan") for s in samples]
        (line,) = ax.plot(times, usage, label=node)
        down = [s.t_s for s in samples if s.metrics is None]
        if down:
            ax.scatter(down, [1.02] * len(down), marker="x", color=line.get_color(), s=12)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"{name}: KV-cache usage per node (x = node down)")
    ax.set_xlabel("seconds into the burst phase")
    ax.legend(fontsize="small", loc="upper left")


def _ttft(ax: Axes, name: str, trace: RunTrace) -> None:
    shorts = [r for r in trace.burst if r.planned.kind == "short"]
    served = [r for r in shorts if r.outcome == "ok" and r.ttft_s is not None]
    failed = [r for r in shorts if r.outcome != "ok"]
    ax.scatter([r.sent_s for r in served], [(r.ttft_s or 0) * 1000 for r in served], s=8, label="served")
    if failed:
        ax.scatter([r.sent_s for r in failed], [1.0] * len(failed), s=14, marker="x", color="tab:red",
                   label="not served")  # fmt: skip
    for r in trace.burst:
        if r.planned.kind == "long":
            ax.axvline(r.sent_s, color="gray", alpha=0.25, linewidth=0.8)
    ax.set_yscale("log")
    ax.set_title(f"{name}: short-request TTFT (grey lines: long requests sent)")
    ax.set_xlabel("seconds into the burst phase")
    ax.set_ylabel("ms")
    ax.legend(fontsize="small", loc="upper left")


def _long_ttft(ax: Axes, name: str, trace: RunTrace) -> None:
    longs = [r for r in trace.burst if r.planned.kind == "long"]
    served = [r for r in longs if r.outcome == "ok" and r.ttft_s is not None and not r.queued]
    queued = [r for r in longs if r.outcome == "ok" and r.ttft_s is not None and r.queued]
    failed = [r for r in longs if r.outcome != "ok"]
    ax.scatter([r.sent_s for r in served], [(r.ttft_s or 0) * 1000 for r in served], s=10, color="tab:purple",
               label="served")  # fmt: skip
    if queued:
        ax.scatter([r.sent_s for r in queued], [(r.ttft_s or 0) * 1000 for r in queued], s=14, marker="s",
                   color="tab:cyan", label="queued, then served")  # fmt: skip
    if failed:
        ax.scatter([r.sent_s for r in failed], [1.0] * len(failed), s=14, marker="x", color="tab:red",
                   label="not served")  # fmt: skip
    ax.set_yscale("log")
    ax.set_title(f"{name}: long-request TTFT (admission wait included)")
    ax.set_xlabel("seconds into the burst phase")
    ax.set_ylabel("ms")
    if served or queued or failed:
        ax.legend(fontsize="small", loc="upper left")


def _outcomes(ax: Axes, name: str, trace: RunTrace) -> None:
    labels = [*REPORTED_OUTCOMES, "lost"]
    for kind, offset in (("short", -0.2), ("long", 0.2)):
        counts = [sum(1 for r in trace.burst if r.planned.kind == kind and r.outcome == o) for o in labels]
        colors = [_OUTCOME_COLORS[o] for o in labels]
        bars = ax.bar([i + offset for i in range(len(labels))], counts, width=0.4, color=colors,
                      alpha=1.0 if kind == "short" else 0.55, label=kind)  # fmt: skip
        ax.bar_label(bars, fontsize="x-small")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_title(f"{name}: outcomes (solid: short, light: long)")
