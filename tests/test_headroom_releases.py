"""What an agent says about when its reservations end: the decode rate it measures from the engine's
generation counter, the expected releases of its ledger, the tokens ended reservations freed, and all
of it over the wire."""

from __future__ import annotations

import dataclasses

import pytest
from fixtures.engines.pages import Vllm

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.agent.decode_rate import DecodeRate
from kvgate.agent.in_process import ManualClock
from kvgate.agent.ledger import Budget, Reservation, ReservationLedger
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.releases import expected_releases
from kvgate.agent.sources.engines import read_engine_page
from kvgate.headroom import wire
from kvgate.headroom.snapshot import (
    ExpectedRelease,
    LedgerFigures,
    ReleaseOutcome,
    ReserveOutcome,
    ReserveReason,
    TenantCharge,
    TenantStanding,
)
from kvgate.headroom.wire import HeadroomEncoder, chain_from_proto, headroom_from_proto, reserve_request

BUDGET = Budget(100_000, 1.0, 0, True)


def test_the_decode_rate_is_tokens_over_request_seconds_in_the_window() -> None:
    rate = DecodeRate(window_s=1.5)
    assert rate.tokens_per_s is None
    rate.observe(0.0, 0, 4)
    rate.observe(1.0, 0, 4)  # prefill only: nothing generated, nothing known yet
    assert rate.tokens_per_s is None
    rate.observe(2.0, 160, 4)  # 160 tokens over 2 intervals x 4 requests
    assert rate.tokens_per_s == pytest.approx(160 / 8)
    rate.observe(3.0, 360, 4)  # the prefill second has left the window
    assert rate.tokens_per_s == pytest.approx((160 + 200) / 8)


def test_an_idle_engine_keeps_its_rate_and_a_restarted_counter_starts_again() -> None:
    rate = DecodeRate(window_s=1.0)
    for t, total in enumerate((0, 100, 200)):
        rate.observe(float(t), total, 2)
    assert rate.tokens_per_s == pytest.approx(50.0)
    rate.observe(3.0, 250, 0)  # both finished within the second: 50 tokens over 2 x 1/2 s
    for t in range(4, 10):
        rate.observe(float(t), 250, 0)
    assert rate.tokens_per_s == pytest.approx(50.0), "idle: the last measure stands"
    rate.observe(10.0, 5, 1)  # the counter went back: the engine restarted
    rate.observe(11.0, 35, 1)
    assert rate.tokens_per_s == pytest.approx(30.0)
    rate.observe(12.0, None, None)  # a page without the counter changes nothing
    assert rate.tokens_per_s == pytest.approx(30.0)


def test_tokens_from_requests_that_ran_wholly_between_two_scrapes_still_give_a_rate() -> None:
    rate = DecodeRate(window_s=10.0)
    rate.observe(0.0, 0, 0)
    rate.observe(0.5, 0, 0)
    assert rate.tokens_per_s is None, "nothing generated: nothing known"
    rate.observe(1.0, 200, 0)  # one answer began and ended between the scrapes
    assert rate.tokens_per_s == pytest.approx(200 / 0.5), "as if one request ran the whole interval"
    rate.observe(1.5, 300, 2)  # seen running: the average of the ends, as before
    assert rate.tokens_per_s == pytest.approx(300 / (0.5 + 0.5))


def reservation(
    request_id: str, granted_at: float, output: int, own: int = 30_000, lease_end: float = 999.0
) -> Reservation:
    return Reservation(request_id, own, lease_end, "gate", (), own, granted_at, output)


