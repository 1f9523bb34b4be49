"""The simulator over HTTP: OpenAI responses, SSE streaming, vLLM /metrics, preemption and crash, what it
answers about itself and its tokens as vLLM or SGLang, and its KV events over ZMQ."""

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
import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from conftest import TOKENIZER_DIR

from kvgate.localports import free_port
from kvgate.sim.engine import EngineConfig
from kvgate.sim.layout import Layout
from kvgate.sim.server import NODE_HEADER, SimServer
from kvgate.sim.tokens import ByteQuads, SimTokenizer, load_tokenizer, make_prompt

FAST = {"decode_tokens_per_s": 1000.0, "prefill_tokens_per_s": 1_000_000.0}


@asynccontextmanager
async def serving(
    *,
    layout: Layout | None = None,
    kv_events_endpoint: str | None = None,
    stream_interval: int = 1,
    tokenizer: SimTokenizer | None = None,
    **settings: Any,
) -> AsyncIterator[str]:
    config = EngineConfig(**{**FAST, **settings})
    server = SimServer(
        config,
        model_name="m",
        node_name="n1",
        layout=layout,
        kv_events_endpoint=kv_events_endpoint,
        stream_interval=stream_interval,
        tokenizer=tokenizer,
    )
    runner = web.AppRunner(server.app(), access_log=None)
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


def test_a_stream_interval_sends_the_first_token_at_once_then_coarser_chunks() -> None:
    async def case() -> None:
        async with (
            serving(kv_capacity_tokens=4096, max_model_len=4096, stream_interval=4) as url,
            aiohttp.ClientSession() as s,
        ):
            request = chat(50, 10, stream=True, stream_options={"include_usage": True})
            async with s.post(f"{url}/v1/chat/completions", json=request) as r:
                events = sse_events(await r.text())
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]]
        # Tokens 1, 4, 8 and 10 end a chunk (a slow reader may get two of them as one, never more).
        assert len(texts[0]) == 4 and 2 <= len(texts) <= 4
        assert len("".join(texts)) == 10 * 4
        assert chunks[-1]["usage"]["completion_tokens"] == 10

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


def test_with_a_tokenizer_file_a_shared_prefix_of_uneven_words_is_found_in_the_cache() -> None:
    """Words of every length: tokens are not equal shares of the bytes, and the cache keys blocks by
    their ids, so a longer prompt that begins as an earlier one finds its full blocks."""
    tekken = load_tokenizer(TOKENIZER_DIR / "tekken_240911.json")
    rng = random.Random(7)
    words = [" people", " a", " government", " of", " through", " is", " information", " and"]
    head = "".join(rng.choices(words, k=200))
    tail = "".join(rng.choices(words, k=150))

    async def case() -> None:
        async with (
            serving(kv_capacity_tokens=8192, max_model_len=4096, tokenizer=tekken) as url,
            aiohttp.ClientSession() as s,
        ):
            for content in (head, head + tail):
                body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
                async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
        assert metric(text, "vllm:prefix_cache_hits_total") == tekken.count(head) // 16 * 16

    run(case)


