"""A short trace replayed end to end through real processes: Envoy round-robin, kvgate with prefix
placement off and on (Envoy, gate, agents, queue), and each peer router the trace scenario compares,
all on fresh simulated nodes that count with the trace scenario's tokenizer.

Bounded by the demo's own limits (start-up waits, request timeouts, the drain deadline); nothing here
sleeps or times the replay. Without `.venv-peers` the peer test skips, saying why (`make peers`).
"""

from __future__ import annotations

import asyncio
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvgate.demo.cli import DEMO_ENVOY
from kvgate.demo.peers import limits, unavailable
from kvgate.demo.replay import run_trace_demo
from kvgate.demo.scenario import RunName, builtin_scenario, load_scenario, parse_scenario
from kvgate.demo.trace import Window, prefix_bound, read_trace

pytestmark = pytest.mark.slow

# The kvgate runs' Envoy as `kvgate demo` runs it (one ext_proc round trip).
REPO_ENVOY = Path(__file__).resolve().parent.parent / "envoy" / DEMO_ENVOY
SPEED = 2.0

# Small nodes and a short trace: an interactive limit of 2,048, long prompts up to 6k tokens.
SCENARIO = """
name: trace-e2e
tokenizer: tekken_240911.json
node: {kv_capacity_tokens: 32768, max_model_len: 16384, interactive_max_model_len: 2048,
       prefill_tokens_per_s: 20000, decode_tokens_per_s: 100, on_exhaustion: preempt, restart_s: 1,
       stream_interval: 4}
layout: {baseline_nodes: 2, interactive_nodes: 1, long_nodes: 1, queue: true}
short: {prompt_tokens_min: 100, prompt_tokens_max: 200, max_tokens: 16}
bursts: null
timing: {drain_s: 60, request_timeout_s: 60, connect_timeout_s: 5, max_in_flight: 64}
"""


def write_trace(path: Path) -> None:
    """Conversations over a shared system prompt (block 0): each turn resends the history and adds
    to it, as the conversation trace does; 36 requests in 6 trace seconds, short and long."""
    rng = random.Random(5)
    next_id = 1
    lines = []
    for session in range(6):
        history = [0]
        tokens = 512
        for turn in range(6):
            tokens += rng.randint(100, 900)
            while len(history) * 512 < tokens:
                history.append(next_id)
                next_id += 1
            at_ms = session * 150 + turn * 1000 + rng.randint(0, 100)
            row = {"timestamp": at_ms, "input_length": tokens, "output_length": rng.randint(4, 40),
                   "hash_ids": list(history)}  # fmt: skip
            lines.append((at_ms, json.dumps(row)))
    path.write_text("\n".join(text for _, text in sorted(lines)) + "\n")


def replay(tmp_path: Path, runs: tuple[RunName, ...]) -> dict[str, Any]:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    requests = read_trace(trace)
    report = asyncio.run(
        run_trace_demo(
            parse_scenario(SCENARIO),
            trace,
            requests,
            window=Window(),
            speed=SPEED,
            out_dir=tmp_path / "out",
            envoy_config=REPO_ENVOY,
            runs=runs,
            stream=io.StringIO(),
        )
    )
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report
    assert (tmp_path / "out" / "report.png").stat().st_size > 10_000
    assert report["requests"] == len(requests) == 36 and report["speed"] == SPEED
    assert report["prefix_bound_tokens"] == sum(prefix_bound(requests)) > 0
    for name, run in report["runs"].items():
        lines = (tmp_path / "out" / f"requests-{name}.jsonl").read_text().splitlines()
        assert len(lines) == run["requests_total"] == 36, name
        # The trace is real traffic: every request is served, none refused or lost.
        assert run["served"] == 36 and run["requests_lost"] == run["other_errors"] == 0, (name, run)
        assert run["oom_crashes"] == 0 and run["routing_cpu_ms_per_request"] > 0
        assert run["nodes_stalled_pct"] is not None and run["nodes_cpu_ms_per_request"] > 0
        assert set(run["ttft_by_class"]) == {"le_4k", "4k_16k", "gt_16k"}
    return report


def test_a_trace_replays_through_envoy_and_kvgate_with_prefix_placement_off_and_on(tmp_path: Path) -> None:
    report = replay(tmp_path, ("baseline", "kvgate_prefix_off", "kvgate_prefix_on"))
    runs = report["runs"]
    assert set(runs["baseline"]["routing_cpu_s"]) == {"envoy"}
    assert set(runs["kvgate_prefix_on"]["routing_cpu_s"]) == {"envoy", "gate", "agent-long-0", "queue"}
    # The CPU split by process into what the stack spends idle and what the requests cost.
    split = runs["kvgate_prefix_on"]["routing_cpu_split"]
    assert set(split) == set(runs["kvgate_prefix_on"]["routing_cpu_s"])
    assert split["agent-long-0"]["fixed_ms_per_s"] > 0 and split["gate"]["variable_ms_per_request"] > 0
    for name in ("kvgate_prefix_off", "kvgate_prefix_on"):
        # Each conversation resends its history: the long node finds it in its prefix cache.
        assert 0 < runs[name]["prefix_hit_tokens"] <= report["prefix_bound_tokens"]
        assert runs[name]["preemptions"] == 0
    assert report["not_run"] == {}


def test_the_trace_scenario_s_peer_routers_replay_the_same_trace(tmp_path: Path) -> None:
    peers = tuple(run for run in load_scenario(builtin_scenario("trace")).runs if run.startswith("peer_"))
    missing = {reason for run in peers if (reason := unavailable(run)) is not None}
    if missing:
        pytest.skip("; ".join(sorted(missing)))
    report = replay(tmp_path, peers)
    assert list(report["runs"]) == list(peers)
    for name, run in report["runs"].items():
        assert set(run["routing_cpu_s"]) == {"router"}
        assert run["cannot"] == limits(name)
        assert run["prefix_hit_tokens"] > 0


def write_steady_trace(path: Path) -> None:
    """A request every half second for 30 trace seconds: chats, and every fourth a long prompt that
    generates for about 4 s (one long node takes four at a time), so a gate killed at 5 s holds
    reservations."""
    rows = []
    for i in range(60):
        long = i % 4 == 3
        tokens = 5000 if long else 1000
        blocks = [100 * i + b for b in range(-(-tokens // 512))]
        row = {"timestamp": i * 500, "input_length": tokens, "output_length": 400 if long else 20,
               "hash_ids": blocks}  # fmt: skip
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")


def test_a_gate_killed_mid_replay_is_restarted_and_its_kv_comes_back_on_its_lease(tmp_path: Path) -> None:
    trace = tmp_path / "steady.jsonl"
    write_steady_trace(trace)
    report = asyncio.run(
        run_trace_demo(
            parse_scenario(SCENARIO),
            trace,
            read_trace(trace),
            window=Window(),
            speed=1.0,
            out_dir=tmp_path / "out",
            envoy_config=REPO_ENVOY,
            runs=("kvgate_prefix_off",),
            stream=io.StringIO(),
            faults="gate:5s",
        )
    )
    (gate,) = report["runs"]["kvgate_prefix_off"]["faults"]
    assert (gate["target"], gate["signal"]) == ("gate", "KILL")
    assert gate["held_tokens"] > 0, "the killed gate held long requests' reservations"
    assert gate["held_tokens_back_s"] is not None, "the agents freed them once its leases ran out"
    assert gate["lost_not_in_flight"] == 0 and gate["long_to_interactive"] == 0, gate
