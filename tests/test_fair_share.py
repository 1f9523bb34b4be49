"""Fair shares between tenants (kvgate.policy.fair_share): VTC's counters hold the service gap between
backlogged tenants to its bound on generated sequences, idling banks no credit, weights divide the
service, and the gate's line of waiters goes by them (kvgate.gate.admission)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any, cast

import pytest
from fixtures.engines.pages import Vllm
from test_admission import MODEL, long_route, run, until
from test_agent_push import Engine, followed, settings
from waiting import until_async

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.server import Agent
from kvgate.agent.sources.engines import read_engine_page
from kvgate.agent.tenant_service import TenantService
from kvgate.config import AdmissionConfig, FairnessConfig, TenantConfig, parse_config
from kvgate.errors import ConfigError
from kvgate.gate.admission import Admission, Admitted
from kvgate.headroom.snapshot import HeadClaim, ReserveOutcome, TenantCharge
from kvgate.headroom.wire import HeadroomEncoder, charge_from_proto, headroom_from_proto, reserve_request
from kvgate.names import OTHER_TENANTS
from kvgate.policy import Reason, Refusal
from kvgate.policy.fair_share import ACTIVE_S, FairShare
from kvgate.queue.fairness import NOTHING_TO_SETTLE
from kvgate.telemetry import GateMetrics, TenantLabels


def serve(fair: FairShare, queues: dict[str, list[float]], steps: int) -> list[dict[str, float]]:
    """Admit `steps` requests one at a time, each the head of the tenant with the least counter
    (ties: the tenant named first); every tenant in `queues` stays backlogged. The weighted service
    each has attained after every step."""
    served = dict.fromkeys(queues, 0.0)
    history = []
    for tenant in queues:
        fair.waits(tenant)
    for _ in range(steps):
        tenant = min(queues, key=fair.counter)
        cost = queues[tenant].pop(0)
        fair.charge(tenant, cost)
        served[tenant] += cost / FAIR.weight(tenant)
        history.append(dict(served))
    return history


FAIR = FairnessConfig(enabled=True, tenants={"heavy": TenantConfig(3.0)})
LOW = 2  # a rank below the default's 0: a batch tenant's


@pytest.mark.parametrize("seed", range(20))
def test_the_service_gap_between_backlogged_tenants_stays_within_twice_the_largest_cost(seed: int) -> None:
    draw = random.Random(seed)
    fair = FairShare(FAIR)
    # Costs of prompt + 2 x output, from chat-sized to 30k-token prompts; weight 1 and 3 tenants.
    queues = {
        name: [fair.cost(draw.randint(500, 30_000), draw.randint(0, 2_000)) for _ in range(400)]
        for name in ("a", "b", "heavy")
    }
    largest = max(cost / FAIR.weight(name) for name, costs in queues.items() for cost in costs)
    for served in serve(fair, queues, 600):
        assert max(served.values()) - min(served.values()) <= 2 * largest


def test_a_tenant_back_from_idle_is_lifted_and_takes_no_burst_of_credit() -> None:
    fair = FairShare(FAIR)
    serve(fair, {"a": [1_000.0] * 100, "b": [1_000.0] * 100}, 100)  # a and b: 50,000 each
    fair.done_waiting("a")
    fair.done_waiting("b")
    assert fair.counter("late") == 0.0
    fair.waits("a")
    fair.waits("late")  # never served: lifted to the least counter of those waiting
    assert fair.counter("late") == fair.counter("a") == 50_000.0
    fair.done_waiting("a")
    fair.done_waiting("late")
    fair.waits("idle")  # nobody waits: lifted to the last one served
    assert fair.counter("idle") == 50_000.0


def test_a_tenant_served_by_another_replica_keeps_its_lead_when_it_comes_to_this_ones_line() -> None:
    """This replica's line holds a alone; c's requests wait at another replica, which serves them.
    c's first request here is not lifted to a's counter (that took c's lead away each time its
    requests changed line: measured, 0.7-0.9x their share with two gates); it keeps a lead of up to
    the largest request. A tenant nobody served for ACTIVE_S is idle, and lifted all the way."""
    now = [0.0]
    fair = FairShare(FAIR, clock=lambda: now[0])
    fair.charge("a", 10_000.0)  # the largest request yet
    fair.waits("a")
    fair.observe({"a": 50_000.0, "c": 20_000.0, "d": 20_000.0})
    now[0] += ACTIVE_S + 1.0
    fair.observe({"a": 50_000.0, "c": 30_000.0, "d": 20_000.0})  # c served elsewhere; d nowhere
    fair.waits("c")
    assert fair.counter("c") == 50_000.0 - 10_000.0
    fair.waits("d")
    assert fair.counter("d") == 40_000.0, "lifted to the least counter of the others: c's, now"


def test_a_tenant_served_but_waiting_for_nothing_is_no_floor_for_a_lift() -> None:
    """The start of the fairness run: the empty pool granted each arrival as it came, two of a's
    largest requests and a small one of c's, b's and d's. Then a waits, and c starts waiting: c is
    lifted to within the largest cost of a's counter, the least of those waiting (c was served lately,
    so it keeps a lead of up to one request). b and d were served but wait for nothing. As floors
    ("active"), they kept c 21k behind a, and c's repayment of that lead while both waited set the
    one-gate runs' largest service gap, up to 1.24x VTC's bound."""
    fair = FairShare(FAIR)
    for tenant, cost in (("a", 12_000.0), ("c", 3_000.0), ("a", 12_000.0), ("b", 3_000.0), ("d", 3_000.0)):
        fair.charge(tenant, cost)
    fair.waits("a")
    fair.waits("c")
    assert fair.counter("c") == fair.counter("a") - 12_000.0 == 12_000.0


def test_the_heads_the_agents_hold_room_for_are_floors_of_a_lift() -> None:
    """Nothing waits in this replica's line, but another replica's head waits at 40,000 for room on a
    node: a tenant that starts waiting here is lifted to it, not to the last one this replica served.
    A head of a lower priority is no floor."""
    fair = FairShare(FAIR)
    fair.charge("a", 5_000.0)
    fair.observe({"a": 5_000.0}, heads=[(0, 40_000.0), (LOW, 1_000.0)])
    fair.waits("new")
    assert fair.counter("new") == 40_000.0
    fair.waits("batch", LOW)
    assert fair.counter("batch") == 1_000.0, "its own rank's head is a floor"


def test_a_tenant_one_replica_lifts_is_lifted_in_every_replica() -> None:
    """b asks less than its part and is served at once each time it comes back, on the first replica,
    which lifts it to the others' level each time; the second replica never had b wait. Without the
    first replica's lifts, b's counter there lagged by all of them, and since b was active it was the
    floor of d's lift when d came back from idle: d then led a and c by that lag (the two-replica
    fairness run, 2026-12-04: d took 140k weighted tokens in 25 s to their 50k). The agent passes
    each grant's lift on (TenantCharge.lift, NodeHeadroom.tenant_lift), so the second replica's
    counters are the first's."""
    now = [0.0]
    agent = TenantService()
    first = FairShare(FAIR, clock=lambda: now[0])
    second = FairShare(FAIR, clock=lambda: now[0])

    def grant(replica: FairShare, request_id: str, tenant: str, cost: float) -> None:
        agent.granted(request_id, TenantCharge(tenant, cost, 2.0, replica.lift_cost(tenant)), 0)
        replica.charge(tenant, cost)
        for each in (first, second):
            each.observe(agent.totals(), agent.lifts())

    for n in range(10):  # a and c: 100,000 each; b comes back every 10,000 and is lifted level
        grant(second, f"a{n}", "a", 10_000.0)
        grant(second, f"c{n}", "c", 10_000.0)
        first.waits("a")
        first.waits("b")
        grant(first, f"b{n}", "b", 2_000.0)
        first.done_waiting("b")
        first.done_waiting("a")
    assert first.counter("b") == 100_000.0, "lifted to within its own cost of a and c, then charged it"
    assert second.counter("b") == first.counter("b"), "b's lifts, from the agent"
    second.waits("a")
    second.waits("c")
    now[0] += 1.0  # b was served just now: active, though it waits nowhere
    second.waits("d")  # back from idle
    assert second.counter("d") == 100_000.0, "lifted level with b as the first replica counts it, not 20,000"


