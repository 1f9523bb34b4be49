"""The demo run: the same traffic through each of the scenario's runs (the baseline stack, kvgate,
kvgate with prefix-aware placement off and on), then the report.

Each run starts its stack, replays the short traffic alone (the TTFT reference), replays it again
with the long traffic while sampling every node's KV usage, reads the nodes' counters and stops the
stack.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvgate.demo.capacity import node_capacity_tokens_per_s
from kvgate.demo.fairness import fairness_figures, gate_replica_figures, gate_tenant_requests
from kvgate.demo.idle_fill import idle_fill
from kvgate.demo.load import LoadGenerator, Result
from kvgate.demo.plot import write_plot
from kvgate.demo.report import RunTrace, format_table, summarize_run
from kvgate.demo.retry_figures import read_retry_figures
from kvgate.demo.runs import killed_mid_run, start_stack
from kvgate.demo.scenario import Planned, RunName, Scenario, long_shape, lower_priority, plan
from kvgate.demo.scrape import Sampler, fetch_page, final_metrics, with_sampled_peaks
from kvgate.demo.soft_pools import agent_pages, soft_pool_figures, soft_pool_lines
from kvgate.demo.stacks import Stack
from kvgate.harness.processes import ProcessGroup


class Progress:
    """One status line, rewritten in place on a terminal and printed every few seconds otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._last_plain = 0.0

    def show(self, line: str) -> None:
        if self._tty:
            self._stream.write("\r\x1b[2K" + line)
            self._stream.flush()
        elif time.monotonic() - self._last_plain >= 5.0:
            self._last_plain = time.monotonic()
            self._stream.write(line + "\n")
            self._stream.flush()

    def done(self, line: str) -> None:
        self._stream.write(("\r\x1b[2K" if self._tty else "") + line + "\n")
        self._stream.flush()


async def _report_progress(label: str, duration_s: float, load: LoadGenerator, progress: Progress) -> None:
    start = time.monotonic()
    while True:
        counts = load.progress()
        parts = " ".join(f"{key} {counts[key]}" for key in ("ok", "413", "429", "503", "async", "lost"))
        elapsed = time.monotonic() - start
        progress.show(f"{label:<18} {elapsed:5.1f}/{duration_s:.0f}s  sent {counts['sent']}  {parts}  "
                      f"in flight {counts['in_flight']}")  # fmt: skip
        await asyncio.sleep(0.5)


async def _phase(
    label: str,
    stack: Stack,
    scenario: Scenario,
    with_bursts: bool,
    progress: Progress,
    *,
    sampler: Sampler | None,
) -> list[Result]:
    duration = scenario.timing.burst_phase_s if with_bursts else scenario.timing.no_burst_phase_s
    requests = plan(scenario, duration, with_bursts)
    load = LoadGenerator(stack.url, scenario, stack.async_nodes, credentials=stack.credentials)
    bodies = load.prepare(requests)
    return await replay(
        label, load, requests, bodies, duration_s=duration, progress=progress, sampler=sampler
    )


async def replay(
    label: str,
    load: LoadGenerator,
    requests: list[Planned],
    bodies: Sequence[bytes],
    *,
    duration_s: float,
    progress: Progress,
    sampler: Sampler | None,
    start: float | None = None,
) -> list[Result]:
    """Send `requests` open-loop through `load` (while `sampler` samples the nodes), with progress,
    their times counted from `start` (time.monotonic(); now by default)."""
    start = time.monotonic() if start is None else start
    watchers = [asyncio.create_task(_report_progress(label, duration_s, load, progress))]
    if sampler is not None:
        watchers.append(asyncio.create_task(sampler.run(start)))
    try:
        results = await load.run(requests, bodies, start)
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    counts = load.progress()
    progress.done(f"{label:<18} {len(results)} requests: " + ", ".join(
        f"{key} {counts[key]}" for key in ("ok", "413", "429", "503", "async", "other", "lost") if counts[key]
    ))  # fmt: skip
    return results


