"""The agent's side of prefix-aware placement: shared blocks charged once, idle blocks charged again,
forgotten as the engine's KV fills or its hit counters fall short, and summarised on the stream."""

from __future__ import annotations

import pytest

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.agent.in_process import ManualClock
from kvgate.agent.ledger import Budget, ReservationLedger
from kvgate.agent.node import SUMMARY_EVERY_S, NodeSettings, NodeState
from kvgate.agent.prefix_audit import PrefixAudit
from kvgate.agent.prefix_blocks import PrefixBlocks
from kvgate.agent.sources.engines import read_engine_page
from kvgate.headroom.snapshot import PrefixChain, ReserveReason
from kvgate.headroom.wire import HeadroomEncoder, chain_from_proto, headroom_from_proto, reserve_request

BUDGET = Budget(capacity_tokens=100_000, safety_ratio=1.0, observed_tokens=0, healthy=True)
DOC = PrefixChain(tuple(range(1, 101)), 250)  # a 25k-token document in 100 blocks


def question(n: int) -> PrefixChain:
    """The document followed by one block of its own question."""
    return PrefixChain((*DOC.blocks, 1000 + n), DOC.block_tokens)


def ledger(clock: ManualClock | None = None, **blocks: int) -> ReservationLedger:
    return ReservationLedger(clock or ManualClock(), 300.0, 3600.0, PrefixBlocks(**blocks))


def test_live_reservations_on_one_document_charge_it_once() -> None:
    book = ledger()
    first = book.reserve("q1", 26_000, 0, BUDGET, prefix=question(1))
    assert first.granted and first.charged_tokens == 26_000 and first.cached_tokens == 0
    second = book.reserve("q2", 26_000, 0, BUDGET, prefix=question(2))
    # The 25k document is held by q1: q2 adds its question block (250) and its own 750 tokens.
    assert second.granted and second.charged_tokens == 1_000 and second.cached_tokens == 25_000
    assert book.reserved_tokens == 27_000
    assert book.saved_tokens == 25_000
    book.release("q1")
    assert book.reserved_tokens == 1_000 + 25_000, "q2 still holds the document"
    book.release("q2")
    assert book.reserved_tokens == 0 and book.saved_tokens == 0


def test_twenty_questions_at_once_fit_where_twenty_full_charges_would_not() -> None:
    book = ledger()
    granted = [book.reserve(f"q{i}", 26_000, 0, BUDGET, prefix=question(i)).granted for i in range(20)]
    assert all(granted)
    assert book.reserved_tokens == 26_000 + 19 * 1_000
    plain = ledger()
    assert sum(plain.reserve(f"q{i}", 26_000, 0, BUDGET).granted for i in range(20)) == 3


def test_an_idle_cached_document_saves_prefill_but_is_charged_in_full() -> None:
    book = ledger()
    book.reserve("q1", 26_000, 0, BUDGET, prefix=question(1))
    book.release("q1")
    again = book.reserve("q2", 26_000, 0, BUDGET, prefix=question(2))
    # The engine finds the document cached, but taking it back from its free pool costs KV.
    assert again.cached_tokens == 25_000 and again.charged_tokens == 26_000


def test_a_shared_reservation_is_refused_only_for_what_it_adds() -> None:
    small = Budget(capacity_tokens=27_500, safety_ratio=1.0, observed_tokens=0, healthy=True)
    book = ledger()
    assert book.reserve("q1", 26_000, 0, small, prefix=question(1)).granted
    assert book.reserve("q2", 26_000, 0, small, prefix=question(2)).granted
    refused = book.reserve("other", 2_000, 0, small)
    assert refused.reason is ReserveReason.INSUFFICIENT_HEADROOM and refused.charged_tokens == 0


def test_a_retried_reserve_keeps_its_blocks_and_a_chain_larger_than_the_request_is_misuse() -> None:
    book = ledger()
    book.reserve("q1", 26_000, 0, BUDGET, prefix=question(1))
    retry = book.reserve("q1", 26_000, 0, BUDGET, prefix=question(1))
    assert retry.reason is ReserveReason.ALREADY_RESERVED and book.reserved_tokens == 26_000
    book.release("q1")
    assert book.reserved_tokens == 0
    with pytest.raises(ValueError, match="does not fit"):
        book.reserve("big", 1_000, 0, BUDGET, prefix=DOC)


def test_an_expired_lease_lets_go_of_its_blocks() -> None:
    clock = ManualClock()
    book = ledger(clock)
    book.reserve("q1", 26_000, 10.0, BUDGET, prefix=question(1))
    clock.advance(11.0)
    assert book.reserved_tokens == 0
    assert book.prefixes.idle_tokens == 25_250


