"""The rag scenario: documents asked many questions and agent sessions, run through kvgate with
prefix-aware placement off and on; the plan, the bodies, the report's keys, and a short run end to end."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
from pathlib import Path

import pytest
import yaml

from kvgate.config import parse_config
from kvgate.demo.load import request_body
from kvgate.demo.report import format_table
from kvgate.demo.runner import run_demo
from kvgate.demo.scenario import builtin_scenario, load_scenario, parse_scenario, plan
from kvgate.demo.stacks import gate_config
from kvgate.errors import ConfigError

REPO_ENVOY = Path(__file__).resolve().parent.parent / "envoy" / "envoy.yaml"
LONG_KEYS = {"long_requests", "long_served", "long_ttft_p50_ms", "long_ttft_p99_ms", "prefix_hit_tokens"}


def test_the_rag_scenario_compares_prefix_affinity_off_and_on() -> None:
    scenario = load_scenario(builtin_scenario("rag"))
    assert scenario.runs == ("kvgate_prefix_off", "kvgate_prefix_on")
    assert scenario.bursts is None and scenario.documents is not None and scenario.sessions is not None
    assert 20_000 <= scenario.documents.tokens_min <= scenario.documents.tokens_max <= 30_000
    # Six documents do not fit one node's KV: where a question goes decides whether it is cached.
    assert scenario.documents.count * scenario.documents.tokens_min > scenario.node.kv_capacity_tokens


def test_questions_repeat_their_document_and_sessions_resend_their_history() -> None:
    scenario = load_scenario(builtin_scenario("rag"))
    requests = plan(scenario, 40.0, with_bursts=True)
    assert [p for p in plan(scenario, 40.0, with_bursts=False) if p.kind == "long"] == []
    questions = [p for p in requests if p.label.startswith("doc ")]
    by_document: dict[str, list[int]] = {}
    for p in questions:
        assert p.parts[0][0] == "system" and p.prompt_tokens == sum(part[2] for part in p.parts)
        by_document.setdefault(p.parts[0][1], []).append(p.index)
    assert len(by_document) == 6 and max(len(v) for v in by_document.values()) >= 5
    bodies = {p.index: json.loads(request_body(scenario, p)) for p in questions[:20]}
    same = [i for i in by_document[questions[0].parts[0][1]] if i in bodies]
    assert len({bodies[i]["messages"][0]["content"] for i in same}) == 1, "one document, one text"
    turns = [p for p in requests if p.label.startswith("session 0 ")]
    assert len(turns) == 8
    for before, after in itertools.pairwise(turns):
        assert after.parts[: len(before.parts)] == before.parts
        assert after.prompt_tokens == before.prompt_tokens + 1500


def test_scenarios_name_their_runs_and_may_have_no_bursts() -> None:
    with pytest.raises(ConfigError, match=r"runs\[0\]: must be one of baseline, kvgate"):
        parse_scenario("runs: [kvgate_prefix_sideways]")
    with pytest.raises(ConfigError, match="max_model_len"):
        parse_scenario("bursts: null\ndocuments: {tokens_max: 41000, tokens_min: 40000}")
    scenario = parse_scenario("bursts: null\nsessions: {count: 1, turns: 2}")
    assert {p.label for p in plan(scenario, 30.0, True) if p.kind == "long"} == {
        "session 0 turn 0",
        "session 0 turn 1",
    }


def test_the_prefix_on_run_turns_placement_on_in_the_gate_config() -> None:
    scenario = load_scenario(builtin_scenario("rag"))
    on = parse_config(yaml.safe_dump(gate_config(scenario, 9100, [9200], prefix_affinity=True)), "on")
    off = parse_config(yaml.safe_dump(gate_config(scenario, 9100, [9200])), "off")
    assert on.placement.prefix_affinity and not off.placement.prefix_affinity


SMALL_RAG = """
name: rag-smoke
seed: 2
runs: [kvgate_prefix_off, kvgate_prefix_on]
node: {kv_capacity_tokens: 16384, max_model_len: 8192, interactive_max_model_len: 1024,
       prefill_tokens_per_s: 20000, decode_tokens_per_s: 100, on_exhaustion: crash, restart_s: 1}
layout: {interactive_nodes: 1, long_nodes: 2}
short: {rate_per_s: 3, prompt_tokens_min: 100, prompt_tokens_max: 200, max_tokens: 16}
bursts: null
documents: {count: 6, tokens_min: 4000, tokens_max: 6000, question_tokens_min: 50,
            question_tokens_max: 100, rate_per_s: 3, max_tokens: 16}
sessions: {count: 1, first_tokens: 2000, turn_tokens: 500, turns: 3, every_s: 1.5, max_tokens: 16}
timing: {burst_phase_s: 5, no_burst_phase_s: 1, drain_s: 8, request_timeout_s: 15, connect_timeout_s: 2,
         max_in_flight: 64}
"""


@pytest.mark.slow
def test_a_small_rag_scenario_runs_both_placements_end_to_end(tmp_path: Path) -> None:
    scenario = parse_scenario(SMALL_RAG)
    report = asyncio.run(
        asyncio.wait_for(run_demo(scenario, tmp_path, REPO_ENVOY, stream=io.StringIO()), 120)
    )
    assert set(report) == {"kvgate_prefix_off", "kvgate_prefix_on"}
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert (tmp_path / "report.png").stat().st_size > 10_000
    for run in report.values():
        assert run.keys() >= LONG_KEYS
        assert run["oom_crashes"] == 0 and run["requests_lost"] == 0
        assert all(peak <= 1.0 for peak in run["peak_kv_fraction"].values())
        assert run["long_requests"] > 10
    off, on = report["kvgate_prefix_off"], report["kvgate_prefix_on"]
    assert on["long_served"] >= off["long_served"] - 1
    # With affinity the documents' questions find their document: most of their prompt is a hit.
    assert on["prefix_hit_tokens"] > off["prefix_hit_tokens"]
    assert "long_ttft_p50_ms" in format_table(report)