def test_releases_are_due_after_the_output_budget_soonest_first_and_never_after_the_lease() -> None:
    live = [
        reservation("late", 0.0, 500),
        reservation("soon", 1.0, 100),
        reservation("no budget", 0.0, 0),
        reservation("leased", 0.0, 5000, lease_end=20.0),
        reservation("overdue", 0.0, 10),
    ]
    assert expected_releases(live, now=2.0, decode_tokens_per_s=50.0) == (
        ExpectedRelease(0.0, 30_000),  # overdue: expected now
        ExpectedRelease(1.0, 30_000),  # 1 + 100/50 - 2
        ExpectedRelease(8.0, 30_000),  # 500/50 - 2
        ExpectedRelease(18.0, 30_000),  # its lease ends at 20
    )
    assert expected_releases(live, 2.0, None) == ()


def test_many_releases_fold_into_the_last_entry_at_the_latest_time() -> None:
    live = [reservation(str(i), 0.0, 50 * (i + 1), own=1000) for i in range(10)]
    folded = expected_releases(live, 0.0, 50.0, limit=4)
    assert folded == (
        ExpectedRelease(1.0, 1000),
        ExpectedRelease(2.0, 1000),
        ExpectedRelease(3.0, 1000),
        ExpectedRelease(10.0, 7000),
    )


def test_the_ledger_remembers_grant_time_and_budget_and_counts_what_ends() -> None:
    clock = ManualClock(10.0)
    ledger = ReservationLedger(clock, default_lease_s=5.0, max_lease_s=60.0)
    ledger.reserve("a", 30_000, 0, BUDGET, output_tokens=256)
    clock.advance(1.0)
    ledger.reserve("a", 30_000, 0, BUDGET, output_tokens=256)  # a renewal keeps the grant time
    ledger.reserve("b", 20_000, 0, BUDGET)
    assert {(r.request_id, r.granted_at, r.output_tokens) for r in ledger.live()} == {
        ("a", 10.0, 256),
        ("b", 11.0, 0),
    }
    assert ledger.release("a") and ledger.freed_tokens == 30_000
    clock.advance(10.0)  # b's lease ran out
    assert ledger.freed_tokens == 50_000 and ledger.live() == ()
    with pytest.raises(ValueError, match="output_tokens"):
        ledger.reserve("c", 1000, 0, BUDGET, output_tokens=1001)


def test_a_vllm_node_publishes_its_rate_releases_and_freed_tokens() -> None:
    clock = ManualClock(0.0)
    state = NodeState(NodeSettings("n", "e:1", safety_ratio=1.0), clock, uses_engine=True, uses_nvml=False)

    def scrape(generated: int, running: int) -> None:
        page = Vllm(blocks=(5000,), usage=(0.5,), running=(running,), generation=(generated,)).page()
        state.observe_engine(read_engine_page(page))

    scrape(0, 2)
    assert state.reserve("r1", 30_000, 0, output_tokens=400).granted
    clock.advance(1.0)
    scrape(80, 2)  # 40 tokens per second per request
    clock.advance(1.0)
    scrape(160, 2)
    h = state.snapshot(1)
    assert h.decode_tokens_per_s == pytest.approx(40.0)
    assert h.releases == (ExpectedRelease(pytest.approx(8.0), 30_000),)  # type: ignore[arg-type]
    assert h.freed_tokens_total == 0
    state.release("r1")
    assert state.snapshot(2).freed_tokens_total == 30_000


def test_rate_releases_freed_tokens_and_output_budget_cross_the_wire() -> None:
    clock = ManualClock(0.0)
    state = NodeState(NodeSettings("n", "e:1", capacity_tokens=100_000), clock, False, False)
    state.decode_rate.observe(0.0, 0, 1)
    state.decode_rate.observe(1.0, 25, 1)
    state.reserve("r1", 10_000, 0, output_tokens=50)
    state.reserve("r2", 10_000, 0, output_tokens=100)
    state.release("r1")
    h = state.snapshot(1)
    assert (h.decode_tokens_per_s, h.releases, h.freed_tokens_total) == (
        25.0,
        (ExpectedRelease(4.0, 10_000),),
        10_000,
    )
    decoded = headroom_from_proto(pb.NodeHeadroom.FromString(HeadroomEncoder().encode(h)))
    assert decoded == h
    request = pb.ReserveRequest.FromString(
        reserve_request("r3", 9000, 0, "gate", None, output_tokens=700).SerializeToString()
    )
    assert (request.output_tokens, chain_from_proto(request)) == (700, None)


