"""The smoke scenario end to end: real Envoy, gate, agents and simulated nodes, both runs."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from pathlib import Path

import pytest

from kvgate.demo.runner import run_demo
from kvgate.demo.scenario import builtin_scenario, load_scenario

REPO_ENVOY = Path(__file__).resolve().parent.parent / "envoy" / "envoy.yaml"
KEYS = {
    "oom_crashes", "preemptions", "requests_total", "requests_lost", "outcomes", "short_ttft_p50_ms",
    "short_ttft_p99_ms", "short_ttft_p99_ms_no_burst", "peak_kv_fraction", "long_goodput_tokens_per_s",
    "long_capacity_tokens_per_s",
}  # fmt: skip


@pytest.mark.slow
def test_smoke_scenario_compares_baseline_and_kvgate(tmp_path: Path) -> None:
    scenario = load_scenario(builtin_scenario("smoke"))
    progress = io.StringIO()
    report = asyncio.run(asyncio.wait_for(run_demo(scenario, tmp_path, REPO_ENVOY, stream=progress), 90))
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert (tmp_path / "report.png").stat().st_size > 10_000
    lines = (tmp_path / "requests-kvgate.jsonl").read_text().splitlines()
    assert len(lines) == report["kvgate"]["requests_total"]
    assert {"at_s", "kind", "outcome", "ttft_s"} <= json.loads(lines[0]).keys()
    assert "baseline bursts" in progress.getvalue()
    baseline, kvgate = report["baseline"], report["kvgate"]
    assert baseline.keys() >= KEYS
    assert kvgate.keys() >= KEYS
    assert set(baseline["outcomes"]) >= {"ok", "413", "429", "503", "async"}
    assert baseline["requests_total"] == kvgate["requests_total"] > 10
    # Five long requests at once on two shared nodes: one node gets three and runs out of memory.
    assert baseline["oom_crashes"] >= 1
    assert baseline["requests_lost"] >= 1
    assert kvgate["oom_crashes"] == 0
    assert kvgate["requests_lost"] == 0
    assert all(peak <= 1.0 for peak in kvgate["peak_kv_fraction"].values())
    # kvgate's queue holds what finds no room until a node has it: every long request is served.
    assert kvgate["outcomes"]["429"] == 0
    assert kvgate["long_served"] == kvgate["long_requests"] >= 1
    assert set(kvgate["peak_kv_fraction"]) == {"interactive-0", "long-0"}


@pytest.mark.slow
def test_the_smoke_burst_through_an_inferencepool_gateway_overruns_no_node_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """kvgate as the endpoint picker behind Envoy configured as the pool's gateway
    (envoy-inferencepool.yaml): the same burst, no queue, so what finds no room gets 429."""
    scenario = dataclasses.replace(load_scenario(builtin_scenario("smoke")), runs=("kvgate_inferencepool",))
    report = asyncio.run(asyncio.wait_for(run_demo(scenario, tmp_path, REPO_ENVOY, stream=io.StringIO()), 90))
    picker = report["kvgate_inferencepool"]
    assert picker.keys() >= KEYS
    assert (picker["oom_crashes"], picker["preemptions"], picker["requests_lost"]) == (0, 0, 0)
    assert all(peak <= 1.0 for peak in picker["peak_kv_fraction"].values())
    assert picker["long_served"] >= 1, "long requests reach the long node the picker named"
    served_or_refused = picker["outcomes"]["ok"] + picker["outcomes"]["429"]
    assert served_or_refused == picker["requests_total"], picker["outcomes"]
