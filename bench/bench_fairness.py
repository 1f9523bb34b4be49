"""Fair shares between tenants: the fairness scenario through kvgate without and with fair shares,
and through what a team would use instead.

Replays src/kvgate/demo/scenarios/fairness.yaml (six tenants, each a verified token's tenant, one
flooding the long pool, one of weight 3, one on and off, one at low priority, everyone chatting beside)
on simulated nodes, through each of its runs: plain Envoy round robin, Envoy holding each tenant to a
sixth of the nodes' requests a second (its local rate limit), smg and vllm-router (`make peers`),
kvgate without and with fair shares, then with fair shares on two gate and two queue replicas (A on
one gate alone), and the same with one gate and one queue killed halfway. Prints every run's figures
side by side (kvgate.demo.fairness: Jain's index in 60 s windows, the service gap against twice the
largest request's cost, each tenant's share against its weighted max-min fair share) and the ratios
of the run with fair shares to the run without, measured in the same session; then B and D each
alone on the same nodes, their TTFT reference; then `kvgate_fair` once more with A off for the last
minute: who takes the KV it leaves (kvgate.demo.idle_fill). About fifty minutes; writes
out/bench/fairness/report.json ({"runs": {name: figures}}, the alone runs as alone_B and alone_D, the
last as kvgate_fair_a_off).
`python -m bench fairness_vllm` does the same on real vLLM engines (bench/bench_fairness_vllm.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvgate.demo.cli import default_envoy_config
from kvgate.demo.idle_fill import quiet_at_end
from kvgate.demo.report import format_table
from kvgate.demo.runner import run_demo
from kvgate.demo.scenario import builtin_scenario, load_scenario

OUT = Path("out/bench/fairness")
ALONE = ("B", "D")  # the tenants also run alone, for their TTFT reference
FLOOD = "A"  # the tenant that goes quiet for the last window of one more run
QUIET_RUN = "kvgate_fair_a_off"
REPLICATED = ("kvgate_fair_2x", "kvgate_fair_2x_kill")


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if numerator is None or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}"


def main() -> None:
    run_fairness("fairness", OUT)


def run_fairness(scenario_name: str, out: Path) -> None:
    """The built-in scenario `scenario_name`'s runs, then B and D alone, then fair shares with A quiet for
    the last window; the figures side by side."""
    scenario = load_scenario(builtin_scenario(scenario_name))
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    report: dict[str, Any] = asyncio.run(run_demo(scenario, out, default_envoy_config(), stream=sys.stdout))
    for name in ALONE:
        # The tenant's own traffic alone on the same nodes, with fair shares: its TTFT reference.
        (tenant,) = [t for t in scenario.tenants if t.name == name]
        alone = dataclasses.replace(scenario, tenants=(tenant,), runs=("kvgate_fair",))
        run = asyncio.run(run_demo(alone, out / f"alone_{name}", default_envoy_config(), stream=sys.stdout))
        report[f"alone_{name}"] = run["kvgate_fair"]
    # The flood goes quiet for the last window: who takes the KV it leaves.
    quiet = dataclasses.replace(quiet_at_end(scenario, FLOOD), runs=("kvgate_fair",))
    run = asyncio.run(run_demo(quiet, out / QUIET_RUN, default_envoy_config(), stream=sys.stdout))
    report[QUIET_RUN] = run["kvgate_fair"]
    (out / "report.json").write_text(json.dumps({"runs": report}, indent=2) + "\n", encoding="utf-8")
    print(format_table(report))
    off, on = report["kvgate_nofair"], report["kvgate_fair"]
    print()
    for key in ("jain_mean", "jain_min", "service_gap_max", "kv_occupancy_mean", "output_tokens_per_s"):
        print(f"{key + ', fair / not fair':<45} {_ratio(on[key], off[key])}")
    print(f"{'chat TTFT p99, fair / not fair':<45} {_ratio(on['chat_ttft_p99_ms'], off['chat_ttft_p99_ms'])}")
    bound = 2 * on["largest_request_cost"]
    print(
        f"service gap with fair shares {on['service_gap_max']:,} against the bound 2 x largest cost {bound:,}"
    )
    for tenant, figures in on["tenants"].items():
        print(
            f"tenant {tenant} (weight {figures['weight']:g}): share {figures['share']} "
            f"(fair {figures['fair_share']}), without fair shares {off['tenants'][tenant]['share']}; "
            f"long TTFT p99 {figures['long_ttft_p99_ms']} ms, 429s {figures['refused_429']}"
        )
    for tenant, quiet in report[QUIET_RUN].get("idle_fill", {}).items():
        print(
            f"{QUIET_RUN}, while {tenant} is off ({quiet['off_s']:g} s): long-pool KV occupancy "
            f"{quiet['kv_occupancy_off']} against {quiet['kv_occupancy_on']} while on "
            f"({quiet['kv_occupancy_ratio']}x); the lower priority's share of the service "
            f"{quiet['filler_share_off']} against {quiet['filler_share_on']}"
        )
    for name in ALONE:
        beside = on["tenants"][name]["long_ttft_p99_ms"]
        alone = report[f"alone_{name}"]["tenants"][name]["long_ttft_p99_ms"]
        print(f"tenant {name}: long TTFT p99 beside the others / alone {_ratio(beside, alone)}")
    print(f"preemptions {off['preemptions']} / {on['preemptions']}, "
          f"lost {off['requests_lost']} / {on['requests_lost']} (without / with fair shares)")  # fmt: skip
    for name in (name for name in REPLICATED if name in report):
        run = report[name]
        print(
            f"{name}: service gap {run['service_gap_max']:,} against 4 x largest cost "
            f"{4 * run['largest_request_cost']:,}; Jain mean {run['jain_mean']} min {run['jain_min']}; "
            f"preemptions {run['preemptions']}, lost {run['requests_lost']}"
            + (f"; killed {', '.join(run['killed']['processes'])} at {run['killed']['after_s']:.0f} s"
               if "killed" in run else "")
        )  # fmt: skip
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"wrote {out / 'report.json'}")
