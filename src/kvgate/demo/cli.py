"""`kvgate demo`: replay a scenario through a plain Envoy and through kvgate, and compare."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import kvgate
from kvgate.demo.scenario import (
    RUN_NAMES,
    EngineProfile,
    RunName,
    Scenario,
    builtin_scenario,
    load_scenario,
)
from kvgate.errors import ConfigError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the whole stack locally and compare it with a plain Envoy",
        description=(
            "Start simulated GPU nodes, the real Envoy, the gate and one agent per long-context node "
            "on 127.0.0.1, and replay a scenario (steady chat traffic plus bursts of 32k-token "
            "requests) twice: through a plain round-robin Envoy over one shared pool, then through "
            "kvgate, whose queue (`kvgate queue`, the async pool) holds the long requests that find no "
            "room until a node's agent reserves for them. Prints a side-by-side table and writes "
            "report.json and report.png. Everything it starts is stopped when it ends. `--only "
            "kvgate_no_queue` shows kvgate without its queue (429 after the wait); `--only "
            "kvgate_inferencepool` shows it as an InferencePool's endpoint picker behind Envoy "
            "configured as the pool's gateway (docs/picker.md). A scenario may name "
            "other runs: the rag scenario "
            "(src/kvgate/demo/scenarios/rag.yaml) compares kvgate with prefix-aware placement off and on. "
            "With --trace it replays a request trace instead (Mooncake's JSONL format) through the "
            "scenario's runs, peer routers included (default scenario: "
            "src/kvgate/demo/scenarios/trace.yaml; `make peers` installs the peers)."
        ),
    )
    parser.add_argument(
        "--scenario", type=Path, default=None, help="scenario YAML (default: the built-in burst scenario)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("out/demo"), help="output directory (default out/demo)"
    )
    parser.add_argument(
        "--envoy-config",
        type=Path,
        default=None,
        help="Envoy config of the kvgate runs (default: envoy/envoy-one-trip.yaml of this checkout, "
        "one ext_proc round trip a request; envoy/envoy.yaml is the two-trip set-up)",
    )
    parser.add_argument(
        "--only", choices=RUN_NAMES, default=None, help="run this one of the scenario's stacks only"
    )
    parser.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default=None,
        help="the nodes: simulated (sim) or real vLLM engines (vllm; `make engines` installs them, and "
        "the default scenario becomes src/kvgate/demo/scenarios/real-vllm.yaml); default: what the "
        "scenario names (its `engine:` section), else sim",
    )
    parser.add_argument(
        "--trace",
        default=None,
        metavar="FILE|NAME",
        help="replay this request trace, one JSON object a line: timestamp (ms), input_length, "
        "output_length, hash_ids (one per 512-token prompt block); a NAME is a trace kvgate ships "
        "(mooncake_conversation_first_half: Kimi's production conversation trace, Apache-2.0)",
    )
    parser.add_argument(
        "--window",
        default=":",
        metavar="START:END",
        help="with --trace: the seconds of the trace to replay, either side optional (default: all)",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        metavar="X",
        help="with --trace: send the trace X times faster; the simulated nodes' prefill and decode "
        "rates are multiplied by X, so they stay as loaded as the trace makes them (default 1)",
    )
    parser.add_argument(
        "--faults",
        default=None,
        metavar="SPEC",
        help="with --trace: kill processes of the kvgate runs during the replay, each restarted 5 s "
        "later, and report what each cost: TARGET:SECONDS[:KILL|TERM], comma-separated, TARGET one of "
        "gate, agent, queue, node (the first long node's agent or engine), SECONDS since the run's "
        "first request as replayed, e.g. gate:40s,agent:100s,queue:160s,node:220s:TERM "
        "(kvgate.demo.faults)",
    )
    parser.set_defaults(func=run)


# The kvgate runs' Envoy: one ext_proc round trip a request (the body, with the headers the gate reads
# as attributes) costs the gate 12-22% less CPU than two (docs/benchmarks.md, "One round trip"), and
# every figure the demo reads holds with it (docs/benchmarks.md, "Routing CPU by process").
DEMO_ENVOY = "envoy-one-trip.yaml"


def default_envoy_config() -> Path:
    local = Path("envoy") / DEMO_ENVOY
    if local.is_file():
        return local
    checkout = Path(kvgate.__file__).resolve().parents[2] / "envoy" / DEMO_ENVOY
    if checkout.is_file():
        return checkout
    raise ConfigError(f"no envoy/{DEMO_ENVOY} here or in the kvgate checkout: pass --envoy-config FILE")


def run(args: argparse.Namespace) -> int:
    # Imported here so that `kvgate --help` does not load the HTTP client and the process machinery.
    from kvgate.demo.runner import print_report, run_demo
    from kvgate.harness.processes import ChildError

    if args.faults is not None and args.trace is None:
        raise ConfigError("--faults needs --trace: faults are injected into a trace replay")
    scenario = with_engine(load_scenario(args.scenario or _default_scenario(args)), args.engine)
    runs = (args.only,) if args.only else scenario.runs
    envoy_config = Path()
    if any(run.startswith("kvgate") for run in runs):
        envoy_config = args.envoy_config or default_envoy_config()
    work = (
        _trace_work(args, scenario, envoy_config, runs)
        if args.trace is not None
        else run_demo(scenario, args.out, envoy_config, runs)
    )
    try:
        report = asyncio.run(_until_terminated(work))
    except ChildError as exc:
        print(f"kvgate demo: {exc}\n(logs of every process are in {args.out / 'logs'})", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        print("kvgate demo: terminated; every process it started is stopped", file=sys.stderr)
        return 143
    if args.trace is None:
        print_report(report, args.out)
        return 0
    from kvgate.demo.faults import fault_lines
    from kvgate.demo.soft_pools import soft_pool_lines
    from kvgate.demo.trace_report import format_trace_table

    print(format_trace_table(report))
    if soft := soft_pool_lines(report["runs"]):
        print(f"\nsoft pools (kvgate agents' per-class figures):\n{soft}")
    if faults := fault_lines(report["runs"]):
        print(f"\nfaults (kvgate.demo.faults):\n{faults}")
    for name, reason in report["not_run"].items():
        print(f"not run: {name}: {reason}")
    print(f"\nwrote {args.out / 'report.json'}, report.md and report.png")
    return 0


def _default_scenario(args: argparse.Namespace) -> Path:
    if args.trace:
        return builtin_scenario("trace")
    return builtin_scenario("real-vllm" if args.engine == "vllm" else "burst")


def with_engine(scenario: Scenario, engine: str | None) -> Scenario:
    """The scenario on the nodes `--engine` names (None: as the scenario says)."""
    if engine is None:
        return scenario
    if engine == "sim":
        return dataclasses.replace(scenario, engine=None)
    return dataclasses.replace(scenario, engine=scenario.engine or EngineProfile())


def _trace_work(
    args: argparse.Namespace, scenario: Scenario, envoy_config: Path, runs: tuple[RunName, ...]
) -> Coroutine[Any, Any, dict[str, Any]]:
    """The trace replay of `args` (its file read and checked before anything starts)."""
    from kvgate.demo.replay import run_trace_demo
    from kvgate.demo.trace import parse_window, read_trace, trace_file

    window = parse_window(args.window)
    path = trace_file(args.trace)
    requests = read_trace(path, window)
    return run_trace_demo(
        scenario,
        path,
        requests,
        window=window,
        speed=args.speed,
        out_dir=args.out,
        envoy_config=envoy_config,
        runs=runs,
        faults=args.faults,
    )


async def _until_terminated(work: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run `work`, cancelling it on SIGTERM so that it stops its child processes on the way out."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await work
