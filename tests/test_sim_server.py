"""The simulator over HTTP: OpenAI responses, SSE streaming, vLLM /metrics, preemption and crash."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate.localports import free_port
from kvgate.sim.engine import EngineConfig
from kvgate.sim.server import NODE_HEADER, SimServer
from kvgate.sim.tokens import make_prompt

FAST = {"decode_tokens_per_s": 1000.0, "prefill_tokens_per_s": 1_000_000.0}


@asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[str]:
    config = EngineConfig(**{**FAST, **settings})
    runner = web.AppRunner(SimServer(config, model_name="m", node_name="n1").app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def run(case: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(case(), timeout=20))


def chat(tokens: int, max_tokens: int, stream: bool = False, seed: int = 0, **extra: Any) -> dict[str, Any]:
    """A chat request of `tokens` prompt tokens; prompts of different seeds share no prefix block."""
    content = make_prompt(tokens, random.Random(f"{tokens}/{seed}"))
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_chat_completion_returns_text_and_usage() -> None:
    async def case() -> None:
        async with (
            serving(kv_capacity_tokens=4096, max_model_len=4096) as url,
            aiohttp.ClientSession() as s,
            s.post(f"{url}/v1/chat/completions", json=chat(100, 5)) as r,
        ):
            assert r.status == 200
            assert r.headers[NODE_HEADER] == "n1"
            body = await r.json()
        assert body["object"] == "chat.completion"
        assert body["usage"] == {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["message"]["content"].encode()) == 5 * 4

    run(case)


def test_streaming_chat_sends_role_tokens_usage_and_done() -> None:
    async def case() -> None:
        async with serving(kv_capacity_tokens=4096, max_model_len=4096) as url, aiohttp.ClientSession() as s:
            request = chat(50, 6, stream=True, stream_options={"include_usage": True})
            async with s.post(f"{url}/v1/chat/completions", json=request) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = sse_events(await r.text())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
        assert len(text) == 6 * 4
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"] == {"prompt_tokens": 50, "completion_tokens": 6, "total_tokens": 56}

    run(case)


def test_streaming_completions_and_models_and_health() -> None:
    async def case() -> None:
        async with serving(kv_capacity_tokens=4096, max_model_len=2048) as url, aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json={"prompt": "abcd" * 10, "stream": True}) as r:
                events = sse_events(await r.text())
            async with s.get(f"{url}/v1/models") as r:
                models = await r.json()
            async with s.get(f"{url}/health") as r:
                assert r.status == 200
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"text_completion"}
        assert len("".join(c["choices"][0]["text"] for c in chunks)) == 16 * 4
        assert models["data"][0]["id"] == "m"
        assert models["data"][0]["max_model_len"] == 2048

    run(case)


def test_context_overflow_and_unknown_model_are_refused_like_vllm() -> None:
    async def case() -> None:
        async with serving(kv_capacity_tokens=4096, max_model_len=1024) as url, aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/chat/completions", json=chat(1000, 25)) as r:
                assert r.status == 400
                error = (await r.json())["error"]
            assert error["code"] == 400
            assert (
                "you requested 1025 tokens (1000 in the messages, 25 in the completion)" in error["message"]
            )
            async with s.post(f"{url}/v1/chat/completions", json=chat(1000, 24)) as r:
                assert r.status == 200
            async with s.post(f"{url}/v1/chat/completions", json={**chat(10, 1), "model": "other"}) as r:
                assert r.status == 404
            async with s.post(f"{url}/v1/chat/completions", data=b"{nope") as r:
                assert r.status == 400

    run(case)


def test_metrics_page_has_vllm_names_and_labels() -> None:
    async def case() -> None:
        async with serving(kv_capacity_tokens=4096, max_model_len=4096) as url, aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/chat/completions", json=chat(100, 3)):
                pass
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
        assert 'vllm:cache_config_info{block_size="16",' in text
        assert 'num_gpu_blocks="256"' in text
        assert '\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0\n' in text
        # As prometheus_client renders a counter: the `_total` family and its `_created` timestamp.
        assert "# TYPE vllm:num_preemptions_total counter" in text
        assert metric(text, "vllm:num_preemptions_created") > 1.7e9
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:num_requests_waiting") == 0
        assert metric(text, "vllm:prompt_tokens_total") == 100
        assert metric(text, "vllm:generation_tokens_total") == 3
        assert metric(text, "kvgate_sim_oom_crashes_total") == 0
        assert metric(text, "kvgate_sim_peak_kv_tokens") == 112  # 102 tokens computed at most: 7 blocks

    run(case)


async def stream_outcome(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    try:
        async with s.post(f"{url}/v1/chat/completions", json=body) as r:
            text = await r.text()
            return "ok" if text.endswith("data: [DONE]\n\n") else "truncated"
    except aiohttp.ClientError:
        return "failed"


def test_preempt_mode_finishes_every_request_and_counts_preemptions() -> None:
    async def case() -> None:
        settings = {"kv_capacity_tokens": 1024, "max_model_len": 1024, "on_exhaustion": "preempt"}
        async with serving(**settings) as url, aiohttp.ClientSession() as s:
            outcomes = await asyncio.gather(
                *(stream_outcome(s, url, chat(300, 200, True, i)) for i in range(3))
            )
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
        assert outcomes == ["ok", "ok", "ok"]
        assert metric(text, "vllm:num_preemptions_total") >= 1
        assert metric(text, "kvgate_sim_oom_crashes_total") == 0

    run(case)


def test_crash_fails_in_flight_streams_and_cuts_connections_until_restart() -> None:
    async def case() -> None:
        settings = {
            "kv_capacity_tokens": 1024,
            "max_model_len": 1024,
            "on_exhaustion": "crash",
            "restart_s": 0.5,
        }
        async with serving(**settings) as url, aiohttp.ClientSession() as s:
            outcomes = await asyncio.gather(
                *(stream_outcome(s, url, chat(300, 200, True, i)) for i in range(3))
            )
            assert set(outcomes) <= {"truncated", "failed"}
            for path in ("/health", "/metrics"):
                with pytest.raises(aiohttp.ClientError):
                    async with s.get(f"{url}{path}"):
                        pass
            await asyncio.sleep(0.6)
            assert await stream_outcome(s, url, chat(300, 5, True)) == "ok"
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
        assert metric(text, "kvgate_sim_oom_crashes_total") == 1
        assert metric(text, "kvgate_sim_peak_kv_tokens") > 1024

    run(case)


@pytest.mark.slow
def test_cli_serves_until_sigterm() -> None:
    port = free_port()
    args = ["--listen", f"127.0.0.1:{port}", "--kv-capacity-tokens", "4096", "--max-model-len", "4096"]
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.sim", *args], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "kvgate sim did not start listening"
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
