"""`kvgate demo --trace`: one window of a request trace through every run, side by side.

Each run starts its stack on fresh nodes (kvgate.demo.runs), waits until it can place a long request,
replays the window open-loop (kvgate.demo.trace: arrivals / speed, nodes `speed` times faster) while
sampling every node, reads the routing layer's CPU before and after (and, over 10 s before, its idle
CPU: the report's fixed part), then the nodes' counters, and
stops the stack. A peer router that is not installed is recorded with the reason and skipped.
report.json holds the runs' figures (kvgate.demo.trace_report) and, at the top level, the trace, its
window, the speed, and `prefix_bound_tokens`: what an infinite prefix cache would hit on the window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from kvgate.demo.cpu import CpuMeter, idle_cpu_per_s
from kvgate.demo.fault_injection import inject_faults, shift
from kvgate.demo.faults import Fault, fault_figures, parse_faults
from kvgate.demo.load import LazyBodies, LoadGenerator
from kvgate.demo.peers import PEER_RUNS, limits, unavailable
from kvgate.demo.runner import Progress, replay, write_requests
from kvgate.demo.runs import gate_follows_agents, start_stack
from kvgate.demo.scenario import Planned, RunName, Scenario
from kvgate.demo.scrape import Sampler, final_metrics
from kvgate.demo.soft_pools import agent_pages, soft_pool_figures
from kvgate.demo.trace import (
    CLASSES,
    TraceRequest,
    Window,
    compressed,
    misfits,
    plan_trace,
    prefix_bound,
    prompt_class,
)
from kvgate.demo.trace_plot import RunSeries, write_trace_plot
from kvgate.demo.trace_report import markdown_trace_table, summarize_trace_run
from kvgate.errors import ConfigError
from kvgate.harness.processes import ProcessGroup

_SAMPLE_S = 1.0
# How long the routing layer's idle CPU is read before the replay (kvgate.demo.trace_report.cpu_split).
_IDLE_S = 10.0
# Start-up work still running when the stack reports ready is not the stack's fixed cost.
_SETTLE_S = 5.0


async def _replay_one(
    name: RunName,
    *,
    scenario: Scenario,
    planned: list[Planned],
    speed: float,
    out_dir: Path,
    envoy_config: Path,
    progress: Progress,
    faults: tuple[Fault, ...] = (),
) -> tuple[dict[str, Any], RunSeries]:
    with (
        tempfile.TemporaryDirectory(prefix=f"kvgate-trace-{name}-") as tmp,
        ProcessGroup(out_dir / "logs" / name) as group,
    ):
        progress.done(f"{name}: starting the stack")
        stack = await start_stack(name, group, scenario, Path(tmp), envoy_config)
        await gate_follows_agents(stack)
        routing = {process: group[process].process.pid for process in stack.routing}
        # The stack's fixed CPU, its timers with no traffic: the report charges it per second of replay.
        # Read once start-up is over: the gate's exact-count workers load their tokenizer after it
        # listens (about 0.6 s of CPU, which read as 60 ms/s of "idle" gate).
        await asyncio.sleep(_SETTLE_S)
        idle = await idle_cpu_per_s(routing, _IDLE_S)
        meter = CpuMeter(routing)
        nodes_meter = CpuMeter({node.name: group[node.name].process.pid for node in stack.nodes})
        own_before = time.process_time()
        load = LoadGenerator(stack.url, scenario, stack.async_nodes)
        sampler = Sampler(stack.nodes, interval_s=_SAMPLE_S)
        load_before = os.getloadavg()
        meter.start()
        nodes_meter.start()
        duration = planned[-1].at_s
        bodies = LazyBodies(scenario, planned)
        start = time.monotonic()
        injecting = None
        if faults:
            meters = (meter, nodes_meter)
            first_at = start + planned[0].at_s
            injecting = asyncio.create_task(
                inject_faults(faults, group, stack, meters, first_at=first_at, progress=progress)
            )
        results = await replay(
            name, load, planned, bodies, duration_s=duration, progress=progress, sampler=sampler, start=start
        )
        injected = shift(await injecting, start) if injecting is not None else []
        cpu = meter.stop()
        nodes_cpu = nodes_meter.stop()
        own_cpu = time.process_time() - own_before
        load_after = os.getloadavg()
        group.check_alive()
        final = await final_metrics(stack.nodes, wait_s=scenario.node.restart_s + 2.0)
        pages = await agent_pages(stack.agent_metrics)
    summary = summarize_trace_run(results, final, cpu, speed, idle_cpu_per_s=idle, metered_s=meter.seconds)
    if pages:
        pools = {node.name: node.pool for node in stack.nodes}
        summary["soft_pools"] = soft_pool_figures(pages, results, pools)
    if faults:
        summary["faults"] = fault_figures(
            injected,
            results,
            interactive_nodes=frozenset(n.name for n in stack.nodes if n.pool == "interactive"),
            interactive_max_tokens=scenario.node.interactive_max_model_len,
            first_s=planned[0].at_s,
        )
    summary["load_average_1m"] = [round(load_before[0], 2), round(load_after[0], 2)]
    # Not the routing layer's, for the record: the simulated nodes' CPU and the load generator's own.
    summary["nodes_cpu_ms_per_request"] = round(sum(nodes_cpu.values()) * 1000 / len(results), 3)
    summary["load_generator_cpu_ms_per_request"] = round(own_cpu * 1000 / len(results), 3)
    if name in PEER_RUNS:
        summary["cannot"] = limits(name)
    write_requests(results, out_dir / f"requests-{name}.jsonl")
    return summary, RunSeries(results, sampler.timeline)


def _class_counts(requests: list[TraceRequest]) -> dict[str, int]:
    return {name: sum(1 for r in requests if prompt_class(r.input_tokens) == name) for name, _ in CLASSES}


async def run_trace_demo(
    scenario: Scenario,
    trace: Path,
    requests: list[TraceRequest],
    *,
    window: Window,
    speed: float,
    out_dir: Path,
    envoy_config: Path,
    runs: tuple[RunName, ...] | None = None,
    stream: TextIO = sys.stderr,
    faults: str | None = None,
) -> dict[str, Any]:
    """Replay `requests` (the trace's window) through each run; write report.json, report.md, the
    plot and one requests-<run>.jsonl per run; return the report."""
    if not requests:
        raise ConfigError(f"the window {window} of {trace} holds no request")
    problem = misfits(requests, scenario)
    if problem is not None:
        raise ConfigError(f"{trace}: {problem}")
    if speed <= 0:
        raise ConfigError(f"--speed must be > 0, got {speed:g}")
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(stream)
    fast = compressed(scenario, speed)
    planned = plan_trace(requests, window, speed, scenario.node.interactive_max_model_len)
    injected = parse_faults(faults, planned[-1].at_s - planned[0].at_s) if faults is not None else ()
    bound = prefix_bound(requests)
    summaries: dict[str, dict[str, Any]] = {}
    series: dict[str, RunSeries] = {}
    not_run: dict[str, str] = {}
    for name in scenario.runs if runs is None else runs:
        reason = unavailable(name) if name in PEER_RUNS else None
        if reason is not None:
            not_run[name] = reason
            progress.done(f"{name}: not run: {reason}")
            continue
        summaries[name], series[name] = await _replay_one(
            name,
            scenario=fast,
            planned=planned,
            speed=speed,
            out_dir=out_dir,
            envoy_config=envoy_config,
            progress=progress,
            # Only kvgate's own processes are killed: the baseline and the peers have none of them.
            faults=injected if name.startswith("kvgate") else (),
        )
    report: dict[str, Any] = {
        "trace": str(trace),
        "window_s": [window.start_s, requests[-1].at_s if window.end_s == float("inf") else window.end_s],
        "speed": speed,
        "requests": len(requests),
        "requests_by_class": _class_counts(requests),
        "input_tokens": sum(r.input_tokens for r in requests),
        "prefix_bound_tokens": sum(bound),
        "replay_s": round(planned[-1].at_s, 1),
        "nodes_as_run": {
            **dataclasses.asdict(fast.node),
            "note": f"prefill and decode rates x{speed:g} (restart time / {speed:g}): the trace runs "
            f"{speed:g} times faster, so the nodes do too",
        },
        "layout": dataclasses.asdict(scenario.layout),
        "cpu_count": os.cpu_count(),
        "runs": summaries,
        "not_run": not_run,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(markdown_trace_table(report) + "\n", encoding="utf-8")
    bound_series = [(p.at_s, tokens) for p, tokens in zip(planned, bound, strict=True)]
    if not write_trace_plot(series, bound_series, out_dir / "report.png"):
        progress.done("matplotlib is not installed: no report.png (`make setup` installs it)")
    return report
