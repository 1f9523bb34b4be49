"""A ledger that follows use (issue 28, item 5): admission on the peak over time of the reservations'
projected footprints, reconciled with the engine's usage, at output budgets learned from what the
node's requests really generated."""

from __future__ import annotations

import random

import pytest
from fixtures.engines.pages import Vllm

from kvgate.agent.footprint import Footprint, peak, project
from kvgate.agent.in_process import ManualClock
from kvgate.agent.ledger import Budget, Commitment, ReservationLedger
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.output_budget import CLIP_MAX_NEW_TOKENS, OutputHistory
from kvgate.agent.sources.engines import read_engine_page
from kvgate.headroom.snapshot import ReserveReason

RATE = 50.0  # output tokens per second per running request


class Rate:
    def __init__(self, value: float | None = RATE) -> None:
        self.value = value

    def __call__(self) -> float | None:
        return self.value


def ledger(clock: ManualClock, rate: float | None = RATE) -> ReservationLedger:
    return ReservationLedger(clock, 3600, 3600, decode_rate=Rate(rate))


def budget(observed: int | None = None, capacity: int = 1000) -> Budget:
    return Budget(capacity, 1.0, observed, True)


# --- the peak over time --------------------------------------------------------------------------


def test_two_requests_whose_peaks_do_not_meet_both_fit_where_their_final_sizes_do_not() -> None:
    """100 prompt + 500 output each: 1,200 in all on a node that admits 1,000. One that has 5 tokens
    left and a fresh one hold at most 600 + 105 together; two fresh ones 1,200."""
    clock = ManualClock(0.0)
    node = ledger(clock)
    assert node.reserve("old", 600, 0, budget(), output_tokens=500).granted
    clock.advance(100 / 10_000 + 495 / RATE)  # its prefill, then 495 tokens
    held = 100 + 495
    commitment = node.commitment(budget(held))
    assert commitment.follows_use and commitment.peak == 600 and commitment.drift == 0
    fresh = node.reserve("fresh", 600, 0, budget(held), output_tokens=500)
    assert fresh.granted, fresh
    assert node.commitment(budget(held)).peak == 600 + 105
    assert node.reserved_tokens == 1200, "what each was charged is still what the stream reports"

    clock.advance(5 / RATE)  # the old one is due; a third request's peak meets the fresh one's
    assert node.reserve("third", 600, 0, budget(held + 105), output_tokens=500).reason == (
        ReserveReason.INSUFFICIENT_HEADROOM
    )


def test_two_fresh_requests_whose_peaks_meet_are_refused() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    assert node.reserve("a", 600, 0, budget(), output_tokens=500).granted
    refused = node.reserve("b", 600, 0, budget(), output_tokens=500)
    assert not refused.granted and refused.reason == ReserveReason.INSUFFICIENT_HEADROOM


def test_a_node_without_a_decode_rate_keeps_each_charge_for_the_whole_life() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock, rate=None)
    assert node.reserve("old", 600, 0, budget(), output_tokens=500).granted
    clock.advance(100 / 10_000 + 495 / RATE)
    commitment = node.commitment(budget(595))
    assert not commitment.follows_use and commitment.peak == 600
    assert node.headroom(budget(595)) == 400 == node.headroom(budget(None))
    assert node.headroom(budget(700)) == 300, "admissible - max(engine usage, Σ reserved), as before"
    assert node.reserve("fresh", 600, 0, budget(595), output_tokens=500).reason == (
        ReserveReason.INSUFFICIENT_HEADROOM
    )
    assert node.reserve("fits", 400, 0, budget(595), output_tokens=300).granted


def test_a_reservation_without_an_output_budget_holds_its_charge_throughout() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    assert node.reserve("queued job", 600, 0, budget()).granted  # the queue's Reserve: no split
    clock.advance(3000.0)  # within its lease
    assert node.commitment(budget()).peak == 600
    assert not node.reserve("next", 600, 0, budget(), output_tokens=500).granted


# --- drift ---------------------------------------------------------------------------------------


def test_the_engine_holding_more_than_projected_tightens_admission_at_once() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    assert node.reserve("a", 300, 0, budget(), output_tokens=200).granted
    clock.advance(2.0)  # received: prefill 0.01 s, then 99 tokens generated
    projected = 100 + 99
    assert node.headroom(budget(projected)) == 1000 - 300
    assert node.headroom(budget(projected + 250)) == 1000 - 300 - 250, "drift is carried on the peak"
    assert node.reserve("b", 500, 0, budget(projected), output_tokens=100).granted
    node.release("b")
    refused = node.reserve("b", 500, 0, budget(projected + 250), output_tokens=100)
    assert refused.reason == ReserveReason.INSUFFICIENT_HEADROOM and refused.headroom_tokens == 450


