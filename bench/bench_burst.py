"""The headline: the burst scenario through a plain Envoy and through kvgate, side by side.

Replays src/kvgate/demo/scenarios/burst.yaml (steady chat traffic plus bursts of 3-5 requests of
32k tokens) on simulated nodes with the real Envoy, gate and agents, as `make demo` does, and prints
each run's figures and kvgate's ratios against the baseline measured in the same run. About two
minutes; writes out/bench/burst/report.json and report.png.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from kvgate.demo.cli import default_envoy_config
from kvgate.demo.report import format_table
from kvgate.demo.runner import run_demo
from kvgate.demo.scenario import builtin_scenario, load_scenario

OUT = Path("out/bench/burst")


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}"


def main() -> None:
    scenario = load_scenario(builtin_scenario("burst"))
    report: dict[str, Any] = asyncio.run(run_demo(scenario, OUT, default_envoy_config(), stream=sys.stdout))
    print(format_table(report))
    base, gate = report["baseline"], report["kvgate"]
    ttft, no_burst = "short_ttft_p99_ms", "short_ttft_p99_ms_no_burst"
    goodput, capacity = "long_goodput_tokens_per_s", "long_capacity_tokens_per_s"
    ratios = [
        ("kvgate: short TTFT p99, bursts / no bursts", gate[ttft], gate[no_burst]),
        ("baseline: short TTFT p99, bursts / no bursts", base[ttft], base[no_burst]),
        ("short TTFT p99, kvgate / baseline", gate[ttft], base[ttft]),
        ("kvgate: long goodput / capacity", gate[goodput], gate[capacity]),
        ("baseline: long goodput / capacity", base[goodput], base[capacity]),
    ]
    print()
    for label, numerator, denominator in ratios:
        print(f"{label:<45} {_ratio(numerator, denominator)}")
    print(f"OOM crashes {base['oom_crashes']} -> {gate['oom_crashes']}, "
          f"lost requests {base['requests_lost']} -> {gate['requests_lost']}")  # fmt: skip
    print(f"wrote {OUT / 'report.json'} and {OUT / 'report.png'}")