def test_a_lower_prioritys_lagging_counter_is_no_floor_for_a_lift_nor_a_bar_to_backfill() -> None:
    """The fairness scenario's batch tenant F waits at a low priority all run, so its counter lags the
    others'. Counted in the floor, it kept a tenant back from 60 s off at its old counter (its whole
    lead, a service gap of 41k against a bound of 24.5k), and no small request could pass the line."""
    now = [0.0]
    fair = FairShare(FAIR, clock=lambda: now[0])
    serve(fair, {"a": [1_000.0] * 100, "b": [1_000.0] * 100}, 100)  # a and b: 50,000 each
    fair.charge("batch", 5_000.0)
    fair.waits("batch", LOW)
    fair.charge("onoff", 20_000.0)
    now[0] += ACTIVE_S + 1.0  # onoff idles
    fair.waits("onoff")
    assert fair.counter("onoff") == 50_000.0, "lifted to a and b, not left at its own 20,000"
    assert fair.may_pass("a", 1_000.0), "within a request of the least normal counter, not the batch's"


@pytest.mark.parametrize("seed", range(10))
def test_an_on_and_off_tenant_beside_a_waiting_batch_stays_within_the_bound_of_the_flood(seed: int) -> None:
    """Generated sequences: tenants a (a flood) and b always wait, `batch` waits at a low priority and
    is served only when no one else waits, and `onoff` comes and goes, idle for longer than ACTIVE_S
    each time. Between any two normal tenants, over every stretch both wait, the weighted service they
    attain differs by at most twice the largest cost (VTC's bound), whatever the batch tenant's
    counter."""
    draw = random.Random(seed)
    now = [0.0]
    fair = FairShare(FAIR, clock=lambda: now[0])
    fair.waits("batch", LOW)
    fair.charge("batch", 1_000.0)
    normal = ("a", "b", "onoff")
    for tenant in normal:
        fair.waits(tenant)
    waiting = set(normal)
    largest = 0.0
    stretch: dict[str, float] = {}
    for _ in range(800):
        if draw.random() < 0.05:  # onoff goes off or comes back
            if "onoff" in waiting:
                fair.done_waiting("onoff")
                waiting.discard("onoff")
            else:
                now[0] += ACTIVE_S + 1.0
                fair.waits("onoff")
                waiting.add("onoff")
                stretch = {}
        tenant = min(waiting, key=fair.order)
        cost = fair.cost(draw.randint(1_000, 12_000), draw.randint(0, 512))
        largest = max(largest, cost)
        fair.charge(tenant, cost)
        for name in waiting:
            stretch[name] = stretch.get(name, 0.0)
        stretch[tenant] += cost
        if "onoff" in waiting:
            assert max(stretch.values()) - min(stretch.values()) <= 2 * largest
    assert fair.counter("batch") == 1_000.0


