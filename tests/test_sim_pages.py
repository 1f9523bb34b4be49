"""The simulator speaks like the engines: its pages, read by the agent's readers, and its parallelism."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from texts import text_with_tokens

from kvgate.agent.sources.engines import EngineKind, PageState, read_engine_page
from kvgate.errors import ConfigError
from kvgate.sim.api import parse_request
from kvgate.sim.engine import Engine, EngineConfig
from kvgate.sim.layout import Layout
from kvgate.sim.metrics import SglangPage, VllmPage
from kvgate.sim.server import SimServer
from kvgate.sim.sglang_page import SglangCadence
from kvgate.sim.tokens import count_text_tokens, load_tokenizer, make_prompt

FAST = {"decode_tokens_per_s": 1000.0, "prefill_tokens_per_s": 1_000_000.0}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def serving(layout: Layout, **settings: Any) -> AsyncIterator[tuple[str, SimServer]]:
    config = EngineConfig(**{**FAST, **settings})
    server = SimServer(config, model_name="m", node_name="n1", layout=layout)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", server
    finally:
        await runner.cleanup()


def run(case: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(case(), timeout=20))


def chat(tokens: int, max_tokens: int) -> dict[str, Any]:
    content = make_prompt(tokens, random.Random(tokens))
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def test_data_parallel_vllm_spreads_requests_and_reads_as_two_engines() -> None:
    async def case() -> None:
        layout = Layout("vllm", data_parallel=2)
        async with serving(layout, kv_capacity_tokens=4096, max_model_len=4096) as (url, server):
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(
                    *(s.post(f"{url}/v1/chat/completions", json=chat(300, 5)) for _ in range(4))
                )
                async with s.get(f"{url}/metrics") as r:
                    text = await r.text()
            assert [e.stats().finished_total for e in server.engines] == [2, 2]
        assert text.count("vllm:cache_config_info{") == 2
        assert 'num_gpu_blocks="512"' in text and 'kv_cache_size_tokens="4096"' in text
        reading = read_engine_page(text)
        # The reader takes each engine's null block out (vLLM's BlockPool keeps one): 2 x 255 x 16.
        assert (reading.kind, reading.capacity_tokens, reading.engines) == (
            EngineKind.VLLM,
            8160,
            ("engine 0", "engine 1"),
        )

    run(case)


def test_sglang_page_is_a_multiprocess_page_written_on_sglangs_cadence() -> None:
    clock = Clock()
    config = EngineConfig(kv_capacity_tokens=4096, max_model_len=4096, block_size=1)
    page = SglangPage(config, Layout("sglang", tensor_parallel=4), "m", clock)
    engine = Engine(config, clock)
    fresh = page.render([engine.stats()])
    assert fresh.count("sglang:max_total_num_tokens{") == 4 and "sglang:num_used_tokens" not in fresh
    assert "_created" not in fresh and "process_" not in fresh
    assert read_engine_page(fresh).state is PageState.IDLE
    engine.add("a", 100, 50)
    step = engine.schedule()
    engine.complete(step)
    page.stepped(0, step, engine.stats())
    after_prefill = read_engine_page(page.render([engine.stats()]))
    assert (after_prefill.used_tokens, after_prefill.running) == (100, 1)

    def decode() -> None:
        step = engine.schedule()
        engine.complete(step)
        assert step.prefill_tokens == 0
        page.stepped(0, step, engine.stats())

    for _ in range(39):  # decode batches 1..39: nothing written
        decode()
    assert read_engine_page(page.render([engine.stats()])).used_tokens == 100
    decode()  # the 40th
    written = read_engine_page(page.render([engine.stats()]))
    assert written.used_tokens == engine.stats().used_blocks == 140
    assert page.render([engine.stats()]).count("sglang:num_used_tokens{") == 1  # tp_rank 0 only


def test_sglang_cadence_prefill_decode_interval_and_idle() -> None:
    cadence = SglangCadence(last_write=0.0)
    assert cadence.after_batch(prefill_tokens=10, now=1.0)
    assert [cadence.after_batch(0, 2.0) for _ in range(40)] == [False] * 39 + [True]
    assert not cadence.while_idle(31.0)
    assert cadence.while_idle(32.1) and cadence.last_write == 32.1


def test_a_fresh_sglang_writes_its_idle_figures_after_30_s() -> None:
    clock = Clock()
    config = EngineConfig(kv_capacity_tokens=4096, max_model_len=4096)
    page = SglangPage(config, Layout("sglang", data_parallel=2, tensor_parallel=2), "m", clock)
    idle = [Engine(config, clock).stats() for _ in range(2)]
    assert read_engine_page(page.render(idle)).state is PageState.IDLE
    clock.now += 30.5
    reading = read_engine_page(page.render(idle))
    assert (reading.state, reading.used_tokens, reading.capacity_tokens) == (PageState.READY, 0, 8192)
    assert reading.engines == ("dp 0: tp 0-1, pp 0", "dp 1: tp 0-1, pp 0")


def test_a_vllm_page_counts_like_vllm() -> None:
    config = EngineConfig(kv_capacity_tokens=4096, max_model_len=4096)
    engine = Engine(config, Clock())
    engine.add("a", 100, 5)
    engine.complete(engine.schedule())
    text = VllmPage(config, Layout(), "m").render([engine.stats()])
    assert "# TYPE vllm:prompt_tokens_total counter" in text and "vllm:prompt_tokens_created{" in text
    assert "python_gc_objects_collected_total" in text
    assert read_engine_page(text).used_tokens == 112  # 101 tokens computed: 7 blocks of 16


@pytest.mark.parametrize(
    "layout",
    [{"data_parallel": 0}, {"tensor_parallel": -1}, {"pipeline_parallel": 0}],
)
def test_layout_rejects_zero_ranks(layout: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="must be >= 1"):
        Layout(**layout)  # type: ignore[arg-type]


def test_the_tokenizer_counts_what_bytes_over_four_does_not(sp_model_path: Path) -> None:
    text = text_with_tokens(sp_model_path, 7_700)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 10}
    counted = parse_request("chat", body, load_tokenizer(sp_model_path).count)
    guessed = parse_request("chat", body)
    assert counted.prompt_tokens == 7_700
    assert guessed.prompt_tokens == count_text_tokens(text) != 7_700


def test_a_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(tmp_path / "absent.model")