def test_the_engine_holding_less_than_projected_is_never_credited() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    assert node.reserve("a", 300, 0, budget(), output_tokens=200).granted
    clock.advance(2.0)
    assert node.headroom(budget(0)) == node.headroom(budget(199)) == 700


def test_a_fresh_reservation_is_counted_once_whether_or_not_the_engine_has_written_it() -> None:
    """A prompt being written is in the engine's usage and in the reservation's footprint: the same
    tokens, counted once. Usage beyond every reservation's footprint is drift."""
    clock = ManualClock(0.0)
    node = ledger(clock)
    assert node.reserve("fresh", 400, 0, budget(), output_tokens=100).granted
    assert node.commitment(budget(0)).tokens == 400
    assert node.commitment(budget(300)).tokens == 400, "its prompt, written"
    assert node.commitment(budget(450)) == Commitment(550, 400, 150, True)


def test_the_commitment_never_falls_below_the_engines_usage() -> None:
    rng = random.Random(28)
    for _ in range(200):
        clock = ManualClock(0.0)
        node = ledger(clock, rate=rng.choice([None, 5.0, 50.0, 500.0]))
        for i in range(rng.randint(0, 6)):
            size = rng.randint(10, 300)
            node.reserve(f"r{i}", size, 0, budget(None, 10_000), output_tokens=rng.randint(0, size))
            clock.advance(rng.uniform(0.0, 3.0))
        observed = rng.randint(0, 3000)
        assert node.commitment(budget(observed, 10_000)).tokens >= observed


# --- the headroom a gate compares a request with -------------------------------------------------


def test_any_request_within_the_published_headroom_is_granted() -> None:
    rng = random.Random(5)
    for _ in range(300):
        clock = ManualClock(0.0)
        node = ledger(clock)
        for i in range(rng.randint(0, 5)):
            size = rng.randint(10, 400)
            node.reserve(f"r{i}", size, 0, budget(), output_tokens=rng.randint(0, size))
            clock.advance(rng.uniform(0.0, 8.0))
        observed = rng.randint(0, 400)
        room = node.headroom(budget(observed))
        if room <= 0:
            continue
        size = rng.randint(1, room)
        outcome = node.reserve("new", size, 0, budget(observed), output_tokens=rng.randint(0, size))
        assert outcome.granted, (room, size, outcome)


# --- learned output budgets ----------------------------------------------------------------------


def teach(node: ReservationLedger, clock: ManualClock, output: int, count: int) -> None:
    """`count` requests that each generated `output` tokens (held for output / rate seconds)."""
    for i in range(count):
        node.reserve(f"done-{output}-{i}", 40_000, 0, budget(None, 1_000_000), output_tokens=32_000)
        clock.advance(output / RATE)
        assert node.release(f"done-{output}-{i}")


def test_an_over_declared_budget_is_charged_about_what_the_node_learned() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    big = budget(None, 1_000_000)
    assert node.reserve("before", 40_000, 0, big, output_tokens=32_000).granted
    assert node.commitment(big).peak == 8_000 + CLIP_MAX_NEW_TOKENS, "SGLang's clip before history"
    node.release("before")

    teach(node, clock, 400, 100)
    q99 = node.outputs.quantile(0.99)
    assert q99 is not None and 400 <= q99 < 400 * 1.2
    assert node.reserve("reasoner", 40_000, 0, big, output_tokens=32_000).granted
    assert node.commitment(big).peak == 8_000 + q99, "charged the learned budget, not 32k"
    assert node.reserve("modest", 8_300, 0, big, output_tokens=300).granted
    # Its declared 300 stands (below q99): it ends 40 + 300 steps from now, holding 8,300, when the
    # reasoner holds 8,000 + 340.
    assert node.commitment(big).peak == 8_300 + 8_000 + 340


def test_a_request_that_runs_past_its_learned_budget_is_projected_again_within_its_declared() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    big = budget(None, 1_000_000)
    teach(node, clock, 400, 99)
    teach(node, clock, 2_000, 1)  # the history's q99.9
    levels = node.outputs.levels()
    assert levels[0] < 500 and levels[1] >= 2_000
    assert node.reserve("long thinker", 40_000, 0, big, output_tokens=32_000).granted
    prefill_s = 8_000 / 10_000
    clock.advance(prefill_s + 600 / RATE)  # 600 generated: past q99
    assert node.commitment(big).peak == 8_000 + levels[1]
    clock.advance(2_410 / RATE)  # 3,010 generated: past q99.9, a rolling q99.9 more
    assert node.commitment(big).peak == 8_000 + 3_010 + levels[1]
    clock.advance(40_000 / RATE)  # past what it declared: its whole charge, ending any moment
    assert node.commitment(big).peak == 40_000