def test_weights_divide_the_contended_service() -> None:
    fair = FairShare(FAIR)
    history = serve(fair, {"a": [3_000.0] * 400, "heavy": [3_000.0] * 400}, 400)
    unweighted = {"a": history[-1]["a"], "heavy": history[-1]["heavy"] * 3.0}
    share = unweighted["heavy"] / sum(unweighted.values())
    assert 0.74 <= share <= 0.76, share


def test_a_charge_is_settled_on_what_the_engine_generated() -> None:
    fair = FairShare(FAIR)
    fair.charge("a", fair.cost(10_000, 4_000))  # a 4,000-token budget, over-declared 4x
    fair.settle("a", 4_000, 1_000)
    assert fair.counter("a") == 10_000 + 2 * 1_000
    fair.charge("heavy", fair.cost(3_000, 0))
    fair.settle("heavy", 0, 300)  # weight 3: 600 / 3
    assert fair.counter("heavy") == 1_000 + 200


def test_memory_is_bounded_and_forgets_an_idle_tenant_first() -> None:
    fair = FairShare(FAIR, max_tenants=3)
    fair.waits("busy")
    for name in ("x", "y", "z", "w"):
        fair.charge(name, 10.0)
    fair.charge("busy", 1.0)
    assert fair.counter("busy") == 1.0, "a tenant that waits is never forgotten"
    assert sum(fair.counter(t) > 0 for t in ("x", "y", "z", "w")) == 2


def test_the_config_names_a_bad_weight() -> None:
    with pytest.raises(ConfigError, match=r"fairness\.tenants\.acme\.weight: must be >= 0\.01"):
        parse_config("fairness: {enabled: true, tenants: {acme: {weight: 0}}}")
    with pytest.raises(ConfigError, match=r"fairness\.tenants\.acme\.share: unknown key"):
        parse_config("fairness: {tenants: {acme: {share: 2}}}")
    config = parse_config("fairness: {enabled: true, default_weight: 2, tenants: {acme: {weight: 5}}}")
    assert (config.fairness.weight("acme"), config.fairness.weight("other")) == (5.0, 2.0)


def admission_with(
    fairness: FairnessConfig, queue_size: int = 64
) -> tuple[FakeHeadroom, ManualClock, Admission]:
    clock = ManualClock()
    source = FakeHeadroom(clock, stale_after_s=5.0)
    source.add_node("a", 20_000)
    settings = AdmissionConfig(max_wait_s=60.0, queue_size=queue_size)
    return source, clock, Admission(settings, source, clock=clock, fairness=fairness)


async def ask(admission: Admission, tenant: str, request_id: str) -> Admitted:
    return await admission.admit(long_route(10_000), MODEL, None, request_id, tenant=tenant)


