"""The simulator's automatic prefix caching, as vLLM's: shared blocks, LRU eviction, prefill only for
what is not cached, and the engines' own prefix-cache figures on /metrics."""

from __future__ import annotations

import argparse
import random
import re

from kvgate.sim import cli
from kvgate.sim.blocks import BlockPool, prompt_block_hashes
from kvgate.sim.engine import Engine, EngineConfig, Step
from kvgate.sim.layout import Layout
from kvgate.sim.sglang_page import SglangPage
from kvgate.sim.tokens import make_prompt
from kvgate.sim.vllm_page import VllmPage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine(caching: bool = True, **overrides: object) -> Engine:
    settings: dict[str, object] = {
        "kv_capacity_tokens": 320,
        "max_model_len": 320,
        "max_num_batched_tokens": 256,
        "prefill_tokens_per_s": 1000.0,
        "enable_prefix_caching": caching,
    }
    settings.update(overrides)
    return Engine(EngineConfig(**settings), Clock())  # type: ignore[arg-type]


def hashes(*keys: str) -> tuple[int, ...]:
    """Block hashes of a prompt of one 16-token block per key (equal keys: equal blocks)."""
    return prompt_block_hashes([("user", "".join(f"{key:>4}" * 16 for key in keys), 16 * len(keys))], 16)


def run_until_idle(e: Engine) -> list[Step]:
    steps = []
    while e.has_work():
        step = e.schedule()
        e.complete(step)
        steps.append(step)
    return steps


def test_a_prompt_shares_the_cached_blocks_of_an_earlier_one_and_prefills_only_the_rest() -> None:
    e = engine()
    doc = ("d1", "d2", "d3", "d4")
    e.add("first", 64 + 8, 2, hashes(*doc))
    first = e.schedule()
    e.complete(first)
    assert first.batch == (("first", 72),) and first.started_hit_tokens == 0
    e.add("second", 64 + 8, 2, hashes(*doc))
    second = e.schedule()
    # The first request holds the document's 4 blocks: the second takes them and computes 8 tokens.
    assert second.batch == (("first", 1), ("second", 8))
    assert (second.started_tokens, second.started_hit_tokens) == (72, 64)
    assert second.duration_s < first.duration_s
    # 4 shared blocks + one tail block each: 6 blocks held, not 10.
    assert e.stats().used_blocks == 6
    stats = e.stats()
    assert (stats.prefix_queries_total, stats.prefix_hits_total) == (144, 64)


def test_a_whole_prompt_found_in_the_cache_still_computes_its_last_block() -> None:
    e = engine()
    e.add("a", 64, 1, hashes("d1", "d2", "d3", "d4"))
    run_until_idle(e)
    e.add("b", 64, 1, hashes("d1", "d2", "d3", "d4"))
    step = e.schedule()
    # vLLM caps a hit at the prompt's length - 1: the last block is computed again.
    assert step.batch == (("b", 16),)
    assert step.started_hit_tokens == 48


def test_freed_blocks_stay_cached_until_space_is_needed_then_go_least_recently_used_first() -> None:
    e = engine()  # 20 blocks
    e.add("doc", 129, 1, hashes(*(f"a{i}" for i in range(8))))
    run_until_idle(e)
    assert e.stats().used_blocks == 0, "cached blocks are free: vLLM's usage does not count them"
    # 9 blocks freed (8 cached, the partial one first in line): a 12-block prompt takes the partial one
    # and the 11 never used, and the document stays cached.
    e.add("other", 11 * 16 + 1, 1, hashes(*(f"b{i}" for i in range(11))))
    run_until_idle(e)
    e.add("again", 129, 1, hashes(*(f"a{i}" for i in range(8))))
    assert e.schedule().started_hit_tokens == 128
    run_until_idle(e)
    # A 20-block prompt needs every block: the cached ones are evicted and the document is a miss.
    e.add("big", 19 * 16 + 1, 1, hashes(*(f"c{i}" for i in range(19))))
    run_until_idle(e)
    e.add("last", 129, 1, hashes(*(f"a{i}" for i in range(8))))
    assert e.schedule().started_hit_tokens == 0


