"""Leases that follow the stream (kvgate.gate.leases): one Renew per agent per period, no lapse while the
gate renews, a late renewal refused and never booked again, and a gate that stops renewing frees its
KV within one lease."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from waiting import until_async

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.agent.ledger import Budget, ReservationLedger
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.config import AdmissionConfig, ModelConfig
from kvgate.config.headroom import HeadroomSettings
from kvgate.errors import HeadroomError
from kvgate.gate.admission import Admission
from kvgate.gate.leases import RENEWALS_PER_LEASE, LeaseKeeper
from kvgate.headroom.snapshot import NodeView
from kvgate.headroom.view import HeadroomView
from kvgate.policy import Reason, Route
from kvgate.telemetry import GateMetrics

LEASE_S = 30.0


def budget() -> Budget:
    return Budget(100_000, 0.9, 0, True)


def test_a_renewal_extends_only_the_holders_live_reservations() -> None:
    clock = ManualClock()
    ledger = ReservationLedger(clock, 10.0, 60.0)
    ledger.reserve("a", 1_000, LEASE_S, budget(), "gate-1")
    ledger.reserve("b", 1_000, LEASE_S, budget(), "gate-2")
    clock.advance(20)
    lapsed, lease = ledger.renew(["a", "b", "never"], "gate-1", LEASE_S)
    assert (lapsed, lease) == (["b", "never"], LEASE_S)
    clock.advance(20)  # 40 s: "b" (another holder's, not renewed) ended at 30, "a" runs to 50
    assert [r.request_id for r in ledger.live()] == ["a"]


def test_a_renewal_after_the_lease_lapsed_is_refused_and_books_nothing() -> None:
    clock = ManualClock()
    ledger = ReservationLedger(clock, 10.0, 60.0)
    ledger.reserve("a", 1_000, LEASE_S, budget(), "gate-1")
    clock.advance(LEASE_S)
    lapsed, _ = ledger.renew(["a"], "gate-1", LEASE_S)
    assert lapsed == ["a"]
    assert ledger.reserved_tokens == 0 and ledger.live() == ()


def test_an_id_released_before_its_renewal_arrived_is_not_a_lapse() -> None:
    clock = ManualClock()
    ledger = ReservationLedger(clock, 10.0, 60.0)
    ledger.reserve("ended", 1_000, LEASE_S, budget(), "gate-1")
    assert ledger.release("ended", "gate-1")  # the Release overtook the renewal that names it
    lapsed, _ = ledger.renew(["ended"], "gate-1", LEASE_S)
    assert lapsed == [] and ledger.live() == ()


def fake_with_nodes(clock: ManualClock, *names: str) -> FakeHeadroom:
    fake = FakeHeadroom(clock, lease_s=LEASE_S)
    for name in names:
        fake.add_node(name, 100_000)
    return fake


async def granted(fake: FakeHeadroom, keeper: LeaseKeeper, node: str, request_id: str) -> None:
    outcome = await fake.reserve(node, request_id, 1_000)
    assert outcome.granted
    keeper.hold(node, request_id)


def test_one_renew_call_per_agent_per_period_whatever_the_number_of_requests() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        fake = fake_with_nodes(clock, "n1", "n2")
        keeper = LeaseKeeper(fake, LEASE_S, GateMetrics())
        for i in range(5):
            await granted(fake, keeper, "n1", f"r{i}")
        await granted(fake, keeper, "n2", "s0")
        await keeper.renew()
        assert sorted(fake.renewals) == [("n1", ("r0", "r1", "r2", "r3", "r4")), ("n2", ("s0",))]
        keeper.let_go("n2", "s0")
        await keeper.renew()
        assert [node for node, _ in fake.renewals[2:]] == ["n1"]  # nothing held on n2: no call

    asyncio.run(scenario())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=30))
def test_no_lapse_while_the_stream_lives_when_no_two_renewals_in_a_row_fail(answers: list[bool]) -> None:
    """Renewals every third of the lease: one that fails, or lands late within its period, is covered
    by the next. Failed renewals are the agent giving no answer (HeadroomError)."""
    answers = [ok or (i > 0 and not answers[i - 1]) for i, ok in enumerate(answers)]

    async def scenario() -> None:
        clock = ManualClock()
        fake = fake_with_nodes(clock, "n1")
        keeper = LeaseKeeper(fake, LEASE_S, GateMetrics())
        await granted(fake, keeper, "n1", "r")
        for ok in answers:
            clock.advance(keeper.period_s)
            if ok:
                await keeper.renew()
            else:
                fake.disconnect("n1")
                await keeper.renew()
                fake.reconnect("n1")
            assert keeper.held("n1") == ("r",)
            assert fake.reserved_tokens("n1") == 1_000

    asyncio.run(scenario())


def test_a_late_renewal_is_refused_and_the_gate_forgets_the_reservation() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        fake = fake_with_nodes(clock, "n1")
        metrics = GateMetrics()
        keeper = LeaseKeeper(fake, LEASE_S, metrics)
        await granted(fake, keeper, "n1", "late")
        await granted(fake, keeper, "n1", "renewed")
        clock.advance(LEASE_S - 1)
        lapsed = await fake.renew("n1", ["renewed"])  # the other one's renewals were lost
        assert lapsed == frozenset()
        clock.advance(RENEWALS_PER_LEASE)
        await keeper.renew()
        assert keeper.held("n1") == ("renewed",)
        assert metrics._lease_renewals.counts == {("renewed",): 1, ("lapsed",): 1}
        assert fake.reserved_tokens("n1") == 1_000  # "late" is not booked again

    asyncio.run(scenario())


def test_a_request_that_ends_while_its_renewal_is_out_is_not_counted_lapsed() -> None:
    class Slow(FakeHeadroom):
        async def renew(self, node: str, request_ids: object) -> frozenset[str]:
            keeper.let_go("n1", "ending")
            await self.release("n1", "ending")
            return await super().renew(node, list(request_ids))  # type: ignore[call-overload]

    async def scenario() -> None:
        await granted(fake, keeper, "n1", "ending")
        await keeper.renew()
        assert metrics._lease_renewals.counts == {("renewed",): 0}

    clock = ManualClock()
    fake = Slow(clock, lease_s=LEASE_S)
    fake.add_node("n1", 100_000)
    metrics = GateMetrics()
    keeper = LeaseKeeper(fake, LEASE_S, metrics)
    asyncio.run(scenario())


def test_admission_renews_what_it_granted_until_the_request_releases_it() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        fake = fake_with_nodes(clock, "n1")
        admission = Admission(AdmissionConfig(), fake, clock=clock, lease_s=LEASE_S)
        route = Route("long", Reason.LONG, 20_000)
        admitted = await admission.admit(route, ModelConfig(), None, "req-1")
        assert admitted.ticket is not None
        assert admission.leases is not None and admission.leases.held("n1") == ("req-1",)
        await admission.release(admitted.ticket)
        assert admission.leases.held("n1") == ()

    asyncio.run(scenario())


def test_a_gate_that_stops_renewing_frees_its_kv_on_a_real_agent_within_one_lease() -> None:
    """Through gRPC: the gate's view reserves and renews on a real agent (on a manual clock, so the lease
    runs exactly); once the keeper stops, as a killed gate's would, the agent frees the KV one lease
    after the last renewal, not before."""

    async def scenario() -> None:
        clock = ManualClock()
        agent = Agent(
            NodeSettings("n1", "127.0.0.1:8000", period_s=0.05, capacity_tokens=40_000), clock=clock
        )
        port = await agent.start("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        view = HeadroomView(HeadroomSettings(agents=(address,), lease_s=LEASE_S))
        await view.start()
        keeper = LeaseKeeper(view, LEASE_S, GateMetrics())
        try:
            await until_async(lambda: _connected(view.snapshot()), "the view to follow the agent")
            outcome = await view.reserve(address, "req-1", 5_000)
            assert outcome.granted and outcome.lease_s == LEASE_S
            keeper.hold(address, "req-1")
            for _ in range(4):  # 4 periods: longer than a lease, renewed all along
                clock.advance(keeper.period_s)
                await keeper.renew()
            assert agent.state.ledger.reserved_tokens == 5_000
            clock.advance(LEASE_S - 0.01)  # the gate is gone: no more renewals
            assert agent.state.ledger.reserved_tokens == 5_000
            clock.advance(0.01)
            assert agent.state.ledger.reserved_tokens == 0
            assert await view.renew(address, ["req-1"]) == frozenset({"req-1"})  # a restarted gate's
            assert agent.state.ledger.reserved_tokens == 0
        finally:
            await view.stop()
            await agent.stop(grace_s=0.1)

    asyncio.run(scenario())


def test_an_unreachable_agent_is_a_failed_renewal_not_a_crash() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        fake = fake_with_nodes(clock, "n1")
        metrics = GateMetrics()
        keeper = LeaseKeeper(fake, LEASE_S, metrics)
        await granted(fake, keeper, "n1", "r")
        fake.disconnect("n1")
        with pytest.raises(HeadroomError):
            await fake.renew("n1", ["r"])
        await keeper.renew()
        assert metrics._lease_renewals.counts == {("error",): 1}
        assert keeper.held("n1") == ("r",)

    asyncio.run(scenario())


def _connected(nodes: tuple[NodeView, ...]) -> bool:
    return bool(nodes) and nodes[0].connected