@pytest.mark.parametrize(
    ("enabled", "order"), [(True, ["b0", "a2", "b1", "a3"]), (False, ["a2", "a3", "b0", "b1"])]
)
def test_the_gates_line_goes_by_attained_service_with_fair_shares_and_by_arrival_without(
    enabled: bool, order: list[str]
) -> None:
    """Room for two requests at a time. Tenant a takes both and queues two more; then b queues two.
    With fair shares b starts waiting lifted to a's counter (idle time banks nothing); level, b was
    served less in fact, so it goes first, then a and b alternate as each is charged; without, a's
    arrivals all go first."""

    async def scenario() -> list[str]:
        _, _, admission = admission_with(FairnessConfig(enabled=enabled))
        await admission.start()
        running = [await ask(admission, "a", "a0"), await ask(admission, "a", "a1")]
        waiting = {}
        for tenant, rid in (("a", "a2"), ("a", "a3"), ("b", "b0"), ("b", "b1")):
            waiting[rid] = asyncio.create_task(ask(admission, tenant, rid))
            queued = len(waiting)
            await until(lambda queued=queued: admission.gauges().waiting == queued)
        admitted: list[str] = []
        for _ in range(4):
            ticket = running.pop(0).ticket
            assert ticket is not None
            await admission.release(ticket)
            await until(lambda: any(t.done() and rid not in admitted for rid, t in waiting.items()))
            (done,) = [rid for rid, t in waiting.items() if t.done() and rid not in admitted]
            admitted.append(done)
            running.append(waiting[done].result())
        await admission.stop()
        return admitted

    assert run(scenario) == order


def test_a_full_line_turns_away_the_flooding_tenants_newest_waiter_not_the_least_served_tenant() -> None:
    """A fills the line (two places) while its requests run; b's request then goes ahead of A's
    newest in the fair order and takes its place, and A's newest is the one refused."""

    async def scenario() -> None:
        _, _, admission = admission_with(FairnessConfig(enabled=True), queue_size=2)
        await admission.start()
        running = [await ask(admission, "a", "a0"), await ask(admission, "a", "a1")]
        assert all(r.ticket is not None for r in running)
        first = asyncio.create_task(ask(admission, "a", "a2"))
        await until(lambda: admission.gauges().waiting == 1)
        newest = asyncio.create_task(ask(admission, "a", "a3"))
        await until(lambda: admission.gauges().waiting == 2)
        light = asyncio.create_task(ask(admission, "b", "b0"))
        pushed = await newest
        assert isinstance(pushed.decision, Refusal) and pushed.decision.reason is Reason.QUEUE_FULL
        await until(lambda: admission.gauges().waiting == 2)
        assert not first.done() and not light.done()
        for task in (first, light):
            task.cancel()
        await asyncio.gather(first, light, return_exceptions=True)
        await admission.stop()

    run(scenario)


class SlowAnswers:
    """The agents as they are, but the answers to Reserves wait until `answer` is set: the agent has
    granted, and the grant is on its way back to the gate."""

    def __init__(self, inner: FakeHeadroom) -> None:
        self.inner = inner
        self.answer = asyncio.Event()
        self.answer.set()
        self.answered = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def reserve(self, *args: Any, **kwargs: Any) -> ReserveOutcome:
        outcome = await self.inner.reserve(*args, **kwargs)
        await self.answer.wait()
        self.answered += 1
        return outcome


def test_a_head_that_loses_its_place_while_its_reserve_is_granted_keeps_the_grant() -> None:
    """The head (a) holds its place on the node and asks again as room frees; while the grant is on
    its way back, b's request goes ahead of it in the fair order. Letting a's claim go then with a
    Release of its id ended the grant the Reserve had just made: the gate sent a's request to a node
    that held nothing for it (an OOM crash on the fairness benchmark, two runs of four). The claim is
    let go once the answer is in, and only if it was no grant."""

    async def scenario() -> None:
        clock = ManualClock()
        inner = FakeHeadroom(clock, stale_after_s=5.0)
        inner.add_node("a", 20_000)
        source = SlowAnswers(inner)
        admission = Admission(
            AdmissionConfig(max_wait_s=60.0),
            cast(FakeHeadroom, source),
            clock=clock,
            fairness=FairnessConfig(enabled=True),
        )
        await admission.start()
        blocker = await admission.admit(long_route(15_000), MODEL, None, "a0", tenant="a")
        assert blocker.ticket is not None
        head = asyncio.create_task(admission.admit(long_route(10_000), MODEL, None, "a1", tenant="a"))
        await until(lambda: admission.gauges().waiting == 1 and source.answered == 2)  # it holds its place
        source.answer.clear()
        await admission.release(blocker.ticket)  # room: the head's next Reserve is granted
        await until(lambda: inner.reserved_tokens("a") == 10_000)
        newcomer = asyncio.create_task(admission.admit(long_route(15_000), MODEL, None, "b0", tenant="b"))
        await until(lambda: admission.gauges().waiting == 2)
        source.answer.set()
        admitted = await head
        assert admitted.ticket is not None
        for _ in range(50):
            await asyncio.sleep(0)
        assert inner.reserved_tokens("a") == 10_000, "the head's grant was given back behind its back"
        assert not newcomer.done()
        newcomer.cancel()
        await asyncio.gather(newcomer, return_exceptions=True)
        await admission.stop()

    run(scenario)


