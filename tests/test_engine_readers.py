"""The engine readers against pages built from each engine's rules (tests/fixtures/engines/pages.py)
and against the pages live engines served (tests/fixtures/engines/live): capacity, usage and health
exactly right, and a Reserve one token past the true headroom refused.

Each case names the figure a reader that adds every series up would have read instead: data-parallel
vLLM engines each carry the summed block count, SGLang's TP ranks and PP stages each repeat the pool.
"""

from __future__ import annotations

import math

import pytest
from fixtures.engines import rules
from fixtures.engines.pages import Sglang, Vllm, llamacpp_page, tgi_page

from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.sources.engines import EngineKind, PageState, read_engine_page
from kvgate.headroom.snapshot import ReserveReason

SAFETY = 0.9


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# name, page, capacity, used, the capacity an adder would read. Every vLLM engine keeps one block of
# its pool as its null block: 2,501 blocks of 16 hold 40,000 tokens of requests.
CASES = [
    ("vllm single", Vllm(blocks=(2501,), usage=(0.25,)), 40_000, 10_000, 40_016),
    ("vllm dp2", Vllm(blocks=(2501, 2501), usage=(0.5, 0.1)), 80_000, 24_000, 160_064),
    (
        "vllm dp4",
        Vllm(blocks=(2001,) * 4, usage=(0.5, 0.25, 0.75, 0.0)),
        128_000,
        48_000,
        512_256,
    ),
    (
        "vllm dp2 with kv_cache_size_tokens",
        Vllm(blocks=(2501, 2501), usage=(0.5, 0.25), kv_cache_size_tokens=40_016),
        80_000,
        30_000,
        160_064,
    ),
    # Hybrid attention: the group-aware kv_cache_size_tokens, not blocks x block_size (48,016).
    ("vllm hybrid", Vllm(blocks=(3001,), usage=(0.5,), kv_cache_size_tokens=24_008), 24_000, 12_000, 48_016),
    (
        "vllm before 0.10",
        Vllm(blocks=(2001,), usage=(0.5,), usage_name="vllm:gpu_cache_usage_perc", engine_label=False),
        32_000,
        16_000,
        32_016,
    ),
    # The live vLLM 0.32.0 (tests/fixtures/engines/live): 256 blocks of 128, 255 usable.
    (
        "vllm 0.32 live sizes",
        Vllm(blocks=(256,), usage=(0.5,), block_size=128, kv_cache_size_tokens=32_768),
        32_640,
        16_320,
        32_768,
    ),
    ("sglang tp1", Sglang(pool_tokens=200_000, used=(50_000,)), 200_000, 50_000, 200_000),
    ("sglang tp4", Sglang(pool_tokens=200_000, used=(50_000,), tp=4), 200_000, 50_000, 800_000),
    ("sglang pp2", Sglang(pool_tokens=200_000, used=(50_000,), tp=2, pp=2), 200_000, 50_000, 800_000),
    ("sglang dp2", Sglang(pool_tokens=100_000, used=(30_000, 10_000), tp=2, dp=2), 200_000, 40_000, 400_000),
    (
        "sglang dp-attention",
        Sglang(pool_tokens=100_000, used=(30_000, 10_000), tp=4, dp=2, dp_attention=True),
        200_000,
        40_000,
        400_000,
    ),
    (
        "sglang all-schedulers",
        Sglang(pool_tokens=200_000, used=(50_000,), tp=4, all_schedulers=True),
        200_000,
        50_000,
        800_000,
    ),
    # Fresh: max_total_num_tokens from every rank, num_used_tokens not written yet.
    ("sglang fresh", Sglang(pool_tokens=200_000, used=None, tp=2), 200_000, 0, 400_000),
]


def node(page: str, capacity_tokens: int | None = None) -> NodeState:
    state = NodeState(
        NodeSettings("n", "e:1", safety_ratio=SAFETY, capacity_tokens=capacity_tokens),
        lambda: 0.0,
        uses_engine=True,
        uses_nvml=False,
    )
    state.observe_engine(read_engine_page(page))
    return state


@pytest.mark.parametrize(("name", "engine", "capacity", "used", "adder"), CASES, ids=[c[0] for c in CASES])
def test_capacity_usage_and_health_are_exactly_right(
    name: str, engine: Vllm | Sglang, capacity: int, used: int, adder: int
) -> None:
    reading = read_engine_page(engine.page())
    assert (reading.capacity_tokens, reading.used_tokens) == (capacity, used)
    snapshot = node(engine.page()).snapshot(0)
    assert snapshot.healthy, snapshot.reason
    assert (snapshot.capacity_tokens, snapshot.used_tokens) == (capacity, used)
    assert snapshot.engine_kind == ("vllm" if isinstance(engine, Vllm) else "sglang")
    assert adder >= capacity  # what summing every series gives; the Reserve below tells them apart


