"""A tenant's own caps (issue 30, item 2; kvgate.policy.tenant_limits): a token quota per window that
takes the estimate at admission and settles on what ran, and a most share of the long pool's KV that
holds only while another tenant waits. Each refusal is a 429 with its own reason and a Retry-After."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_admission import MODEL, long_route, run, until

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.agent.ledger import Budget, ReservationLedger
from kvgate.agent.tenant_service import TenantService
from kvgate.config import AdmissionConfig, FairnessConfig, TenantConfig, TokenQuotaConfig, parse_config
from kvgate.errors import ConfigError
from kvgate.gate.admission import Admission, Admitted
from kvgate.headroom.snapshot import NodeView, ReleaseOutcome, TenantCharge
from kvgate.headroom.wire import HeadroomEncoder, headroom_from_proto, release_from_proto, release_to_proto
from kvgate.policy import Reason, Refusal
from kvgate.policy.refusals import RULES
from kvgate.policy.tenant_book import TenantBook
from kvgate.policy.tenant_limits import TenantLimits

QUOTA = TokenQuotaConfig(tokens=30_000, window_s=60.0)  # 500 tokens a second


def limits(**tenant: object) -> TenantLimits:
    config = FairnessConfig(tenants={"acme": TenantConfig(**tenant)})  # type: ignore[arg-type]
    return TenantLimits(TenantBook(config))


# --- the quota -----------------------------------------------------------------------------------


def test_a_quota_takes_each_estimate_and_says_when_the_bucket_holds_the_next_again() -> None:
    quota = limits(quota=QUOTA)
    assert quota.take_quota("acme", 20_000, 0.0) is None
    assert quota.take_quota("acme", 10_000, 0.0) is None
    assert quota.take_quota("acme", 5_000, 0.0) == pytest.approx(10.0), "5,000 tokens at 500 a second"
    assert quota.take_quota("acme", 5_000, 10.0) is None, "refilled by then"
    assert quota.take_quota("other", 50_000, 0.0) is None, "a tenant without a quota is not held"


def test_a_quota_settles_on_what_ran_and_gives_back_what_was_not_admitted() -> None:
    quota = limits(quota=QUOTA)
    assert quota.take_quota("acme", 30_000, 0.0) is None
    quota.give_back("acme", 8_000, 0.0)  # charged 10,000 of output, generated 2,000
    assert quota.take_quota("acme", 8_000, 0.0) is None
    quota.give_back("acme", -4_000, 0.0)  # generated 4,000 more than charged: an overdraft
    assert quota.take_quota("acme", 1, 0.0) == pytest.approx(4_001 / 500)


def test_a_request_larger_than_the_whole_quota_goes_only_on_a_full_bucket() -> None:
    quota = limits(quota=QUOTA)
    assert quota.take_quota("acme", 1_000, 0.0) is None
    assert quota.take_quota("acme", 40_000, 0.0) == pytest.approx(1_000 / 500), "until the bucket is full"
    assert quota.take_quota("acme", 40_000, 2.0) is None, "a full bucket lets it through"
    assert quota.take_quota("acme", 1_000, 2.0) == pytest.approx(11_000 / 500), "and it is overdrawn"


# --- the share -----------------------------------------------------------------------------------


def test_the_share_cap_holds_only_while_another_tenant_waits() -> None:
    share = limits(max_kv_share=0.5)
    share.hold("acme", 40_000)
    assert share.share_passed("acme", 20_000, 100_000, others_wait=False) is None, "work-conserving"
    assert share.share_passed("acme", 20_000, 100_000, others_wait=True) == 0.5
    assert share.share_passed("acme", 10_000, 100_000, others_wait=True) is None, "exactly half is allowed"
    share.let_go("acme", 40_000)
    assert share.share_passed("acme", 50_000, 100_000, others_wait=True) is None


def test_the_config_names_a_bad_cap() -> None:
    with pytest.raises(ConfigError, match=r"fairness\.tenants\.acme\.max_kv_share: must be <= 1"):
        parse_config("fairness: {tenants: {acme: {max_kv_share: 1.5}}}")
    with pytest.raises(ConfigError, match=r"fairness\.tenants\.acme\.quota: a quota needs tokens"):
        parse_config("fairness: {tenants: {acme: {quota: {window_s: 60}}}}")
    with pytest.raises(ConfigError, match=r"fairness\.default_quota\.window_s: must be >= 1"):
        parse_config("fairness: {default_quota: {tokens: 100, window_s: 0}}")
    config = parse_config(
        "fairness: {default_max_kv_share: 0.5,"
        " tenants: {acme: {quota: {tokens: 1000}}, big: {max_kv_share: 0.8}}}"
    ).fairness
    assert (config.max_kv_share("acme"), config.max_kv_share("big")) == (0.5, 0.8)
    assert config.quota("acme") == TokenQuotaConfig(1_000, 60.0) and config.quota("big") is None
    assert config.limits_tenants and not FairnessConfig().limits_tenants


def test_the_caps_refuse_with_429_and_their_own_reasons() -> None:
    for reason, code in (
        (Reason.TENANT_QUOTA, "tenant_quota_exceeded"),
        (Reason.TENANT_SHARE, "tenant_share_exceeded"),
    ):
        assert (RULES[reason].status, RULES[reason].code) == (429, code)


# --- in the gate's admission ---------------------------------------------------------------------


def admission_with(fairness: FairnessConfig) -> tuple[FakeHeadroom, ManualClock, Admission]:
    clock = ManualClock()
    source = FakeHeadroom(clock, stale_after_s=5.0)
    source.add_node("a", 100_000)
    return source, clock, Admission(AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=fairness)


async def ask(admission: Admission, tenant: str, request_id: str, tokens: int = 10_000) -> Admitted:
    return await admission.admit(
        long_route(tokens), MODEL, None, request_id, tenant=tenant, output_tokens=1_000
    )


def test_an_over_quota_request_gets_its_own_429_with_the_refill_as_retry_after_and_the_quota_settles() -> (
    None
):
    async def scenario() -> None:
        fairness = FairnessConfig(tenants={"acme": TenantConfig(quota=TokenQuotaConfig(20_000, 20.0))})
        source, clock, admission = admission_with(fairness)
        await admission.start()
        first, second = await ask(admission, "acme", "r0"), await ask(admission, "acme", "r1")
        refused = await ask(admission, "acme", "r2")
        other = await ask(admission, "someone-else", "r3")
        assert first.ticket is not None and second.ticket is not None and other.ticket is not None
        assert isinstance(refused.decision, Refusal) and refused.decision.reason is Reason.TENANT_QUOTA
        assert refused.decision.retry_after_s == pytest.approx(10.0), "10,000 tokens at 1,000 a second"
        # r0 generated 100 of its 1,000 output tokens: 900 come back, and 9,100 more refill in 9.1 s.
        await admission.release(first.ticket, generated_tokens=100)
        retried = await ask(admission, "acme", "r4")
        assert isinstance(retried.decision, Refusal) and retried.decision.retry_after_s == pytest.approx(9.1)
        clock.advance(9.1)
        source.tick()  # the agent's next message: the node stays fresh
        assert (await ask(admission, "acme", "r5")).ticket is not None
        await admission.stop()

    run(scenario)


class SettlingHeadroom(FakeHeadroom):
    """Agents that settle every released reservation on 100 output tokens, what a node's measured
    decode rate over the hold says when the gate did not read the answer; `publishing` False: agents
    that do not publish their tenants' tokens (each gate counts its own quota)."""

    def __init__(self, clock: ManualClock, *, publishing: bool = True) -> None:
        super().__init__(clock, stale_after_s=5.0)
        self._publishing = publishing

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        return await super().release(
            node, request_id, unanswered=unanswered, generated_tokens=generated_tokens or 100
        )

    def snapshot(self) -> tuple[NodeView, ...]:
        views = super().snapshot()
        if self._publishing:
            return views
        return tuple(
            dataclasses.replace(
                v, headroom=dataclasses.replace(v.headroom, tenant_tokens={}, publishes_tenant_tokens=False)
            )
            if v.headroom is not None
            else v
            for v in views
        )


