"""The demo's load generator against an in-process simulated node, and the report it feeds."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from kvgate.demo.load import LoadGenerator, Result, classify_response
from kvgate.demo.report import format_table, percentile, summarize_run
from kvgate.demo.scenario import Planned, parse_scenario
from kvgate.demo.scrape import NodeMetrics, parse_sim_metrics
from kvgate.sim.engine import EngineConfig, EngineStats
from kvgate.sim.metrics import render_metrics
from kvgate.sim.server import SimServer

SCENARIO = parse_scenario(
    "model: m\ntiming: {drain_s: 5, request_timeout_s: 5, connect_timeout_s: 1, max_in_flight: 8}"
)


async def replay(plan: list[Planned], **engine: object) -> list[Result]:
    config = EngineConfig(**{"decode_tokens_per_s": 1000.0, "prefill_tokens_per_s": 1e6, **engine})  # type: ignore[arg-type]
    runner = web.AppRunner(SimServer(config, model_name="m", node_name="n").app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
        load = LoadGenerator(url, SCENARIO, async_nodes=frozenset({"async-node"}))
        return await load.run(plan, load.prepare(plan), time.monotonic())
    finally:
        await runner.cleanup()


def test_served_requests_are_ok_with_ttft_and_token_counts() -> None:
    plan = [Planned(0.0, "short", 100, 5, 0), Planned(0.05, "long", 900, 20, 1)]
    results = asyncio.run(replay(plan, kv_capacity_tokens=4096, max_model_len=4096))
    assert [r.outcome for r in results] == ["ok", "ok"]
    assert [r.completion_tokens for r in results] == [5, 20]
    assert all(
        r.ttft_s is not None and r.finished_s is not None and r.ttft_s <= r.finished_s for r in results
    )
    assert results[1].sent_s >= 0.05
    assert results[0].node == "n"


def test_a_crash_loses_in_flight_requests_and_a_node_400_is_other() -> None:
    plan = [Planned(0.0, "long", 1000, 90, i) for i in range(3)] + [Planned(0.0, "short", 1000, 200, 3)]
    results = asyncio.run(
        replay(plan, kv_capacity_tokens=2048, max_model_len=1100, on_exhaustion="crash", restart_s=0.3)
    )
    assert results[3].outcome == "other"  # 1000 + 200 > max-model-len: the node's own 400
    assert {r.outcome for r in results[:3]} == {"lost"}
    assert {r.node for r in results[:3]} == {"n"}  # the stream had started: the node is known


def test_only_explained_refusals_count_as_refusals() -> None:
    error = json.dumps({"error": {"message": "too long", "code": "context_length_exceeded"}}).encode()
    assert classify_response(413, error) == "413"
    assert classify_response(429, error) == "429"
    assert classify_response(503, error) == "503"
    assert classify_response(400, error) == "other"
    assert classify_response(503, b"upstream connect error or disconnect/reset before headers") == "lost"
    assert classify_response(503, b"[1, 2]") == "lost"
    assert classify_response(429, b"local_rate_limited") == "429"  # Envoy's rate limit: a refusal


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 99) == 5.0


def sim_metrics(preemptions: int, crashes: int, peak: int) -> NodeMetrics:
    stats = EngineStats(
        running=0, waiting=0, used_blocks=0, total_blocks=64, block_size=16, preemptions_total=preemptions,
        oom_crashes_total=crashes, peak_kv_tokens=peak, prompt_tokens_total=0, generation_tokens_total=0,
        finished_total=0, down=False,
    )  # fmt: skip
    return parse_sim_metrics(
        render_metrics(EngineConfig(kv_capacity_tokens=1024, max_model_len=1024), stats, "m")
    )


def test_summary_counts_outcomes_ttft_goodput_and_node_counters() -> None:
    def result(index: int, kind: str, outcome: str, sent: float, times: tuple[float, float] | None) -> Result:
        planned = Planned(sent, kind, 1000 if kind == "long" else 100, 10, index)  # type: ignore[arg-type]
        ttft, done = times or (None, None)
        return Result(planned, sent, outcome, 200, ttft, done, 10 if done else 0)  # type: ignore[arg-type]

    burst = [
        result(0, "short", "ok", 0.0, (0.010, 0.1)),
        result(1, "short", "ok", 0.5, (0.030, 0.6)),
        result(2, "short", "lost", 1.0, None),
        result(3, "long", "ok", 1.0, (0.5, 3.0)),
        result(4, "long", "429", 1.1, None),
    ]
    no_burst = [result(0, "short", "ok", 0.0, (0.020, 0.1))]
    nodes = {"a": sim_metrics(2, 1, 1280), "b": None}
    summary = summarize_run(burst, no_burst, nodes, {"a": "shared", "b": "shared"}, 500.0)
    assert summary["requests_total"] == 5
    assert summary["requests_lost"] == 1
    assert summary["outcomes"] == {"ok": 3, "413": 0, "429": 1, "503": 0, "async": 0, "other": 0}
    assert (summary["oom_crashes"], summary["preemptions"]) == (1, 2)
    assert (summary["short_ttft_p50_ms"], summary["short_ttft_p99_ms"]) == (10.0, 30.0)
    assert summary["short_ttft_p99_ms_no_burst"] == 20.0
    assert summary["peak_kv_fraction"] == {"a": 1.25, "b": None}
    # 1,010 tokens of the one served long request, from the first long sent (1.0 s) to its end (4.0 s).
    assert summary["long_goodput_tokens_per_s"] == round(1010 / 3.0, 1)
    table = format_table({"baseline": summary, "kvgate": summary})
    assert "oom_crashes" in table.splitlines()[2]
    assert "1.2" in next(line for line in table.splitlines() if line.startswith("peak_kv_fraction"))
