"""`kvgate demo --engine vllm` without starting an engine: its scenario, how it reads a live vLLM page
(captured in tests/fixtures/engines/live), the peak it reports, and what it says when the engines are
not installed. The run itself, on real engines, is `kvgate demo --engine vllm` (README)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import sentencepiece

from kvgate.demo import engines as demo_engines
from kvgate.demo.cli import with_engine
from kvgate.demo.engines import EngineNodes, parse_vllm_metrics
from kvgate.demo.load import Result, request_body
from kvgate.demo.report import format_table, summarize_run
from kvgate.demo.scenario import EngineProfile, Planned, builtin_scenario, load_scenario, plan
from kvgate.demo.scrape import Node, NodeMetrics, Sample, with_sampled_peaks
from kvgate.demo.stacks import SimNodes, node_kind
from kvgate.demo.tokenizer import tokenizer_file
from kvgate.harness.engines import NoEngines
from kvgate.harness.processes import ChildError, ProcessGroup

LIVE = Path(__file__).resolve().parent / "fixtures" / "engines" / "live"


def test_the_real_vllm_scenario_overfills_one_engine_and_fits_kvgates_split() -> None:
    scenario = load_scenario(builtin_scenario("real-vllm"))
    assert scenario.engine == EngineProfile(kind="vllm", model_seed=0, start_timeout_s=900.0)
    assert scenario.runs == ("baseline", "kvgate")
    assert (
        scenario.layout.baseline_nodes,
        scenario.layout.interactive_nodes,
        scenario.layout.long_nodes,
    ) == (
        1,
        1,
        1,
    )
    assert scenario.bursts is not None
    burst = scenario.bursts.size_min * (scenario.bursts.prompt_tokens + scenario.bursts.max_tokens)
    usable = scenario.node.kv_capacity_tokens - 128  # vLLM's null block
    assert burst > usable, "the burst must overrun one engine's KV pool"
    # Behind kvgate at least two of the burst fit the long engine at once (safety ratio 0.9).
    assert 2 * (scenario.bursts.prompt_tokens + scenario.bursts.max_tokens) < 0.9 * usable


def test_engine_flag_picks_the_nodes() -> None:
    burst = load_scenario(builtin_scenario("burst"))
    real = load_scenario(builtin_scenario("real-vllm"))
    assert with_engine(burst, None) is burst
    assert with_engine(burst, "vllm").engine == EngineProfile()
    assert with_engine(real, "vllm").engine == real.engine
    assert with_engine(real, "sim").engine is None
    assert isinstance(node_kind(burst), SimNodes)
    assert isinstance(node_kind(real), EngineNodes)


def test_a_live_vllm_page_under_the_burst_reads_as_the_engine_wrote_it() -> None:
    page = (LIVE / "vllm-0.32.0-load.txt").read_text(encoding="utf-8")
    metrics = parse_vllm_metrics(page)
    # 256 blocks of 128 on the page; kv_cache_usage_perc counts all but the null block.
    assert metrics == NodeMetrics(
        kv_usage=1.0,
        running=4,
        waiting=3,
        preemptions=0,
        oom_crashes=0,
        peak_kv_tokens=32_640,
        capacity_tokens=32_640,
        prefix_hit_tokens=3968,
    )
    after = parse_vllm_metrics((LIVE / "vllm-0.32.0-after.txt").read_text(encoding="utf-8"))
    assert (after.kv_usage, after.preemptions, after.running) == (0.0, 1, 0)


def test_a_page_without_a_kv_pool_is_unreadable() -> None:
    with pytest.raises(ValueError, match="vLLM"):
        parse_vllm_metrics((LIVE / "llama-server-11434.0.0-load.txt").read_text(encoding="utf-8"))


def test_the_peak_is_the_highest_usage_sampled_when_the_engine_keeps_none() -> None:
    idle = NodeMetrics(0.0, 0, 0, 1, 0, 0, 32_640)
    timeline = {
        "long-0": [Sample(0.0, dataclasses.replace(idle, kv_usage=0.5)), Sample(0.25, None)],
        "long-1": [Sample(0.0, dataclasses.replace(idle, kv_usage=0.76))],
    }
    final = with_sampled_peaks({"long-0": idle, "long-1": idle, "down": None}, timeline)
    assert final == {
        "long-0": dataclasses.replace(idle, peak_kv_tokens=16_320),
        "long-1": dataclasses.replace(idle, peak_kv_tokens=24_806),
        "down": None,
    }
    # A simulator's own peak, taken at every step, stays when the samples missed it.
    sim = dataclasses.replace(idle, peak_kv_tokens=30_000)
    assert with_sampled_peaks({"long-0": sim}, timeline)["long-0"] == sim


def test_the_report_counts_the_engines_prompt_tokens_and_refusals() -> None:
    def result(kind: str, outcome: str, prompt: int = 0, index: int = 0) -> Result:
        planned = Planned(0.0, kind, 8000, 300, index)  # type: ignore[arg-type]
        return Result(planned, 0.0, outcome, 200, 0.1, 1.0, 300, prompt_tokens=prompt)  # type: ignore[arg-type]

    burst = [
        result("short", "ok", 509),
        result("long", "ok", 8009),
        result("long", "429"),
        result("long", "lost"),
    ]
    metrics = {"long-0": NodeMetrics(0.0, 0, 0, 0, 0, 24_806, 32_640)}
    summary = summarize_run(burst, [], metrics, {"long-0": "long"}, None)
    assert (summary["short_prompt_tokens"], summary["long_prompt_tokens"]) == (509, 8009)
    assert (summary["long_served"], summary["long_refused"], summary["requests_lost"]) == (1, 1, 1)
    assert summary["long_capacity_tokens_per_s"] is None
    assert summary["peak_kv_fraction"] == {"long-0": 0.76}
    table = format_table({"kvgate": summary})
    assert "long_refused" in table and "long_prompt_tokens" in table


def test_without_the_engines_installed_the_demo_says_what_to_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        demo_engines, "locate_engines", lambda: NoEngines("no .venv-engines: run `make engines`")
    )
    scenario = load_scenario(builtin_scenario("real-vllm"))
    assert scenario.engine is not None
    with ProcessGroup(tmp_path) as group, pytest.raises(ChildError, match="make engines"):
        asyncio.run(EngineNodes(scenario.engine).start(group, scenario, [Node("shared-0", 1, "shared")], {}))


def test_under_the_scenarios_tokenizer_each_prompt_is_exact_and_its_own() -> None:
    scenario = load_scenario(builtin_scenario("real-vllm"))
    assert scenario.tokenizer is not None
    counter = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_file(scenario.tokenizer)))
    planned = plan(scenario, scenario.timing.burst_phase_s, with_bursts=True)
    longs = [p for p in planned if p.kind == "long"][:2]
    short = next(p for p in planned if p.kind == "short")
    texts = [json.loads(request_body(scenario, p))["messages"][0]["content"] for p in (*longs, short)]
    assert [len(counter.encode(text)) for text in texts] == [8000, 8000, short.prompt_tokens]
    assert texts[0][:200] != texts[1][:200], "two requests of the burst share a prefix"