@pytest.mark.parametrize(("name", "engine", "capacity", "used", "adder"), CASES, ids=[c[0] for c in CASES])
def test_a_reserve_past_the_true_headroom_is_refused(
    name: str, engine: Vllm | Sglang, capacity: int, used: int, adder: int
) -> None:
    state = node(engine.page())
    headroom = math.floor(capacity * SAFETY) - used
    refused = state.reserve("over", headroom + 1, 0)
    assert not refused.granted and refused.reason is ReserveReason.INSUFFICIENT_HEADROOM
    assert state.reserve("fits", headroom, 0).granted


def test_vllm_engines_and_rule_are_named() -> None:
    reading = read_engine_page(
        Vllm(blocks=(2500, 2500), usage=(0.5, 0.1), running=(3, 1), waiting=(1, 0)).page()
    )
    assert reading.engines == ("engine 0", "engine 1")
    assert reading.rule == (
        "num_gpu_blocks 5000 / 2 engines x block_size 16: 2499 of 2500 blocks (one is vLLM's null block)"
        " x 2 engines"
    )
    assert (reading.running, reading.waiting, reading.preemptions_total) == (4, 1, 0)


def test_sglang_ranks_are_named_per_pool() -> None:
    page = Sglang(pool_tokens=100_000, used=(1, 2), tp=4, dp=2, dp_attention=True).page()
    assert read_engine_page(page).engines == ("dp 0: tp 0-1, pp 0", "dp 1: tp 2-3, pp 0")
    page = Sglang(pool_tokens=100_000, used=(1,), tp=4, pp=2).page()
    assert read_engine_page(page).engines == ("tp 0-3, pp 0-1",)


def test_sglang_priority_breakdown_is_not_counted_twice() -> None:
    page = Sglang(pool_tokens=100_000, used=(5_000,), running=(5,), priorities={0: 3, 1: 2}).page()
    assert read_engine_page(page).running == 5


def test_a_fresh_sglang_is_healthy_with_used_zero_and_says_why() -> None:
    reading = read_engine_page(Sglang(pool_tokens=200_000, used=None, tp=2).page())
    assert reading.state is PageState.IDLE
    snapshot = node(Sglang(pool_tokens=200_000, used=None, tp=2).page()).snapshot(0)
    assert snapshot.healthy and snapshot.used_tokens == 0
    assert snapshot.reason.startswith("engine idle, usage not yet published")


def test_an_idle_old_sglang_has_no_capacity_until_given_one() -> None:
    page = Sglang(pool_tokens=200_000, used=(0,), old_idle=True).page()
    assert "sglang:max_total_num_tokens" in page and read_engine_page(page).capacity_tokens is None
    without = node(page).snapshot(0)
    assert not without.healthy
    assert without.reason.startswith(
        "engine idle, capacity not yet published: sglang:max_total_num_tokens is 0"
    )
    assert not node(page).reserve("r", 1, 0).granted
    given = node(page, capacity_tokens=150_000)
    snapshot = given.snapshot(0)
    assert snapshot.healthy and (snapshot.capacity_tokens, snapshot.used_tokens) == (150_000, 0)
    assert not given.reserve("over", 135_001, 0).granted and given.reserve("fits", 135_000, 0).granted


def test_a_vllm_that_has_not_profiled_its_memory_is_not_ready() -> None:
    page = Vllm(blocks=(2500,), usage=(0.0,), profiled=False).page()
    snapshot = node(page).snapshot(0)
    assert not snapshot.healthy
    assert (
        snapshot.reason
        == "engine not ready: vllm:cache_config_info num_gpu_blocks is None: memory not profiled yet"
    )
    state = node(page)
    assert state.reserve("r", 1, 0).reason is ReserveReason.UNHEALTHY


@pytest.mark.parametrize(
    ("page", "kind", "requests"),
    [(tgi_page(2, 1), EngineKind.TGI, 3), (llamacpp_page(1, 4), EngineKind.LLAMACPP, 5)],
)
def test_engines_without_a_kv_gauge_run_reservation_only(page: str, kind: EngineKind, requests: int) -> None:
    reading = read_engine_page(page)
    assert (reading.kind, reading.state, reading.capacity_tokens) == (kind, PageState.NO_KV, None)
    without = node(page).snapshot(0)
    assert not without.healthy
    assert without.reason == (
        f"{kind.value} publishes no KV-cache figures: no KV gauge to read; "
        "set --capacity-tokens to admit on reservations alone"
    )
    clock = Clock()
    state = NodeState(
        NodeSettings("n", "e:1", safety_ratio=1.0, capacity_tokens=40_000, unreserved_request_tokens=2_000),
        clock,
        uses_engine=True,
        uses_nvml=False,
    )
    state.observe_engine(reading)
    snapshot = state.snapshot(0)
    assert snapshot.healthy and snapshot.usage_source.value == "reservations"
    assert snapshot.used_tokens == snapshot.unreserved_tokens == requests * 2_000
    assert snapshot.reason == (
        f"reservation-only: {kind.value} publishes no KV-cache figures; "
        f"used = reservations + {requests} unreserved requests x 2000 tokens"
    )
    assert state.reserve("long", 40_000 - requests * 2_000, 0).granted
    # Not on the engine yet: the unreserved requests still count in full.
    assert not state.reserve("more", 1, 0).granted
    # Seconds later the engine runs it too; it holds a reservation, so it is not charged twice.
    clock.now += 2.0
    more = tgi_page(3, 1) if kind is EngineKind.TGI else llamacpp_page(2, 4)
    state.observe_engine(read_engine_page(more))
    assert state.snapshot(1).unreserved_tokens == requests * 2_000
    assert not state.reserve("more", 1, 0).granted