def test_the_agents_answers_are_the_types_a_gate_reads_and_cross_the_wire_whole() -> None:
    """The ledger answers the contract's ReserveOutcome and ReleaseOutcome, and the wire carries each
    field for field: a gate reads exactly what the agent's ledger said."""
    state = NodeState(NodeSettings("n", "e:1", capacity_tokens=40_000), ManualClock(0.0), False, False)
    state.decode_rate.observe(0.0, 0, 1)
    state.decode_rate.observe(1.0, 25, 1)
    granted = state.reserve("r1", 12_000, 30, output_tokens=700)
    refused = state.reserve("r2", 30_000, 30)
    # The figures a stream message would show next: 700 output tokens at 25 a second end in 28 s, and
    # the headroom counts their projection (the grant's own headroom_tokens does not).
    after = LedgerFigures(23_300, 12_000, 1, 0, (ExpectedRelease(28.0, 12_000),))
    assert granted == ReserveOutcome(True, ReserveReason.GRANTED, 24_000, 12_000, 30.0, 12_000, 0, 1, after)
    assert refused == ReserveOutcome(
        False, ReserveReason.INSUFFICIENT_HEADROOM, 23_300, 12_000, 0.0, 0, 0, 1, after
    )
    for outcome in (granted, refused):
        sent = pb.ReserveResponse.FromString(wire.reserve_to_proto(outcome).SerializeToString())
        assert wire.reserve_from_proto(sent) == outcome
    # A reservation-only node: its usage is its reservations, so the answer counts the release.
    released, again = state.release("r1"), state.release("r1")
    freed = LedgerFigures(36_000, 0, 0, 12_000, ())
    assert (released, again) == (
        ReleaseOutcome(True, 36_000, 0, 0, freed),
        ReleaseOutcome(False, 36_000, 0, 0, freed),
    )
    for outcome in (released, again):
        sent_back = pb.ReleaseResponse.FromString(wire.release_to_proto(outcome).SerializeToString())
        assert wire.release_from_proto(sent_back) == outcome


def test_an_answer_tells_the_standing_of_the_tenant_its_call_charged_or_settled() -> None:
    """A Reserve naming a tenant and the Release of its reservation answer with the tenant's entries in
    the node's tenant figures after the call, across the wire; a call of no tenant's tells none."""
    state = NodeState(NodeSettings("n", "e:1", capacity_tokens=40_000), ManualClock(0.0), False, False)
    charge = TenantCharge("acme", 10_000 + 2 * 2_000, output_weight=2.0)
    granted = state.reserve("r1", 12_000, 30, "gate", output_tokens=2_000, charge=charge)
    anonymous = state.reserve("r2", 1_000, 30, "gate")
    released = state.release("r1", "gate", generated_tokens=500)
    assert granted.after is not None and anonymous.after is not None and released.after is not None
    assert granted.after.tenant == TenantStanding("acme", 14_000.0, 12_000, 12_000)
    assert anonymous.after.tenant is None
    assert released.after.tenant == TenantStanding("acme", 11_000.0, 0, 10_500)
    forgotten = TenantStanding("gone", None, 0, None)
    for standing in (granted.after.tenant, released.after.tenant, forgotten):
        outcome = dataclasses.replace(released, after=dataclasses.replace(released.after, tenant=standing))
        sent = pb.ReleaseResponse.FromString(wire.release_to_proto(outcome).SerializeToString())
        assert wire.release_from_proto(sent) == outcome
    headroom = state.snapshot(0)
    assert forgotten.onto(dataclasses.replace(headroom, tenant_service={"gone": 5.0})).tenant_service == {}