def test_the_tail_of_a_freed_prompt_is_evicted_before_its_head() -> None:
    pool = BlockPool(4, caching=True)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    for block, block_hash in zip(blocks, (10, 11, 12), strict=True):
        pool.cache(block, block_hash)
    pool.free(blocks)
    # The never-used block goes first, then the tail (12), keeping the head (10, 11) longest.
    assert pool.allocate(2) == [3, 2]
    assert pool.cached_prefix((10, 11, 12), 3) == [0, 1]


def test_a_shared_block_is_freed_only_when_no_request_holds_it() -> None:
    pool = BlockPool(2, caching=True)
    (block,) = pool.allocate(1) or []
    pool.cache(block, 7)
    pool.touch(pool.cached_prefix((7,), 1))
    pool.free([block])
    assert pool.free_blocks == 1, "still held by the second request"
    pool.free([block])
    assert pool.free_blocks == 2
    assert pool.cached_prefix((7,), 1) == [block], "free, and still cached"


def test_without_prefix_caching_nothing_is_shared() -> None:
    e = engine(caching=False)
    e.add("a", 72, 2, hashes("d1", "d2", "d3", "d4"))
    e.complete(e.schedule())
    e.add("b", 72, 2, hashes("d1", "d2", "d3", "d4"))
    step = e.schedule()
    assert step.batch == (("a", 1), ("b", 72))
    assert e.stats().prefix_hits_total == 0


def test_block_hashes_follow_the_prompt_from_its_start() -> None:
    doc = make_prompt(100, random.Random(1))
    one = prompt_block_hashes([("system", doc, 100), ("user", "what is it?", 3)], 16)
    two = prompt_block_hashes([("system", doc, 100), ("user", "and why?", 2)], 16)
    assert len(one) == 6 and one[:6] == two[:6], "the document's 6 full blocks are the same"
    moved = prompt_block_hashes([("user", doc, 100)], 16)
    assert not set(moved) & set(one), "the same text under another role is another prompt"
    shifted = prompt_block_hashes([("system", " the" + doc, 101)], 16)
    assert not set(shifted) & set(one)


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(2))


def test_the_vllm_page_counts_prefix_cache_queries_and_hits_as_vllm_does() -> None:
    e = engine()
    e.add("a", 72, 1, hashes("d1", "d2", "d3", "d4"))
    run_until_idle(e)
    e.add("b", 72, 1, hashes("d1", "d2", "d3", "d4"))
    run_until_idle(e)
    page = VllmPage(e.config, Layout(), "m")
    text = page.render([e.stats()])
    assert sample(text, "vllm:prefix_cache_queries_total") == 144
    assert sample(text, "vllm:prefix_cache_hits_total") == 64
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"}' in text
    assert 'enable_prefix_caching="True"' in text
    assert 'enable_prefix_caching="False"' in VllmPage(engine(caching=False).config, Layout(), "m").render(
        [engine(caching=False).stats()]
    )


def test_the_sglang_page_writes_the_hit_rate_of_each_prefill_batch_and_0_on_decode() -> None:
    clock = Clock()
    e = engine()
    page = SglangPage(e.config, Layout(engine="sglang"), "m", clock)
    e.add("a", 72, 1, hashes("d1", "d2", "d3", "d4"))
    rates = []
    for request in ("b", "c"):
        while e.has_work():
            step = e.schedule()
            e.complete(step)
            page.stepped(0, step, e.stats())
            rates.append(sample(page.render([e.stats()]), "sglang:cache_hit_rate"))
        e.add(request, 72, 1, hashes("d1", "d2", "d3", "d4"))
    assert rates[0] == 0.0, "the first prompt found nothing"
    assert rates[-1] == 64 / 72


def test_the_cli_enables_prefix_caching_by_default_and_can_turn_it_off() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    base = ["sim", "--listen", "127.0.0.1:1", "--kv-capacity-tokens", "40960"]
    assert parser.parse_args(base).enable_prefix_caching is True
    assert parser.parse_args([*base, "--no-enable-prefix-caching"]).enable_prefix_caching is False