def test_an_unknown_page_is_named_not_called_stale() -> None:
    page = '# TYPE my_engine_up gauge\nmy_engine_up 1\nmy_engine_busy{slot="0"} 0\nmy_engine_up 1\n'
    reading = read_engine_page(page)
    assert reading.kind is EngineKind.UNKNOWN
    assert reading.rule == "unrecognised engine page (first metric names: my_engine_up, my_engine_busy)"
    assert (
        node(page).snapshot(0).reason.startswith("unrecognised engine page (first metric names: my_engine_up")
    )
    rescued = node(page, capacity_tokens=10_000).snapshot(0)
    assert rescued.healthy and rescued.used_tokens == 0
    assert rescued.reason.endswith("used = reservations (unreserved engine traffic unknown)")


# --- pages captured from the live engines (tests/fixtures/engines/live, versions in the names) ------

VLLM_LIVE = {
    # page: used tokens, running, waiting, preemptions, prefix queries, prefix hits, generated
    "idle": (0, 0, 0, 0, 0, 0, 0),
    "load": (32_640, 4, 3, 0, 57_892, 3_968, 299),  # usage 1.0: all 255 usable blocks
    "after": (0, 0, 0, 1, 74_468, 3_968, 1_965),
}
# page: the sums of vllm:request_prompt_tokens and vllm:request_prefill_time_seconds (finished requests)
VLLM_FINISHED = {"idle": (0.0, 0.0), "load": (25_798.0, 6.5975820), "after": (74_468.0, 25.2735868)}


@pytest.mark.parametrize("which", sorted(VLLM_LIVE))
def test_live_vllm_pages_read_as_the_engine_served_them(which: str) -> None:
    page = (rules.LIVE / f"{rules.VLLM_VERSION}-{which}.txt").read_text()
    assert rules.missing(page, rules.VLLM_FAMILIES) == []
    info = rules.cache_info(page)
    assert set(info) >= rules.VLLM_CACHE_INFO_LABELS
    assert (info["num_gpu_blocks"], info["block_size"], info["kv_cache_size_tokens"]) == (
        "256",
        "128",
        "32768",
    )
    reading = read_engine_page(page)
    used, running, waiting, preemptions, queries, hits, generated = VLLM_LIVE[which]
    assert (reading.kind, reading.state, reading.capacity_tokens) == (
        EngineKind.VLLM,
        PageState.READY,
        32_640,
    )
    assert (
        reading.rule == "kv_cache_size_tokens 32768 x 255 of 256 blocks (one is vLLM's null block) x 1 engine"
    )
    assert (reading.used_tokens, reading.running, reading.waiting, reading.preemptions_total) == (
        used,
        running,
        waiting,
        preemptions,
    )
    assert (reading.prefix_queries_total, reading.prefix_hits_total, reading.generation_tokens_total) == (
        queries,
        hits,
        generated,
    )
    assert reading.prefix_caching is True and reading.engines == ("engine 0",)
    assert (reading.finished_prompt_tokens_sum, reading.finished_prefill_seconds_sum) == pytest.approx(
        VLLM_FINISHED[which]
    )
    snapshot = node(page).snapshot(0)
    assert snapshot.healthy and snapshot.admissible_tokens == 29_376  # 32,640 x 0.9


@pytest.mark.parametrize(("which", "running"), [("idle", 0), ("load", 4)])
def test_live_llama_server_pages_run_reservation_only(which: str, running: int) -> None:
    page = (rules.LIVE / f"{rules.LLAMA_VERSION}-{which}.txt").read_text()
    assert rules.missing(page, rules.LLAMA_FAMILIES) == [] and rules.kv_families(page) == []
    reading = read_engine_page(page)
    assert (reading.kind, reading.state, reading.capacity_tokens, reading.used_tokens) == (
        EngineKind.LLAMACPP,
        PageState.NO_KV,
        None,
        None,
    )
    assert (reading.running, reading.waiting) == (running, 0)
    assert not node(page).snapshot(0).healthy
    given = node(page, capacity_tokens=32_768).snapshot(0)
    assert given.healthy and given.usage_source.value == "reservations"
    assert given.used_tokens == running * 4096  # each request holding no reservation, at the default
