"""report.png of a trace replay: TTFT distribution per run and class, prefix hits over time against
what an infinite cache would hit, and every node's KV use over time, one panel per run."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.demo.load import Result
from kvgate.demo.scrape import Sample
from kvgate.demo.trace import CLASSES, prompt_class

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_COLUMNS = 4
_CLASS_TITLES = {"le_4k": "prompt <= 4k", "4k_16k": "prompt 4k-16k", "gt_16k": "prompt > 16k"}


@dataclass(frozen=True, slots=True)
class RunSeries:
    """What one run's plot needs: its requests' results and its nodes' samples."""

    results: list[Result]
    timeline: Mapping[str, list[Sample]]


def write_trace_plot(runs: Mapping[str, RunSeries], bound: Sequence[tuple[float, int]], path: Path) -> bool:
    """Draw the figure with matplotlib's Agg canvas; False when matplotlib is not installed.
    `bound`: (replay second, tokens) per request, what an infinite cache would hit on it."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        return False
    kv_rows = max(1, math.ceil(len(runs) / _COLUMNS))
    figure = Figure(figsize=(6 * _COLUMNS, 5 * (1 + kv_rows)), layout="constrained")
    axes = figure.subplots(1 + kv_rows, _COLUMNS, squeeze=False)
    for column, (name, _) in enumerate(CLASSES):
        _ttft_cdf(axes[0][column], name, runs)
    _prefix_hits(axes[0][3], runs, bound)
    panels = [ax for row in axes[1:] for ax in row]
    for ax, run in itertools.zip_longest(panels, runs.items()):
        if run is None:
            ax.set_axis_off()
        else:
            _kv(ax, *run)
    figure.savefig(path, dpi=80)
    return True


def _ttft_cdf(ax: Axes, name: str, runs: Mapping[str, RunSeries]) -> None:
    drawn = False
    for run, series in runs.items():
        ttfts = sorted(
            (r.ttft_s or 0.0) * 1000
            for r in series.results
            if r.outcome == "ok" and r.ttft_s is not None and prompt_class(r.planned.prompt_tokens) == name
        )
        if ttfts:
            ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no request of this class", ha="center", transform=ax.transAxes)
        return
    ax.set_xscale("log")
    ax.set_ylim(0, 1.01)
    ax.set_title(f"TTFT, {_CLASS_TITLES[name]} (served requests)")
    ax.set_xlabel("ms (log)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="lower right")


def _prefix_hits(ax: Axes, runs: Mapping[str, RunSeries], bound: Sequence[tuple[float, int]]) -> None:
    ax.plot([t for t, _ in bound], list(itertools.accumulate(tokens for _, tokens in bound)), color="black",
            linestyle="--", label="infinite cache (bound)")  # fmt: skip
    for run, series in runs.items():
        # The sampler reads every node at the same moments; a node's counter only grows, so the total
        # at a moment is the sum of each node's latest reading.
        timelines = list(series.timeline.values())
        latest = [0] * len(timelines)
        times: list[float] = []
        totals: list[int] = []
        for moment in zip(*timelines, strict=False):
            for k, sample in enumerate(moment):
                if sample.metrics is not None:
                    latest[k] = sample.metrics.prefix_hit_tokens
            times.append(moment[0].t_s)
            totals.append(sum(latest))
        ax.plot(times, totals, label=run)
    ax.set_title("prefix-cache hit tokens over time")
    ax.set_xlabel("seconds into the replay")
    ax.set_ylabel("tokens (cumulative)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper left")


def _kv(ax: Axes, name: str, series: RunSeries) -> None:
    for node, samples in series.timeline.items():
        usage = [s.metrics.kv_usage if s.metrics is not None else float("nan") for s in samples]
        ax.plot([s.t_s for s in samples], usage, label=node, linewidth=0.8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"{name}: KV-cache use per node")
    ax.set_xlabel("seconds into the replay")
    ax.legend(fontsize="x-small", loc="upper left")