def test_tenant_labels_are_bounded_and_keep_the_named_ones() -> None:
    label = TenantLabels(named={"acme"}, limit=2)
    assert [label(t) for t in ("a", "b", "c", "acme", "a", "d")] == [
        "a",
        "b",
        OTHER_TENANTS,
        "acme",
        "a",
        OTHER_TENANTS,
    ]


def test_each_tenants_long_requests_are_counted_by_outcome_and_service() -> None:
    async def scenario() -> GateMetrics:
        metrics = GateMetrics()
        clock = ManualClock()
        source = FakeHeadroom(clock, stale_after_s=5.0)
        source.add_node("a", 20_000)
        fairness = FairnessConfig(enabled=True, output_weight=2.0)
        admission = Admission(
            AdmissionConfig(max_wait_s=0.0), source, telemetry=metrics, clock=clock, fairness=fairness
        )
        await admission.start()
        route = long_route(12_000)
        first = await admission.admit(route, MODEL, None, "r1", output_tokens=2_000, tenant="acme")
        refused = await admission.admit(route, MODEL, None, "r2", output_tokens=2_000, tenant="beta")
        assert first.ticket is not None and refused.ticket is None
        # beta was refused at once: it never waited nor was served, so it has no counter to show.
        assert admission.gauges().tenants == (("acme", 10_000 + 2 * 2_000, 0),)
        await admission.release(first.ticket, generated_tokens=500)
        await admission.stop()
        return metrics

    metrics = run(scenario)
    assert metrics._tenant_requests.counts == {("acme", "at_once"): 1, ("beta", "no_capacity"): 1}
    assert metrics._tenant_service.counts == {("acme",): 10_000 + 2 * 500}


def test_a_request_reserved_on_the_safe_side_of_a_threshold_is_charged_its_likeliest_prompt() -> None:
    """Without a tokenizer a prompt near a threshold is reserved as past it (kvgate.estimate); its
    tenant is charged the estimate itself, here 3,000 where 3,585 was reserved."""

    async def scenario() -> float:
        _, _, admission = admission_with(FairnessConfig(enabled=True))
        await admission.start()
        admitted = await admission.admit(
            long_route(4_097), MODEL, None, "r1", output_tokens=512, tenant="c", charged_prompt_tokens=3_000
        )
        assert admitted.ticket is not None
        await admission.stop()
        return counters(admission)["c"]

    assert run(scenario) == 3_000 + 2 * 512


def test_the_agent_keeps_each_tenants_service_and_settles_it_on_what_ran() -> None:
    service = TenantService(max_tenants=2)
    service.granted("r1", TenantCharge("a", 10_000 + 2 * 4_000, 2.0), 4_000)
    service.granted("r2", TenantCharge("b", 3_000, 2.0), 0)
    service.ended("r1", generated_tokens=1_000)  # 3,000 fewer output tokens than charged, at 2 each
    service.ended("r2")  # nothing read: as charged
    assert service.totals() == {"a": 12_000.0, "b": 3_000.0}
    service.granted("r3", TenantCharge("c", 50_000, 2.0), 0)  # past 2 tenants: the least served goes
    assert service.totals() == {"a": 12_000.0, "c": 50_000.0}


