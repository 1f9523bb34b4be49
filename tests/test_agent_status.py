"""`kvgate status`: what an agent sees, rendered for operators (text) and for tests (JSON)."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvgate.agent.cli import register
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.server import Agent
from kvgate.agent.sources.fake_engine import FakeEngineMetrics
from kvgate.agent.sources.scrape import EngineScraper
from kvgate.agent.status import status_json, status_text
from kvgate.localports import free_port


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["status", *argv])


@contextmanager
def live_agent(settings: NodeSettings, engine: FakeEngineMetrics | None) -> Iterator[str]:
    """An agent (and its fake engine) on an event loop of its own thread; yields its address."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    address: list[str] = []
    agent_box: list[Agent] = []

    async def start() -> None:
        scraper = EngineScraper(await engine.start(), 0.05) if engine else None
        agent = Agent(settings, scraper)
        address.append(f"127.0.0.1:{await agent.start('127.0.0.1:0')}")
        agent_box.append(agent)
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    started.wait(10)
    try:
        yield address[0]
    finally:

        async def stop() -> None:
            await agent_box[0].stop(grace_s=0.1)
            if engine:
                await engine.stop()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_status_reads_a_live_agent_as_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    engine = FakeEngineMetrics(flavor="sglang", kv_usage=0.25, running=3, waiting=1)
    with live_agent(NodeSettings("gpu-7", "10.0.0.7:8000", period_s=0.05), engine) as address:
        args = parse("--agent", address)
        assert args.func(args) == 0
        text = capsys.readouterr().out
        args = parse("--agent", address, "--json")
        assert args.func(args) == 0
        seen = json.loads(capsys.readouterr().out)
    assert f"agent     {address}  node gpu-7  endpoint 10.0.0.7:8000\nhealth    healthy\n" in text
    assert "engine    sglang: one scheduler\n" in text
    assert (
        "capacity  40,000 tokens from engine, sglang:max_total_num_tokens 40000; x 0.9 safety = 36,000"
        in text
    )
    assert "used      10,000 tokens, from engine, 25.0% of capacity\n" in text
    assert "requests  3 running, 1 waiting, unknown preempted since start\n" in text
    assert (seen["engine"]["kind"], seen["engine"]["engines"]) == ("sglang", ["one scheduler"])
    assert (seen["capacity"]["tokens"], seen["capacity"]["source"], seen["used"]["tokens"]) == (
        40_000,
        "engine",
        10_000,
    )
    assert seen["healthy"] and seen["headroom_tokens"] == 26_000 and 0 <= seen["age_s"] < 1


def test_status_exit_status_follows_health(capsys: pytest.CaptureFixture[str]) -> None:
    engine = FakeEngineMetrics(body="# TYPE tgi_queue_size gauge\ntgi_queue_size 0\n")
    with live_agent(NodeSettings("n", "e:1", period_s=0.05), engine) as address:
        args = parse("--agent", address, "--json")
        assert args.func(args) == 1
    seen = json.loads(capsys.readouterr().out)
    assert not seen["healthy"] and seen["engine"]["kind"] == "tgi"
    assert seen["reason"].startswith("tgi publishes no KV-cache figures: no KV gauge to read")


def test_an_unreachable_agent_is_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--agent", f"127.0.0.1:{free_port()}", "--timeout-s", "0.5")
    assert args.func(args) == 2
    assert capsys.readouterr().err.startswith("kvgate status: agent 127.0.0.1:")


def test_a_reservation_only_node_says_so() -> None:
    state = NodeState(
        NodeSettings("n", "e:1", capacity_tokens=40_000, safety_ratio=1.0), lambda: 0.0, False, False
    )
    state.reserve("r", 12_000, 0)
    snapshot = state.snapshot(0)
    text = status_text(snapshot, "a:1", 0.01)
    assert "engine    none (no --engine-metrics)\n" in text
    assert "capacity  40,000 tokens from manual, --capacity-tokens; x 1 safety = 40,000 admissible\n" in text
    assert "used      12,000 tokens, from reservations, 30.0% of capacity\n" in text
    assert "health    healthy: reservation-only: no engine metrics;" in text
    seen = status_json(snapshot, "a:1", 0.01)
    assert (seen["used"]["source"], seen["reserved"]) == (
        "reservations",
        {"tokens": 12_000, "reservations": 1},
    )


def test_status_names_vllm_s_null_block_and_where_prefixes_come_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine = FakeEngineMetrics(kv_usage=0.5)
    with live_agent(NodeSettings("n", "e:1", period_s=0.05, safety_ratio=1.0), engine) as address:
        args = parse("--agent", address)
        assert args.func(args) == 0
        text = capsys.readouterr().out
        args = parse("--agent", address, "--json")
        assert args.func(args) == 0
        seen = json.loads(capsys.readouterr().out)
    assert (
        "capacity  40,000 tokens from engine, num_gpu_blocks 2501 x block_size 16: 2500 of 2501 blocks "
        "(one is vLLM's null block) x 1 engine; x 1 safety = 40,000 admissible\n"
    ) in text
    assert "used      20,000 tokens, from engine, 50.0% of capacity\n" in text
    assert "prefixes  0 tokens indexed, 0 shared; guessed from reservations" in text
    assert seen["prefix"]["source"].startswith("guessed from reservations")
    assert seen["forecast"] == {"decode_tokens_per_s": None, "releases": [], "freed_tokens_total": 0}
