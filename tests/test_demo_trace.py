"""`kvgate demo --trace`: reading a trace, its window and plan, the bound an infinite cache sets, the
prompts synthesised from its block ids under the tokenizers the demo uses, the report's figures, and
what a peer run is."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from conftest import TOKENIZER_DIR

from kvgate.demo.cpu import CpuMeter
from kvgate.demo.load import LazyBodies, Result, request_body
from kvgate.demo.peers import PEER_RUNS, limits, peer_of
from kvgate.demo.prompts import BLOCK_TOKENS, PromptBlocks
from kvgate.demo.scenario import Planned, builtin_scenario, load_scenario, parse_scenario
from kvgate.demo.scrape import NodeMetrics
from kvgate.demo.tokenizer import prompt_blocks, tokenizer_file
from kvgate.demo.trace import (
    Window,
    compressed,
    misfits,
    parse_window,
    plan_trace,
    prefix_bound,
    prompt_class,
    read_trace,
    trace_file,
)
from kvgate.demo.trace_report import format_trace_table, markdown_trace_table, summarize_trace_run
from kvgate.errors import ConfigError
from kvgate.estimate import calibration
from kvgate.estimate.exact import TokenizerFile
from kvgate.estimate.fast import FastEstimator
from kvgate.harness.peers import POLICIES
from kvgate.sim.tokens import ByteQuads, SimTokenizer, load_tokenizer

# The trace scenario's tokenizer, and the sentencepiece model real vLLM runs here with.
TEKKEN = "tekken_240911.json"
SENTENCEPIECE = "tokenizer.model.v1"


def line(at_ms: int, tokens: int, output: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": at_ms, "input_length": tokens, "output_length": output, "hash_ids": ids})


def test_a_trace_is_read_in_its_window_and_a_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join([line(2000, 600, 5, [0, 1]), line(0, 512, 9, [0]), "", line(9000, 10, 1, [7])]) + "\n"
    )
    requests = read_trace(path)
    assert [(r.line, r.at_s, r.input_tokens, r.hash_ids) for r in requests] == [
        (2, 0.0, 512, (0,)),
        (1, 2.0, 600, (0, 1)),
        (4, 9.0, 10, (7,)),
    ]
    assert [r.line for r in read_trace(path, parse_window("1:9"))] == [1]
    path.write_text(line(0, 600, 5, [0]) + "\n")
    with pytest.raises(
        ConfigError, match=r"t\.jsonl:1: 600 input tokens are 2 blocks of 512, but hash_ids has 1"
    ):
        read_trace(path)
    path.write_text(line(0, 10, 1, [0]) + '\n{"timestamp": 5, "input_length": 10, "hash_ids": [0]}\n')
    with pytest.raises(ConfigError, match=r"t\.jsonl:2: output_length must be a whole number >= 1"):
        read_trace(path)


def test_a_window_is_start_end_in_trace_seconds() -> None:
    assert parse_window("300:") == Window(300.0, math.inf)
    assert parse_window(":600") == Window(0.0, 600.0)
    assert parse_window(":") == Window()
    assert str(parse_window("10:20.5")) == "10:20.5"
    for bad in ("20:10", "abc", "5", "-1:3"):
        with pytest.raises(ConfigError, match="--window"):
            parse_window(bad)


def test_the_plan_sends_at_trace_time_over_speed_and_classes_by_the_interactive_limit(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([line(10_000, 3000, 96, [0, 1, 2, 3, 4, 5]), line(16_000, 4000, 97, [0] * 8)]))
    requests = read_trace(path, Window(10.0, 20.0))
    planned = plan_trace(requests, Window(10.0, 20.0), speed=4.0, interactive_max_tokens=4096)
    assert [(p.at_s, p.kind, p.prompt_tokens, p.max_tokens, p.index) for p in planned] == [
        (0.0, "short", 3000, 96, 0),
        (1.5, "long", 4000, 97, 1),
    ]
    assert planned[0].blocks == (0, 1, 2, 3, 4, 5) and planned[1].label == "line 2"
    assert [prompt_class(t) for t in (4096, 4097, 16384, 16385)] == ["le_4k", "4k_16k", "4k_16k", "gt_16k"]


def test_the_bound_counts_each_request_s_leading_blocks_seen_before(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        line(0, 1024, 1, [0, 1]),
        line(1, 1500, 1, [0, 1, 2]),  # both blocks seen: 1,024
        line(2, 1500, 1, [0, 9, 2]),  # block 9 unseen ends the run: 512
        line(3, 1300, 1, [0, 1, 2]),  # block 2 was seen with 476 tokens, more than its 276 here: 1,300
        line(4, 600, 1, [5, 6]),
        line(5, 1024, 1, [5, 6]),  # block 6 was seen with 88 tokens only: 512 + 88
    ]
    path.write_text("\n".join(rows))
    assert prefix_bound(read_trace(path)) == [0, 1024, 512, 1300, 0, 600]


@pytest.mark.parametrize("name", [TEKKEN, SENTENCEPIECE, None])
def test_each_block_id_is_512_tokens_of_its_own_text_and_prompts_count_exactly(name: str | None) -> None:
    tokenizer: SimTokenizer = ByteQuads() if name is None else load_tokenizer(TOKENIZER_DIR / name)
    blocks = PromptBlocks(tokenizer)
    assert blocks.block_text(42) == PromptBlocks(tokenizer).block_text(42), "the same id, the same text"
    assert blocks.block_text(42) != blocks.block_text(43)
    assert tokenizer.count(blocks.block_text(42)[1:]) == BLOCK_TOKENS
    for tokens in (1, 100, 511, 512, 513, 3000, 4096, 9000):
        ids = list(range(1000, 1000 + math.ceil(tokens / BLOCK_TOKENS)))
        assert tokenizer.count(blocks.prompt(ids, tokens)) == tokens, tokens
    # Prompts that share leading ids share leading bytes: the blocks do not depend on what follows.
    one, two = blocks.prompt([0, 5, 6], 1400), blocks.prompt([0, 5, 7, 8], 2000)
    shared = len(blocks.prompt([0, 5], 1024))
    assert one[:shared] == two[:shared] and one[shared] == two[shared] == " "
    with pytest.raises(ValueError, match="need 2 block ids"):
        blocks.prompt([0], 600)


@pytest.mark.parametrize("name", [TEKKEN, SENTENCEPIECE])
def test_the_gate_s_fast_band_holds_a_synthesised_prompt_s_true_count(name: str) -> None:
    """The words read as prose to the fast estimator, so near a threshold the gate counts exactly
    instead of settling on a band that misses the truth."""
    tokenizer = load_tokenizer(TOKENIZER_DIR / name)
    fast = FastEstimator(calibration.for_tokenizer(TokenizerFile.open(TOKENIZER_DIR / name)))
    blocks = PromptBlocks(tokenizer)
    for tokens in (3800, 4096, 12_000, 40_000):
        band = fast.estimate(blocks.prompt(list(range(math.ceil(tokens / BLOCK_TOKENS))), tokens))
        assert band.low <= tokens <= band.high, (tokens, band)


def test_a_trace_request_asks_for_its_prompt_and_exactly_its_output() -> None:
    scenario = load_scenario(builtin_scenario("trace"))
    assert scenario.tokenizer == TEKKEN
    planned = Planned(0.0, "long", 5000, 77, 0, blocks=tuple(range(10)))
    body = json.loads(request_body(scenario, planned))
    assert body["max_tokens"] == 77 and body["ignore_eos"] is True and body["stream"] is True
    [message] = body["messages"]
    tekken = load_tokenizer(tokenizer_file(TEKKEN))
    assert message["role"] == "user" and tekken.count(message["content"]) == 5000
    lazy = LazyBodies(scenario, [planned, planned])
    assert len(lazy) == 2 and lazy[1] == request_body(scenario, planned) and list(lazy[1:]) == [lazy[0]]
    assert prompt_blocks(TEKKEN) is prompt_blocks(TEKKEN)


def test_a_tokenizer_is_a_path_or_one_mistral_common_ships() -> None:
    assert tokenizer_file(TEKKEN) == TOKENIZER_DIR / TEKKEN
    assert tokenizer_file(str(TOKENIZER_DIR / SENTENCEPIECE)) == (TOKENIZER_DIR / SENTENCEPIECE).resolve()
    with pytest.raises(ConfigError, match="no such file"):
        tokenizer_file("no-such-tokenizer.json")


def test_the_trace_scenario_is_a_long_context_deployment_that_compresses_with_the_replay() -> None:
    scenario = load_scenario(builtin_scenario("trace"))
    node, layout = scenario.node, scenario.layout
    assert node.interactive_max_model_len == 4096 and node.max_model_len == 131_072
    assert node.kv_capacity_tokens >= node.max_model_len and node.on_exhaustion == "preempt"
    assert layout.baseline_nodes == layout.interactive_nodes + layout.long_nodes and layout.queue
    assert {"baseline", "peer_smg_cache_aware", "peer_smg_power_of_two", "kvgate_prefix_off",
            "kvgate_prefix_on"} <= set(scenario.runs)  # fmt: skip
    assert any(run.startswith("peer_vllm-router_") for run in scenario.runs)
    fast = compressed(scenario, 6.0).node
    assert (fast.prefill_tokens_per_s, fast.decode_tokens_per_s) == (240_000, 300)
    assert fast.kv_capacity_tokens == node.kv_capacity_tokens and fast.restart_s == node.restart_s / 6


def test_a_request_past_max_model_len_is_named_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([line(0, 1000, 10, [0, 1]), line(5, 8000, 300, list(range(16)))]))
    scenario = parse_scenario("node: {max_model_len: 8192, kv_capacity_tokens: 16384}\nbursts: null")
    problem = misfits(read_trace(path), scenario)
    assert problem is not None and problem.startswith("line 2 needs 8300 tokens")
    assert misfits(read_trace(path, Window(0, 0.001)), scenario) is None


def test_peer_runs_name_a_router_and_one_of_its_policies() -> None:
    assert peer_of("peer_smg_cache_aware") == ("smg", "cache_aware")
    assert peer_of("peer_vllm-router_kv_aware") == ("vllm-router", "kv_aware")
    for run in PEER_RUNS:
        router, policy = peer_of(run)
        assert policy in POLICIES[router] and limits(run)
    for bad in ("peer_smg_sideways", "baseline", "peer_nginx_round_robin"):
        with pytest.raises(ValueError, match="not a peer run"):
            peer_of(bad)


def result(kind: str, tokens: int, outcome: str, ttft: float | None, *, queued: bool = False) -> Result:
    planned = Planned(0.0, kind, tokens, 10, 0)  # type: ignore[arg-type]
    finished = None if ttft is None else ttft + 1.0
    return Result(planned, 0.0, outcome, 200, ttft, finished, 10 if ttft else 0, "n", "", queued)  # type: ignore[arg-type]


def test_a_run_s_figures_by_kind_and_class_with_the_routing_layer_s_cpu() -> None:
    results = [
        result("short", 1000, "ok", 0.05),
        result("short", 2000, "ok", 0.15),
        result("long", 8000, "ok", 0.5, queued=True),
        result("long", 30_000, "ok", 2.0),
        result("long", 30_000, "429", None),
        result("long", 40_000, "lost", None),
    ]
    node = NodeMetrics(0.1, 0, 0, 3, 0, 900, 1000, prefix_hit_tokens=5000, stalled_s=0.3)
    summary = summarize_trace_run(results, {"a": node, "b": None}, {"envoy": 0.3, "gate": 0.9}, speed=2.0)
    assert summary["requests_total"] == 6 and summary["requests_lost"] == 1 and summary["refused_429"] == 1
    assert summary["served"] == 4 and summary["queued"] == 1 and summary["preemptions"] == 3
    assert (summary["short_ttft_p50_ms"], summary["short_ttft_p99_ms"]) == (50.0, 150.0)
    assert summary["ttft_by_class"]["gt_16k"] == {"served": 1, "p50_ms": 2000.0, "p99_ms": 2000.0}
    assert summary["ttft_by_class"]["4k_16k"]["served"] == 1
    assert summary["kv_peak"] == 0.9 and summary["nodes_unreadable"] == ["b"]
    assert summary["routing_cpu_ms_per_request"] == 200.0
    # 0.3 s lost by the one readable node over the replay's 3 s.
    assert summary["nodes_stalled_pct"] == 10.0
    # Served tokens over the replay's span (3 s) in trace seconds (x2).
    assert summary["goodput_tokens_per_s"] == round((1000 + 2000 + 8000 + 30_000 + 40) / 6, 1)
    report = {"prefix_bound_tokens": 10_000, "runs": {"baseline": summary, "kvgate_prefix_on": summary}}
    table = format_trace_table(report)
    assert "kvgate_prefix_on" in table and "ttft gt_16k p99_ms" in table and "50%" in table
    assert markdown_trace_table(report).splitlines()[1] == "|---|---:|---:|"


def test_the_cpu_meter_reads_what_a_process_spent() -> None:
    meter = CpuMeter({"me": os.getpid()})
    meter.start()
    sum(i * i for i in range(2_000_000))
    assert meter.stop()["me"] > 0


def test_a_shipped_trace_is_found_by_name_and_is_the_one_the_readme_replays() -> None:
    path = trace_file("mooncake_conversation_first_half")
    assert path == trace_file("mooncake_conversation_first_half.jsonl")
    requests = read_trace(path)
    assert len(requests) == 5606 and requests[-1].at_s < 1768.5
    assert "Apache License" in (path.parent / "LICENSE-Apache-2.0").read_text()


def test_a_trace_that_is_neither_a_file_nor_shipped_names_the_shipped_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shipped: mooncake_conversation_first_half"):
        trace_file("no-such-trace")
    own = tmp_path / "mine.jsonl"
    assert trace_file(str(own)) == own, "a path is a path, read (and refused) as such"