def test_an_older_waiter_behind_the_fair_head_cannot_take_the_room_the_head_waits_for() -> None:
    """The agents order waiters by arrival; a gate with fair shares orders its line by attained
    service. Tenant a waits first for 10,000 tokens, b next for 15,000; another replica's grant to a
    puts b at the head. When 14,000 tokens free, a fits and b does not, and a is close enough to b's
    counter to go ahead of the line (within the largest cost, 12,000). Were a's try to name its
    arrival, the agent would count it ahead of b's claim and grant it, pushing b back. It names no
    wait, so it may only backfill beside b's slot: b goes first, then a."""

    async def scenario() -> list[str]:
        clock = ManualClock()
        source = FakeHeadroom(clock, stale_after_s=5.0)
        source.add_node("n", 30_000)
        source.add_node("small", 100)  # where the other replica's grant lands
        admission = Admission(
            AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=FairnessConfig(enabled=True)
        )
        await admission.start()

        async def admit(tenant: str, request_id: str, tokens: int) -> Admitted:
            return await admission.admit(long_route(tokens), MODEL, None, request_id, tenant=tenant)

        blockers = [await admit("c", "c1", 12_000), await admit("c", "c2", 16_000)]
        assert all(b.ticket is not None for b in blockers)
        admitted: list[str] = []
        waiting = {}
        for tenant, request_id, tokens in (("a", "a-big", 10_000), ("b", "b-big", 15_000)):
            waiting[request_id] = asyncio.create_task(admit(tenant, request_id, tokens))
            waiting[request_id].add_done_callback(lambda _, rid=request_id: admitted.append(rid))
            count = len(waiting)
            await until(lambda count=count: admission.gauges().waiting == count)
        other = await source.reserve("small", "elsewhere", 1, charge=TenantCharge("a", 1_000.0, 2.0))
        assert other.granted
        await source.release("small", "elsewhere")
        await until(lambda: counters(admission)["a"] > counters(admission)["b"])
        await until(lambda: ("n", "b-big", True) in source.reserves)  # b holds its place on n
        woken = admission.waiters_woken
        await admission.release(blockers[0].ticket)  # 14,000 free: a fits, b does not
        await until(lambda: admission.waiters_woken > woken)
        for _ in range(100):  # the loop runs what the wake started; no time passes
            await asyncio.sleep(0)
        await admission.release(blockers[1].ticket)
        await until(lambda: bool(admitted))
        first = waiting[admitted[0]].result()
        assert first.ticket is not None
        await admission.release(first.ticket)
        await until(lambda: len(admitted) == 2)
        await admission.stop()
        return admitted

    assert run(scenario) == ["b-big", "a-big"]


def test_an_unread_release_settles_on_what_the_engine_was_measured_to_generate_not_the_budget() -> None:
    """A gate that does not read answers (the ext_proc gate, not the endpoint picker) releases saying
    nothing of the output. The tenant declared 2,000 output tokens and was charged them; its request
    held 4 s on an engine measured at 50 tokens a second per running request: it is settled at 200.
    A release that read the answer settles on the answer's count."""
    clock = ManualClock(0.0)
    settings = NodeSettings("n", "e:1", safety_ratio=1.0, capacity_tokens=100_000)
    state = NodeState(settings, clock, uses_engine=True, uses_nvml=False)

    def scrape(generated: int) -> None:
        page = Vllm(blocks=(6250,), usage=(0.01,), running=(1,), generation=(generated,))
        state.observe_engine(read_engine_page(page.page()))

    for t in range(12):
        scrape(50 * t)
        clock.advance(1.0)
    for request_id, tenant in (("unread", "a"), ("read", "b")):
        charge = TenantCharge(tenant, 5_000 + 2 * 2_000, 2.0)
        assert state.reserve(request_id, 7_000, 0, output_tokens=2_000, charge=charge).granted
    clock.advance(4.0)
    state.release("unread")
    state.release("read", generated_tokens=120)
    assert state.tenant_service.totals() == {"a": 5_000 + 2 * 200, "b": 5_000 + 2 * 120}


def test_a_grant_that_ran_nothing_is_taken_back_and_a_queued_job_is_charged_its_estimate_once() -> None:
    """A grant whose Reserve went unanswered, or that the queue gives back because another replica won
    the job, ran nothing: the agent takes its tenant's charge back whole. Two queue replicas reserving
    for the same job would otherwise charge its tenant twice. A job stored without its charge (schema 2)
    is charged its whole estimate, output budget included, and settles nothing on top of it however
    long it held."""
    clock = ManualClock(0.0)
    settings = NodeSettings("n", "e:1", safety_ratio=1.0, capacity_tokens=100_000)
    state = NodeState(settings, clock, uses_engine=True, uses_nvml=False)
    for t in range(12):
        page = Vllm(blocks=(6250,), usage=(0.01,), running=(1,), generation=(50 * t,))
        state.observe_engine(read_engine_page(page.page()))
        clock.advance(1.0)
    assert state.reserve(
        "won", 3_512, 0, "queue-0", charge=TenantCharge("c", 3_512.0, NOTHING_TO_SETTLE)
    ).granted
    assert state.reserve(
        "lost", 3_512, 0, "queue-1", charge=TenantCharge("c", 3_512.0, NOTHING_TO_SETTLE)
    ).granted
    assert state.tenant_service.totals() == {"c": 2 * 3_512.0}
    state.release("lost", "queue-1", unanswered_reserve=True)
    clock.advance(4.0)
    state.release("won", "queue-0")
    assert state.tenant_service.totals() == {"c": 3_512.0}