async def _run_one(
    name: RunName, scenario: Scenario, out_dir: Path, envoy_config: Path, progress: Progress
) -> RunTrace:
    with (
        tempfile.TemporaryDirectory(prefix=f"kvgate-demo-{name}-") as tmp,
        ProcessGroup(out_dir / "logs" / name) as group,
    ):
        progress.done(f"{name}: starting the stack")
        stack = await start_stack(name, group, scenario, Path(tmp), envoy_config)
        quiet, busy = (
            ("no bursts", "bursts") if scenario.bursts is not None else ("short only", "long traffic")
        )
        no_burst = await _phase(f"{name} {quiet}", stack, scenario, False, progress, sampler=None)
        group.check_alive()
        sampler = Sampler(stack.nodes, parse=stack.parse_page)
        killing = killed_mid_run(name)
        killer = asyncio.create_task(_kill(group, killing, scenario.timing.burst_phase_s / 2, progress))
        burst = await _phase(f"{name} {busy}", stack, scenario, True, progress, sampler=sampler)
        killed_after_s = await killer
        final = await final_metrics(stack.nodes, wait_s=scenario.node.restart_s + 2.0, parse=stack.parse_page)
        final = with_sampled_peaks(final, sampler.timeline)
        gate_page = await fetch_page(stack.gate_metrics_url) if stack.gate_metrics_url else None
        replica_pages = await _replica_pages(stack)
        retry = read_retry_figures(gate_page) if gate_page is not None else None
        pages = await agent_pages(stack.agent_metrics)
    long_capacity = (
        None  # the simulator's capacity model does not describe a real engine
        if scenario.engine is not None
        else len(stack.long_pool) * node_capacity_tokens_per_s(scenario.node, *long_shape(scenario))
    )
    pools = {node.name: node.pool for node in stack.nodes}
    summary = summarize_run(burst, no_burst, final, pools, long_capacity, retry=retry)
    if pages:
        summary["soft_pools"] = soft_pool_figures(pages, burst, pools)
    if scenario.tenants:
        weights = {t.name: t.weight for t in scenario.tenants}
        window = scenario.timing.fairness_window_s
        lower = lower_priority(scenario.tenants)
        summary |= fairness_figures(
            burst, sampler.timeline, stack.long_pool, weights, lower_priority=lower, window_s=window
        )
        filled = idle_fill(
            burst,
            sampler.timeline,
            stack.long_pool,
            weights,
            tenants=[t for t in scenario.tenants if t.on_s > 0 and t.name not in lower],
            traffic_s=scenario.timing.burst_phase_s,
            lower_priority=lower,
        )
        if filled:
            summary["idle_fill"] = filled
        if gate_page is not None:
            summary["gate_tenant_requests"] = gate_tenant_requests(gate_page)
        if len(stack.gate_replicas) > 1:
            summary["gate_replicas"] = {
                name: gate_replica_figures(page) for name, page in replica_pages.items()
            }
    if killing:
        summary["killed"] = {"processes": list(killing), "after_s": killed_after_s}
    return RunTrace(summary, burst, sampler.timeline)


async def _replica_pages(stack: Stack) -> dict[str, str]:
    """Each live gate replica's /metrics, by name (a killed one is left out)."""
    pages = {name: await fetch_page(url) for name, url in stack.gate_replicas.items()}
    return {name: page for name, page in pages.items() if page is not None}


async def _kill(
    group: ProcessGroup, names: Sequence[str], after_s: float, progress: Progress
) -> float | None:
    """SIGKILL `names` `after_s` from now, for good (a node lost with its pods); when, since now."""
    if not names:
        return None
    start = time.monotonic()
    await asyncio.sleep(after_s)
    for name in names:
        await asyncio.to_thread(group[name].kill)
    progress.done(f"killed {', '.join(names)}")
    return time.monotonic() - start


async def run_demo(
    scenario: Scenario,
    out_dir: Path,
    envoy_config: Path,
    runs: tuple[RunName, ...] | None = None,
    stream: TextIO = sys.stderr,
) -> dict[str, Any]:
    """Run the scenario through each stack (`runs`, by default the scenario's), write report.json (and
    the plot), return the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(stream)
    traces: dict[str, RunTrace] = {}
    for name in scenario.runs if runs is None else runs:
        traces[name] = await _run_one(name, scenario, out_dir, envoy_config, progress)
        write_requests(traces[name].burst, out_dir / f"requests-{name}.jsonl")
    report = {name: trace.summary for name, trace in traces.items()}
    report_path = out_dir / "report.json"
    report_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if not write_plot(traces, out_dir / "report.png"):
        progress.done("matplotlib is not installed: no report.png (`make setup` installs it)")
    return report


def write_requests(results: list[Result], path: Path) -> None:
    """One JSON line per request replayed (of the burst phase): what was asked, when, and what came of it."""
    with path.open("w", encoding="utf-8") as out:
        for r in results:
            row = {**dataclasses.asdict(r.planned), **dataclasses.asdict(r)}
            del row["planned"]
            out.write(json.dumps(row) + "\n")


def print_report(report: Mapping[str, Mapping[str, Any]], out_dir: Path, stream: TextIO = sys.stdout) -> None:
    stream.write(format_table(report) + "\n")
    if soft := soft_pool_lines(report):
        stream.write(f"\nsoft pools (kvgate agents' per-class figures):\n{soft}\n")
    stream.write(f"\nwrote {out_dir / 'report.json'} and {out_dir / 'report.png'}\n")