def test_idle_blocks_are_forgotten_least_recently_used_first_tail_before_head() -> None:
    blocks = PrefixBlocks()
    blocks.hold(DOC)
    blocks.release(DOC.blocks)
    other = PrefixChain(tuple(range(500, 540)), 250)
    blocks.hold(other)
    blocks.release(other.blocks)
    assert blocks.evict(250) == 250
    assert blocks.cached_blocks(DOC) == 99, "the document's last block went first"
    blocks.fit_idle(10_000)
    assert blocks.idle_tokens <= 10_000
    assert blocks.cached_blocks(other) == 40, "the newer chain is kept"
    assert blocks.cached_blocks(DOC) == 0


def test_blocks_in_use_are_never_forgotten_and_the_index_is_bounded() -> None:
    blocks = PrefixBlocks(max_blocks=150)
    blocks.hold(DOC)
    assert blocks.evict(100_000) == 0
    assert blocks.fit_idle(0) == 0
    other = PrefixChain(tuple(range(500, 600)), 250)
    blocks.hold(other)
    blocks.release(other.blocks)
    assert len(blocks) == 150, "idle blocks make way for the bound"
    assert blocks.shared_blocks(DOC) == 100


def test_the_summary_samples_every_fourth_block_in_use_first() -> None:
    blocks = PrefixBlocks(summary_blocks=30)
    blocks.hold(DOC)
    blocks.release(DOC.blocks)
    live = PrefixChain(tuple(range(500, 600)), 250)
    blocks.hold(live)
    summary = blocks.summary(0)
    assert len(summary.blocks) == 30
    assert summary.matched_blocks(live) == 100
    assert summary.matched_blocks(DOC) == 20, "5 of the document's blocks, most recent (its head) first"
    assert summary.indexed_tokens == 50_000
    assert blocks.summary(0).generation == summary.generation, "nothing changed"
    blocks.release(live.blocks)
    assert blocks.summary(0).generation != summary.generation


def test_the_audit_forgets_what_vllms_hit_counter_did_not_find() -> None:
    audit = PrefixAudit(arrival_s=1.0)
    assert audit.observe(0.0, 1_000, None, 0) == 0
    audit.expect(0.1, 25_000)
    assert audit.observe(0.5, 1_000, None, 0) == 0, "the request may not have reached the engine"
    assert audit.observe(1.2, 1_000, None, 0) == 25_000, "it did, and found nothing"
    audit.expect(2.0, 25_000)
    assert audit.observe(3.5, 1_000 + 24_000, None, 0) == 0, "found within the estimate's error"
    audit.expect(4.0, 25_000)
    assert audit.observe(5.5, 25_000 + 5_000, None, 1) == 0, "one request still waits: not looked up"
    assert audit.observe(5.6, 25_000 + 5_000, None, 0) == 20_000


def test_the_audit_reads_sglangs_hit_rate_as_seen_or_not() -> None:
    audit = PrefixAudit(arrival_s=1.0)
    audit.observe(0.0, None, 0.0, 0)
    audit.expect(0.1, 25_000)
    assert audit.observe(1.5, None, 0.0, 0) == 25_000, "no prefill batch found anything"
    audit.expect(2.0, 25_000)
    audit.observe(2.2, None, 0.97, 0)
    assert audit.observe(3.5, None, 0.0, 0) == 0, "a batch found its prefix (decode wrote 0 since)"


def vllm_page(used_fraction: float, hits: int, caching: bool = True) -> str:
    info = (
        f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="{caching}",engine="0",'
        'num_gpu_blocks="6251"} 1.0'  # 100k tokens of requests, and vLLM's null block
    )
    return (
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {used_fraction}\n{info}\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {hits * 2}\n'
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
    )


def node(clock: ManualClock) -> NodeState:
    return NodeState(NodeSettings("n", "n:8000", safety_ratio=1.0), clock, uses_engine=True, uses_nvml=False)


def test_the_node_s_prefix_index_is_the_one_its_settings_bound() -> None:
    settings = NodeSettings("n", "n:8000", safety_ratio=1.0, prefix_index_blocks=150)
    state = NodeState(settings, ManualClock(), uses_engine=True, uses_nvml=False)
    state.observe_engine(read_engine_page(vllm_page(0.0, 0)))
    for n in range(3):
        state.reserve(f"q{n}", 26_000, 0, prefix=PrefixChain(tuple(range(n * 100, n * 100 + 100)), 250))
        state.release(f"q{n}")
    assert len(state.ledger.prefixes) == 150