def test_the_service_totals_travel_in_the_stream_and_a_reserve_carries_its_charge() -> None:
    source = FakeHeadroom(ManualClock())
    source.add_node("n", 1_000)
    plain = source.snapshot()[0].headroom
    assert plain is not None
    head = HeadClaim(500, 7, 1, 2.0, fair_service=3_000.5)
    headroom = dataclasses.replace(plain, tenant_service={"a": 1.5}, tenant_lift={"a": 700.0}, head=head)
    wired = headroom_from_proto(pb.NodeHeadroom.FromString(HeadroomEncoder().encode(headroom)))
    assert wired.tenant_service == {"a": 1.5}
    assert wired.tenant_lift == {"a": 700.0}
    assert wired.head == head, "the head's place in the fair order travels with it"
    charge = TenantCharge("a", 180.0, 2.0, lift=900.0)
    request = reserve_request("r", 100, 30.0, "gate", None, charge=charge, fair_service=42.5)
    wire = pb.ReserveRequest.FromString(request.SerializeToString())
    assert charge_from_proto(wire) == TenantCharge("a", 180.0, 2.0, lift=900.0)
    assert wire.fair_service == 42.5
    assert charge_from_proto(reserve_request("r", 100, 30.0, "gate", None)) is None


def counters(admission: Admission) -> dict[str, float]:
    return {tenant: attained for tenant, attained, _ in admission.gauges().tenants}


def test_a_replica_orders_its_line_by_the_service_the_agents_saw_from_every_replica() -> None:
    """On this replica a, then b, wait for the room a blocker holds, level (b lifted to a's counter).
    Another replica's grant to a reaches the agent, whose totals then show a ahead: b goes first
    when the room frees. By this replica's own charges alone, a's arrival would."""

    async def scenario() -> list[str]:
        clock = ManualClock()
        source = FakeHeadroom(clock, stale_after_s=5.0)
        source.add_node("a", 20_000)
        source.add_node("small", 100)  # too small for this replica's requests; the other's fits
        admission = Admission(
            AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=FairnessConfig(enabled=True)
        )
        await admission.start()
        blocker = await ask(admission, "c", "blocker")
        blocker2 = await ask(admission, "c", "blocker2")
        assert blocker.ticket is not None and blocker2.ticket is not None
        waiting = {"a-here": asyncio.create_task(ask(admission, "a", "a-here"))}
        await until(lambda: admission.gauges().waiting == 1)
        waiting["b-here"] = asyncio.create_task(ask(admission, "b", "b-here"))
        await until(lambda: admission.gauges().waiting == 2)
        # Another replica's grant to tenant a, as its Reserve reaches the agent.
        other = await source.reserve("small", "elsewhere", 1, charge=TenantCharge("a", 50_000.0, 2.0))
        assert other.granted
        await source.release("small", "elsewhere")
        await until(lambda: counters(admission)["a"] > counters(admission)["b"])
        await admission.release(blocker.ticket)
        await until(lambda: any(t.done() for t in waiting.values()))
        first = [rid for rid, t in waiting.items() if t.done()]
        await admission.release(blocker2.ticket)
        await until(lambda: all(t.done() for t in waiting.values()))
        await admission.stop()
        return first

    assert run(scenario) == ["b-here"]


def test_a_request_may_not_pass_the_heads_other_replicas_hold_room_for_when_far_ahead_of_them() -> None:
    fair = FairShare(FAIR)
    fair.charge("a", 50_000.0)
    fair.charge("b", 50_000.0)
    fair.waits("b")
    assert fair.may_pass("a", 5_000.0), "level with b, waiting here, and within the largest cost"
    assert not fair.may_pass("a", 5_000.0, elsewhere=[0.0]), "far ahead of a head that waits elsewhere"
    assert fair.may_pass("a", 5_000.0, elsewhere=[48_000.0])


