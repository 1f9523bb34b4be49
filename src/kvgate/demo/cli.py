"""`kvgate demo`: replay a scenario through a plain Envoy and through kvgate, and compare."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import kvgate
from kvgate.demo.scenario import RUN_NAMES, builtin_scenario, load_scenario
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
            "kvgate_no_queue` shows kvgate without its queue (429 after the wait). A scenario may name "
            "other runs: the rag scenario "
            "(src/kvgate/demo/scenarios/rag.yaml) compares kvgate with prefix-aware placement off and on."
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
        help="Envoy config of the kvgate run (default: envoy/envoy.yaml of this checkout)",
    )
    parser.add_argument(
        "--only", choices=RUN_NAMES, default=None, help="run this one of the scenario's stacks only"
    )
    parser.set_defaults(func=run)


def default_envoy_config() -> Path:
    local = Path("envoy/envoy.yaml")
    if local.is_file():
        return local
    checkout = Path(kvgate.__file__).resolve().parents[2] / "envoy" / "envoy.yaml"
    if checkout.is_file():
        return checkout
    raise ConfigError("no envoy/envoy.yaml here or in the kvgate checkout: pass --envoy-config FILE")


def run(args: argparse.Namespace) -> int:
    # Imported here so that `kvgate --help` does not load the HTTP client and the process machinery.
    from kvgate.demo.runner import print_report, run_demo
    from kvgate.harness.processes import ChildError

    scenario = load_scenario(args.scenario or builtin_scenario("burst"))
    runs = (args.only,) if args.only else scenario.runs
    envoy_config = Path()
    if any(run != "baseline" for run in runs):
        envoy_config = args.envoy_config or default_envoy_config()
    try:
        report = asyncio.run(_until_terminated(run_demo(scenario, args.out, envoy_config, runs)))
    except ChildError as exc:
        print(f"kvgate demo: {exc}\n(logs of every process are in {args.out / 'logs'})", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        print("kvgate demo: terminated; every process it started is stopped", file=sys.stderr)
        return 143
    print_report(report, args.out)
    return 0


async def _until_terminated(work: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run `work`, cancelling it on SIGTERM so that it stops its child processes on the way out."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await work