def test_an_evicted_prefix_is_charged_in_full_on_the_next_request() -> None:
    clock = ManualClock()
    state = node(clock)  # 100k tokens of KV
    state.observe_engine(read_engine_page(vllm_page(0.0, 0)))
    assert state.reserve("q1", 26_000, 0, prefix=question(1)).granted
    assert state.reserve("q2", 26_000, 0, prefix=question(2)).charged_tokens == 1_000
    state.release("q1")
    state.release("q2")
    assert state.snapshot(0).prefix.indexed_tokens == 25_500
    # Other work fills the engine (80k of 100k in use): too little free KV to keep the document cached.
    clock.advance(0.1)
    state.observe_engine(read_engine_page(vllm_page(0.8, 0)))
    assert state.prefix_forgotten >= 5_500
    clock.advance(0.1)
    state.observe_engine(read_engine_page(vllm_page(0.0, 0)))
    clock.advance(SUMMARY_EVERY_S)  # the stream's summary is rebuilt at most this often
    assert state.snapshot(1).prefix.matched_blocks(question(3)) <= 80, "the gates are told"
    later = state.reserve("q3", 26_000, 0, prefix=question(3))
    assert later.granted and later.charged_tokens == 26_000
    assert later.cached_tokens <= 20_000, "the agent no longer counts on the evicted part"


def test_an_engine_without_prefix_caching_shares_nothing() -> None:
    clock = ManualClock()
    state = node(clock)
    state.observe_engine(read_engine_page(vllm_page(0.0, 0, caching=False)))
    state.reserve("q1", 26_000, 0, prefix=question(1))
    second = state.reserve("q2", 26_000, 0, prefix=question(2))
    assert (second.charged_tokens, second.cached_tokens) == (26_000, 0)
    assert not state.snapshot(0).prefix.blocks


def test_a_shortfall_in_the_engines_hits_forgets_the_least_recently_used_prefixes() -> None:
    clock = ManualClock()
    state = node(clock)
    state.observe_engine(read_engine_page(vllm_page(0.0, 0)))
    older = PrefixChain(tuple(range(5000, 5100)), 250)
    state.reserve("a", 26_000, 0, prefix=older)
    state.release("a")
    state.reserve("b1", 26_000, 0, prefix=question(1))
    state.release("b1")
    assert state.reserve("b2", 26_000, 0, prefix=question(2)).cached_tokens == 25_000
    clock.advance(1.5)
    # The engine found nothing for b2: its cache turned over more than the agent knew, so the least
    # recently used prefix (the older document) is gone too.
    state.observe_engine(read_engine_page(vllm_page(0.27, 0)))
    assert state.reserve("a2", 26_000, 0, prefix=older).cached_tokens == 0


def test_the_stream_and_reserve_carry_the_prefix_summary_and_chain() -> None:
    clock = ManualClock()
    state = node(clock)
    state.observe_engine(read_engine_page(vllm_page(0.0, 0)))
    state.reserve("q1", 26_000, 0, prefix=question(1))
    state.reserve("q2", 26_000, 0, prefix=question(2))
    encoder = HeadroomEncoder()
    first = headroom_from_proto(pb.NodeHeadroom.FromString(encoder.encode(state.snapshot(1))))
    assert first.prefix.matched_blocks(question(1)) == 100
    assert first.prefix.saved_tokens == 25_000
    again = headroom_from_proto(pb.NodeHeadroom.FromString(encoder.encode(state.snapshot(2))), first.prefix)
    assert again.prefix.blocks is first.prefix.blocks, "an unchanged summary is not rebuilt"
    request = pb.ReserveRequest.FromString(
        reserve_request("r", 26_000, 0, "g", question(7)).SerializeToString()
    )
    assert chain_from_proto(request) == question(7)
    assert chain_from_proto(reserve_request("r", 1, 0, "g", None)) is None


def test_engine_readers_read_the_prefix_cache_figures() -> None:
    reading = read_engine_page(vllm_page(0.5, 700))
    assert (reading.prefix_queries_total, reading.prefix_hits_total) == (1_400, 700)
    old = read_engine_page(
        vllm_page(0.5, 0).replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_").replace(" 0\n", " 9\n")
    )
    assert old.prefix_hits_total == 9
    sglang = read_engine_page(
        'sglang:max_total_num_tokens{tp_rank="0"} 1000\nsglang:num_used_tokens{tp_rank="0"} 10\n'
        'sglang:cache_hit_rate{tp_rank="0"} 0.25\n'
    )
    assert sglang.cache_hit_rate == 0.25 and sglang.prefix_hits_total is None