@pytest.mark.parametrize("publishing", [True, False])
def test_an_unread_answer_settles_the_quota_on_what_the_agent_settled_the_reservation_on(
    publishing: bool,
) -> None:
    """As above, but the gate does not read the answer (an ext_proc gate behind Envoy): the quota gives
    back what the agent did not settle the output on, from the agents' tenant tokens where they publish
    them, else from the Release answer."""

    async def scenario() -> None:
        fairness = FairnessConfig(tenants={"acme": TenantConfig(quota=TokenQuotaConfig(20_000, 20.0))})
        clock = ManualClock()
        source = SettlingHeadroom(clock, publishing=publishing)
        source.add_node("a", 100_000)
        admission = Admission(AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=fairness)
        await admission.start()
        first, second = await ask(admission, "acme", "r0"), await ask(admission, "acme", "r1")
        assert first.ticket is not None and second.ticket is not None
        await admission.release(first.ticket)
        retried = await ask(admission, "acme", "r2")
        assert isinstance(retried.decision, Refusal) and retried.decision.retry_after_s == pytest.approx(9.1)
        await admission.stop()

    run(scenario)


def test_the_agent_answers_a_release_with_the_output_it_settled_on() -> None:
    clock = ManualClock()
    ledger = ReservationLedger(clock, 300.0, 300.0, decode_rate=lambda: 50.0)
    budget = Budget(100_000, 1.0, None, True, "")
    assert ledger.reserve("r0", 10_000, 300.0, budget, "gate", output_tokens=1_000).granted
    clock.advance(4.0)
    settled = ledger.output_generated("r0", "gate")
    outcome = ledger.release_answer(ledger.release("r0", "gate"), budget, settled)
    assert outcome.settled_output_tokens == 200, "4 s at 50 tokens a second, within the 1,000 declared"
    wire = pb.ReleaseResponse.FromString(release_to_proto(outcome).SerializeToString())
    assert release_from_proto(wire) == outcome
    assert ledger.release_answer(ledger.release("r0", "gate"), budget, 200).settled_output_tokens == 0