def test_engine_time_the_host_loses_is_counted_as_stalled() -> None:
    """A host that runs the engine's steps late (here: the event loop blocked for 0.3 s) makes the node
    slower than its rates; the page says by how much."""

    async def case() -> None:
        async with (
            serving(kv_capacity_tokens=4096, max_model_len=4096, decode_tokens_per_s=100) as url,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(f"{url}/v1/chat/completions", json=chat(50, 60, stream=True)) as r:
                await r.content.readline()
                time.sleep(0.3)  # blocks the loop the node runs on, as a busy CPU would
                await r.read()
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
        assert metric(text, "kvgate_sim_stalled_seconds_total") >= 0.25

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


async def get_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        assert r.status == 200, f"{url}: {r.status}"
        return await r.json()


async def post_json(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


def test_as_vllm_it_answers_vllm_s_identity_endpoints() -> None:
    async def case() -> None:
        async with serving(kv_capacity_tokens=4096, max_model_len=2048) as url, aiohttp.ClientSession() as s:
            assert await get_json(s, f"{url}/version") == {"version": "0.33.0"}
            card = (await get_json(s, f"{url}/v1/models"))["data"][0]
            info = await get_json(s, f"{url}/server_info?config_format=json")
            identity = await get_json(s, f"{url}/get_server_info")
            sources = await get_json(s, f"{url}/kv_event_sources")
            async with s.get(f"{url}/get_load") as r:
                assert r.status == 404, "vLLM has no /get_load"
        assert (card["owned_by"], card["root"], card["max_model_len"]) == ("vllm", "m", 2048)
        assert info["vllm_config"]["cache_config"]["block_size"] == 16
        assert info["vllm_config"]["model_config"]["max_model_len"] == 2048
        assert identity == {
            "model_id": "m",
            "model_path": "m",
            "instance_id": "n1",
            "kv_block_size": 16,
            "data_parallel_size": 1,
        }
        assert sources == {}, "no KV events unless an endpoint is given"

    run(case)


def test_tokenize_and_render_count_what_the_chat_is_charged() -> None:
    async def case() -> None:
        messages = [
            {"role": "system", "content": make_prompt(37, random.Random(1))},
            {"role": "user", "content": "what is it?"},
        ]
        async with serving(kv_capacity_tokens=4096, max_model_len=2048) as url, aiohttp.ClientSession() as s:
            status, tokens = await post_json(s, f"{url}/tokenize", {"model": "m", "messages": messages})
            assert status == 200
            chat_body = {"model": "m", "messages": messages, "max_tokens": 4}
            status, rendered = await post_json(s, f"{url}/v1/chat/completions/render", chat_body)
            assert status == 200
            status, answer = await post_json(s, f"{url}/v1/chat/completions", chat_body)
            assert status == 200
            status, listed = await post_json(
                s, f"{url}/v1/completions/render", {"model": "m", "prompt": "abcdefgh", "max_tokens": 2}
            )
            assert status == 200
            status, refused = await post_json(
                s, f"{url}/v1/chat/completions/render", {**chat_body, "max_tokens": 2040}
            )
            assert status == 400
        assert tokens["count"] == len(tokens["tokens"]) == answer["usage"]["prompt_tokens"] == 37 + 3
        assert tokens["max_model_len"] == 2048
        assert rendered["token_ids"] == tokens["tokens"]
        assert rendered["sampling_params"]["max_tokens"] == 4
        assert [item["token_ids"] for item in listed] == [ByteQuads().ids("abcdefgh")]
        assert "maximum context length is 2048 tokens" in refused["error"]["message"]

    run(case)


def test_ignore_eos_gives_exactly_max_tokens_and_without_a_budget_runs_to_the_model_len() -> None:
    async def case() -> None:
        async with serving(kv_capacity_tokens=4096, max_model_len=256) as url, aiohttp.ClientSession() as s:
            status, budget = await post_json(s, f"{url}/v1/chat/completions", chat(50, 9, ignore_eos=True))
            assert status == 200
            request = chat(200, 1, ignore_eos=True)
            del request["max_tokens"]
            status, unbounded = await post_json(s, f"{url}/v1/chat/completions", request)
            assert status == 200
            status, refused = await post_json(s, f"{url}/v1/chat/completions", chat(50, 9, ignore_eos="yes"))
            assert status == 400
        assert budget["usage"]["completion_tokens"] == 9
        assert budget["choices"][0]["finish_reason"] == "length"
        assert unbounded["usage"] == {"prompt_tokens": 200, "completion_tokens": 56, "total_tokens": 256}
        assert unbounded["choices"][0]["finish_reason"] == "length"
        assert "ignore_eos" in refused["error"]["message"]

    run(case)


def test_as_sglang_it_answers_sglang_s_identity_and_load_endpoints() -> None:
    async def case() -> None:
        layout = Layout(engine="sglang", data_parallel=2)
        async with (
            serving(layout=layout, kv_capacity_tokens=4096, max_model_len=2048) as url,
            aiohttp.ClientSession() as s,
        ):
            card = (await get_json(s, f"{url}/v1/models"))["data"][0]
            info = await get_json(s, f"{url}/get_server_info")
            assert await get_json(s, f"{url}/server_info") == info
            model = await get_json(s, f"{url}/get_model_info")
            idle = await get_json(s, f"{url}/get_load")
            for path in ("/version", "/kv_event_sources"):
                async with s.get(f"{url}{path}") as r:
                    assert r.status == 404, f"SGLang has no {path}"
            async with s.post(f"{url}/v1/chat/completions", json=chat(100, 400, stream=True)) as r:
                await r.content.readline()  # the first token: the request is running
                busy = await get_json(s, f"{url}/get_load")
        assert card["owned_by"] == "sglang"
        assert (info["model_path"], info["dp_size"], info["page_size"]) == ("m", 2, 16)
        assert info["max_total_num_tokens"] == 4096
        assert info["version"] == "0.5.23"
        assert len(info["internal_states"]) == 2
        assert model == {"model_path": "m", "tokenizer_path": "m", "is_generation": True}
        assert idle == [
            {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0},
            {"dp_rank": 1, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0},
        ]
        assert sum(rank["num_reqs"] for rank in busy) == 1
        assert sum(rank["num_tokens"] for rank in busy) >= 100

    run(case)


async def next_batch(sub: zmq.asyncio.Socket) -> tuple[list[bytes], Any]:
    assert await sub.poll(5000), "no KV-event batch within 5 s"
    frames = await sub.recv_multipart()
    return frames, msgpack.unpackb(frames[2])


def test_kv_events_reach_a_subscriber_with_the_ids_tokenize_gives() -> None:
    async def case() -> None:
        settings = {"kv_capacity_tokens": 4096, "max_model_len": 2048}
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            async with (
                serving(kv_events_endpoint="tcp://127.0.0.1:0", **settings) as url,
                aiohttp.ClientSession() as s,
            ):
                sources = await get_json(s, f"{url}/kv_event_sources")
                assert list(sources) == ["0"] and sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
                sub.connect(sources["0"]["endpoint"])
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                # A subscription takes effect a moment after connecting: batches before it are lost, as
                # with vLLM. Send distinct prompts until one arrives.
                for attempt in range(50):
                    await post_json(s, f"{url}/v1/chat/completions", chat(40, 1, seed=attempt))
                    if await sub.poll(100):
                        break
                while await sub.poll(100):
                    await sub.recv_multipart()
                body = chat(40, 1, seed=999)
                status, tokens = await post_json(s, f"{url}/tokenize", {"messages": body["messages"]})
                assert status == 200
                await post_json(s, f"{url}/v1/chat/completions", body)
                frames, batch = await next_batch(sub)
        finally:
            sub.close()
            context.term()
        topic, sequence, _ = frames
        assert topic == b""
        assert int.from_bytes(sequence, "big") >= 1
        ts, events, rank = batch
        assert rank == 0 and ts > 1.7e9
        assert events == [
            {
                "type": "BlockStored",
                "block_hashes": events[0]["block_hashes"],
                "parent_block_hash": None,
                "token_ids": tokens["tokens"][:32],
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ]
        assert len(events[0]["block_hashes"]) == 2

    run(case)