def test_the_learned_budget_follows_the_last_ends_in_bounded_memory() -> None:
    history = OutputHistory(keep=1024)
    for _ in range(100_000):
        history.learn(30_000)
    for _ in range(1024):
        history.learn(300)
    assert len(history) == 1024 and sum(history._counts) == 1024
    assert len(history._counts) == 81
    q = history.quantile(0.99)
    assert q is not None and 300 <= q < 360, "the old long outputs are forgotten"


def test_before_enough_history_the_projection_is_sglangs_rolling_clip() -> None:
    history = OutputHistory(min_samples=100)
    for _ in range(99):
        history.learn(10)
    assert history.quantile(0.99) is None
    assert history.projected(32_000, 0) == CLIP_MAX_NEW_TOKENS
    assert history.projected(32_000, 5_000) == 5_000 + CLIP_MAX_NEW_TOKENS
    assert history.projected(1_000, 0) == 1_000
    history.learn(10)
    assert history.projected(32_000, 0) == 256, "never below the floor"


# --- the pure pieces -----------------------------------------------------------------------------


def brute_peak(footprints: list[Footprint]) -> int:
    horizon = max((f.ends_in for f in footprints if f.ends_in != float("inf")), default=0.0)
    return max(sum(f.at(float(t)) for f in footprints) for t in range(int(horizon) + 2))


def test_the_peak_is_the_largest_sum_at_any_step() -> None:
    rng = random.Random(2507)
    for _ in range(500):
        footprints = []
        for _ in range(rng.randint(0, 7)):
            declared = rng.choice([0, rng.randint(1, 60)])
            if declared == 0:
                footprints.append(Footprint(rng.randint(0, 50), 0, 0, float("inf")))
                continue
            footprints.append(
                project(rng.randint(0, 300), declared, rng.uniform(0, 2), 40.0, prefill_tokens_per_s=200)
            )
        assert peak(footprints) == brute_peak(footprints), footprints


def test_a_request_in_prefill_is_projected_growing_now_and_ending_after_its_whole_prefill() -> None:
    f = project(10_000, 100, 0.5, RATE)  # 1 s of prefill, half of it left
    assert (f.prompt, f.budget, f.generated) == (10_000, 100, 0)
    assert f.ends_in == pytest.approx(0.5 * RATE + 100)
    assert f.at(0.0) == 10_000 and f.at(30.0) == 10_030 and f.at(125.0) == 10_100 and f.at(126.0) == 0


# --- a node that measures its engine -------------------------------------------------------------


def test_a_vllm_node_admits_on_the_peak_once_its_decode_rate_is_measured() -> None:
    clock = ManualClock(0.0)
    settings = NodeSettings("n", "e:1", safety_ratio=1.0, capacity_tokens=20_000)
    state = NodeState(settings, clock, uses_engine=True, uses_nvml=False)

    def scrape(generated: int, running: int, used_blocks: int) -> None:
        page = Vllm(blocks=(1250,), usage=(used_blocks / 1250,), running=(running,), generation=(generated,))
        state.observe_engine(read_engine_page(page.page()))

    scrape(0, 0, 0)
    assert state.reserve("old", 12_000, 0, output_tokens=10_000).granted
    assert not state.reserve("early", 12_000, 0, output_tokens=10_000).granted, "no rate yet: sizes add"
    for t in range(1, 200):  # 50 tokens a second for 199 s: 9,950 generated, 50 left
        clock.advance(1.0)
        scrape(50 * t, 1, (2_000 + 50 * t) // 16)
    assert state.snapshot(1).decode_tokens_per_s == pytest.approx(50.0)
    assert state.reserve("fresh", 12_000, 0, output_tokens=10_000).granted


def test_a_release_that_says_what_the_request_generated_is_learned_as_said_not_from_its_hold() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    big = budget(None, 1_000_000)
    for i in range(100):
        assert node.reserve(f"r{i}", 9_000, 0, big, output_tokens=1_000).granted
        clock.advance(30.0)  # held 30 s: at 50 tokens/s the hold says the whole 1,000 was written
        node.release(f"r{i}", generated_tokens=120)
    q99 = node.outputs.quantile(0.99)
    assert q99 is not None and 120 <= q99 < 120 * 1.2
    unsaid = ledger(clock)
    for i in range(100):
        assert unsaid.reserve(f"h{i}", 9_000, 0, big, output_tokens=1_000).granted
        clock.advance(30.0)
        unsaid.release(f"h{i}")  # nothing said: learned from the hold, at most the declared budget
    held_q99 = unsaid.outputs.quantile(0.99)
    assert held_q99 is not None and held_q99 >= 1_000