def test_a_request_cancelled_while_it_waits_gives_its_quota_back() -> None:
    """The node is full; acme's request waits, having taken 10,000 of its 10,000-token quota, and its
    stream goes away. Its estimate comes back: the next one is not refused by the quota."""

    async def scenario() -> None:
        fairness = FairnessConfig(tenants={"acme": TenantConfig(quota=TokenQuotaConfig(10_000, 3600.0))})
        _, _, admission = admission_with(fairness)
        await admission.start()
        blocker = await ask(admission, "other", "blocker", tokens=100_000)
        assert blocker.ticket is not None
        waiting = asyncio.create_task(ask(admission, "acme", "a0"))
        await until(lambda: admission.gauges().waiting == 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await admission.release(blocker.ticket)
        assert (await ask(admission, "acme", "a1")).ticket is not None
        await admission.stop()

    run(scenario)


def test_a_tenant_past_its_share_is_refused_only_while_another_waits() -> None:
    """acme may hold half of 100,000 while others wait. It takes 60,000 while alone (work-conserving);
    once b's request waits for room, acme's next is refused with its own reason, not made to wait."""

    async def scenario() -> None:
        fairness = FairnessConfig(tenants={"acme": TenantConfig(max_kv_share=0.5)})
        _, _, admission = admission_with(fairness)
        await admission.start()
        held = [await ask(admission, "acme", f"a{i}", tokens=20_000) for i in range(3)]
        assert all(a.ticket is not None for a in held), "alone, acme takes what is free"
        waiting = asyncio.create_task(ask(admission, "b", "b0", tokens=50_000))
        await until(lambda: admission.gauges().waiting == 1)
        refused = await ask(admission, "acme", "a3", tokens=20_000)
        assert isinstance(refused.decision, Refusal) and refused.decision.reason is Reason.TENANT_SHARE
        assert refused.decision.retry_after_s is not None
        for admitted in held:
            assert admitted.ticket is not None
            await admission.release(admitted.ticket)
        assert (await waiting).ticket is not None
        await admission.stop()

    run(scenario)


# --- across replicas -----------------------------------------------------------------------------


def test_the_agent_counts_each_tenants_held_tokens_and_they_travel_in_the_stream() -> None:
    service = TenantService()
    service.granted("r1", TenantCharge("a", 12_000.0, 2.0), 1_000, 11_000)
    service.granted("r2", TenantCharge("a", 3_000.0, 2.0), 0, 3_000)
    service.ended("r1", generated_tokens=10)
    assert service.held() == {"a": 3_000}
    service.ended("r2")
    assert service.held() == {}

    source = FakeHeadroom(ManualClock())
    source.add_node("n", 1_000)
    plain = source.snapshot()[0].headroom
    assert plain is not None
    wired = headroom_from_proto(
        pb.NodeHeadroom.FromString(HeadroomEncoder().encode(dataclasses.replace(plain, tenant_held={"a": 7})))
    )
    assert wired.tenant_held == {"a": 7}


def test_the_agent_counts_each_tenants_reserved_tokens_settled_on_what_ran() -> None:
    service = TenantService()
    service.granted("r1", TenantCharge("a", 12_000.0, 2.0), 1_000, 11_000, reserved=12_000)
    service.granted("r2", TenantCharge("a", 3_000.0, 2.0), 0, 3_000, reserved=3_000)
    service.granted("r3", TenantCharge("b", 5_000.0, 2.0), 500, 5_000, reserved=5_000)
    assert service.tokens() == {"a": 15_000, "b": 5_000}
    service.ended("r1", generated_tokens=100)
    assert service.tokens() == {"a": 14_100, "b": 5_000}, "r1 ran 100 of its 1,000 output tokens"
    service.ended("r3", ran=False)
    assert service.tokens() == {"a": 14_100, "b": 0}, "a grant that ran nothing is taken back"
    service.ended("r2")
    assert service.tokens()["a"] == 14_100, "no output budget, no figure: as reserved"

    source = FakeHeadroom(ManualClock())
    source.add_node("n", 1_000)
    plain = source.snapshot()[0].headroom
    assert plain is not None and plain.publishes_tenant_tokens
    wired = headroom_from_proto(
        pb.NodeHeadroom.FromString(
            HeadroomEncoder().encode(dataclasses.replace(plain, tenant_tokens={"a": 7}))
        )
    )
    assert wired.tenant_tokens == {"a": 7} and wired.publishes_tenant_tokens


def test_a_tenants_share_counts_what_every_replica_granted_it() -> None:
    """Two gate replicas share one agent. Replica one admits acme 60,000 of 100,000; on replica two,
    with b waiting there, acme's next request is refused by its share although replica two granted it
    nothing: the agent's held tokens say what acme holds."""

    async def scenario() -> None:
        clock = ManualClock()
        source = FakeHeadroom(clock, stale_after_s=5.0)
        source.add_node("a", 100_000)
        fairness = FairnessConfig(tenants={"acme": TenantConfig(max_kv_share=0.5)})
        one, two = (
            Admission(AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=fairness)
            for _ in range(2)
        )
        for replica in (one, two):
            await replica.start()
        held = [await ask(one, "acme", f"a{i}", tokens=20_000) for i in range(3)]
        assert all(a.ticket is not None for a in held)
        waiting = asyncio.create_task(ask(two, "b", "b0", tokens=50_000))
        await until(lambda: two.gauges().waiting == 1)
        refused = await ask(two, "acme", "a3", tokens=20_000)
        assert isinstance(refused.decision, Refusal) and refused.decision.reason is Reason.TENANT_SHARE
        for admitted in held:
            assert admitted.ticket is not None
            await one.release(admitted.ticket)
        assert (await waiting).ticket is not None
        for replica in (one, two):
            await replica.stop()

    run(scenario)


@pytest.mark.parametrize(("publishing", "refused"), [(True, True), (False, False)])
def test_a_tenants_quota_counts_what_every_replica_granted_it(publishing: bool, refused: bool) -> None:
    """Two gate replicas share one agent, and acme has 30,000 tokens a minute. Replica one admits two
    of its 10,000-token requests; replica two then refuses the third of them with the quota's 429 and
    Retry-After, by the agent's tenant tokens, though it admitted acme nothing itself. Agents that do
    not publish them leave each replica its own whole quota."""

    async def scenario() -> None:
        clock = ManualClock()
        source = SettlingHeadroom(clock, publishing=publishing)
        source.add_node("a", 1_000_000)
        fairness = FairnessConfig(tenants={"acme": TenantConfig(quota=TokenQuotaConfig(30_000, 60.0))})
        one, two = (
            Admission(AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=fairness)
            for _ in range(2)
        )
        for replica in (one, two):
            await replica.start()
        assert (await ask(two, "acme", "warm-up", tokens=5_000)).ticket is not None
        held = [await ask(one, "acme", f"a{i}") for i in range(2)]
        assert all(a.ticket is not None for a in held)
        third = await ask(two, "acme", "a2")
        if refused:
            assert isinstance(third.decision, Refusal) and third.decision.reason is Reason.TENANT_QUOTA
            assert third.decision.retry_after_s == pytest.approx(5_000 / 500), "5,000 short at 500 a second"
        else:
            assert third.ticket is not None
        for replica in (one, two):
            await replica.stop()

    run(scenario)
