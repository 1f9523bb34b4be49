"""Fair shares between tenants on real vLLM engines: src/kvgate/demo/scenarios/fairness-vllm.yaml (the
six tenants of the fairness scenario, sized for 2 CPU cores: one long vLLM of 4,096 KV tokens) through
Envoy round robin over one vLLM, and kvgate without and with fair shares, then B and D each alone, as
bench/bench_fairness.py prints them. Needs `make engines`; about twenty-five minutes on 2 cores, so it
runs only when named (`python -m bench fairness_vllm`). Writes out/bench/fairness-vllm/report.json.
"""

from __future__ import annotations

from pathlib import Path

from bench.bench_fairness import run_fairness

OUT = Path("out/bench/fairness-vllm")


def main() -> None:
    run_fairness("fairness-vllm", OUT)