def test_a_gate_counts_the_heads_the_agents_publish_among_the_waiters_a_request_would_pass() -> None:
    """Tenants a and c have each been served 50k by other replicas; another replica's b, served
    nothing, holds its place on the full node n1. Here c waits for more than any node holds, and a's
    request fits on n0. Level with c, a may pass this gate's line, but not b's place elsewhere: it
    waits its turn. By this gate's line alone it went at once."""

    async def scenario() -> None:
        clock = ManualClock()
        source = FakeHeadroom(clock, stale_after_s=5.0)
        source.add_node("n0", 20_000)
        source.add_node("n1", 20_000)
        admission = Admission(
            AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=FairnessConfig(enabled=True)
        )
        await admission.start()
        for tenant in ("a", "c"):
            served = await source.reserve("n1", f"{tenant}-before", 1, charge=TenantCharge(tenant, 50_000.0))
            assert served.granted
            await source.release("n1", f"{tenant}-before")
        await until(lambda: counters(admission).get("c", 0.0) >= 50_000)
        assert (await source.reserve("n1", "full", 20_000)).granted
        claim = await source.reserve("n1", "b-there", 10_000, hold_slot=True, waiting_since_unix_ns=1)
        assert not claim.granted
        await until(lambda: source.snapshot()[1].headroom.head is not None)  # type: ignore[union-attr]
        waiting = asyncio.create_task(admission.admit(long_route(25_000), MODEL, None, "c-here", tenant="c"))
        await until(lambda: admission.gauges().waiting == 1)
        passer = asyncio.create_task(admission.admit(long_route(5_000), MODEL, None, "a-here", tenant="a"))
        await until(lambda: admission.gauges().waiting == 2 or passer.done())
        assert not passer.done(), "it went ahead of b's place on n1"
        assert source.reserved_tokens("n0") == 0
        for task in (waiting, passer):
            task.cancel()
        await asyncio.gather(waiting, passer, return_exceptions=True)
        await admission.stop()

    run(scenario)


def backfilled(fair: FairShare, queues: dict[str, list[float]], steps: int, *, bounded: bool) -> float:
    """Serve backlogged tenants where room frees unevenly: the least counter's head when it fits, else
    another tenant's head that fits (backfill), held to may_pass when `bounded`. The largest weighted
    service gap between the tenants (all backlogged throughout)."""
    draw = random.Random(7)
    served = dict.fromkeys(queues, 0.0)
    for tenant in queues:
        fair.waits(tenant)
    gap = 0.0
    for _ in range(steps):
        room = draw.choice([5_000.0] * 9 + [40_000.0])
        order = sorted(queues, key=fair.counter)
        fits = [t for t in order if queues[t][0] <= room]
        chosen = next(
            (t for t in fits if t == order[0] or not bounded or fair.may_pass(t, queues[t][0])), None
        )
        if chosen is None:
            continue
        cost = queues[chosen].pop(0)
        fair.charge(chosen, cost)
        served[chosen] += cost / FAIR.weight(chosen)
        gap = max(gap, max(served.values()) - min(served.values()))
    return gap


def test_backfill_held_to_may_pass_keeps_the_gap_within_twice_the_largest_cost() -> None:
    """A tenant of 30k-token requests and one of 3k-token ones: room for a 30k request frees now and
    then, for a 3k one often. Backfilling freely, the small tenant runs far ahead while the big one
    waits for room; held to may_pass, it waits its turn once it is a large cost ahead."""
    queues = {"big": [30_000.0] * 300, "small": [3_000.0] * 3_000}
    free = backfilled(FairShare(FAIR), {k: list(v) for k, v in queues.items()}, 600, bounded=False)
    held = backfilled(FairShare(FAIR), {k: list(v) for k, v in queues.items()}, 600, bounded=True)
    assert free > 2 * 30_000
    assert held <= 2 * 30_000


def test_a_gates_own_release_settles_its_tenants_counter_at_once() -> None:
    """The agent sends a gate no message for what the gate's own Release changed
    (kvgate.agent.subscribers): the settlement in the answer reaches the fair order at once, not with
    whatever message comes next (a heartbeat, a second here)."""

    async def scenario() -> None:
        agent = Agent(settings(idle_scrape_s=None, heartbeat_s=10.0), Engine())
        async with followed(agent) as (view, _):
            fairness = FairnessConfig(enabled=True, output_weight=2.0)
            admission = Admission(AdmissionConfig(max_wait_s=0.0), view, fairness=fairness)
            await admission.start()
            try:
                route = long_route(12_000)
                admitted = await admission.admit(route, MODEL, None, "r1", output_tokens=2_000, tenant="acme")
                assert admitted.ticket is not None
                # Another replica's grant: the agent tells this gate in a message, whose totals the
                # gate's counters follow from then on.
                charge = TenantCharge("beta", 6_000, output_weight=2.0)
                assert agent.state.reserve("b1", 6_000, 30.0, "gate-2", charge=charge).granted
                await until_async(lambda: len(admission.gauges().tenants) == 2, "the other replica's grant")
                assert sorted(admission.gauges().tenants) == [
                    ("acme", 10_000 + 2 * 2_000, 0),
                    ("beta", 6_000, 0),
                ]
                sent = agent.stream.published
                await admission.release(admitted.ticket, generated_tokens=500)
                assert sorted(admission.gauges().tenants) == [
                    ("acme", 10_000 + 2 * 500, 0),
                    ("beta", 6_000, 0),
                ]
                assert agent.stream.published == sent, "no message came in between"
            finally:
                await admission.stop()

    asyncio.run(scenario())
