"""Who runs next: priority, then the tenant with the least weighted attained service, then age
(kvgate.queue.fairness), by the agents' totals once they publish them."""

from __future__ import annotations

import dataclasses
import itertools

from kvgate.config import parse_config
from kvgate.headroom.snapshot import TenantCharge
from kvgate.policy.fair_share import ACTIVE_S
from kvgate.queue.fairness import NOTHING_TO_SETTLE, FairQueue
from kvgate.queue.jobs import JobCharge, Waiting

_seq = itertools.count(1)


def jobs(tenant: str, count: int, tokens: int = 8000, priority: int = 1) -> list[Waiting]:
    return [Waiting(f"{tenant}{i + 1}", priority, tenant, tokens, next(_seq)) for i in range(count)]


def dispatch(fair: FairQueue, count: int) -> list[str]:
    order = []
    for _ in range(count):
        job = fair.next()
        assert job is not None
        fair.dispatched(job)
        order.append(job.id)
    return order


def test_one_tenant_runs_in_arrival_order() -> None:
    fair = FairQueue()
    fair.load(jobs("a", 4), per_group=10)
    assert dispatch(fair, 4) == ["a1", "a2", "a3", "a4"]
    assert fair.next() is None


def test_a_tenant_that_arrives_behind_a_flood_takes_every_other_turn() -> None:
    """b starts level with a (lifted to its counter) and, served less in fact, goes first on the tie;
    then turns."""
    fair = FairQueue()
    flood = jobs("a", 10)
    fair.load(flood, per_group=100)
    assert dispatch(fair, 1) == ["a1"]  # running when the other tenant arrives
    late = jobs("b", 2)
    fair.load(flood[1:] + late, per_group=100)
    assert dispatch(fair, 4) == ["b1", "a2", "b2", "a3"]


def test_shares_are_by_tokens_not_by_count() -> None:
    fair = FairQueue()
    huge, small = jobs("a", 30, tokens=30_000), jobs("b", 40, tokens=1000)
    fair.load(huge + small, per_group=100)
    order = dispatch(fair, 33)
    # After one 30k-token prompt, the other tenant's 1k-token ones run until it has had as many tokens.
    assert order[:2] == ["a1", "b1"]
    assert order.index("a2") == 31
    assert sum(1 for name in order if name.startswith("b")) == 31


def test_a_tenant_of_weight_three_gets_three_times_the_tokens_while_both_wait() -> None:
    config = parse_config("fairness: {tenants: {heavy: {weight: 3}}}").fairness
    fair = FairQueue(config)
    fair.load(jobs("a", 40) + jobs("heavy", 40), per_group=100)
    order = dispatch(fair, 40)
    assert sum(1 for name in order if name.startswith("heavy")) == 30


def test_a_tenant_takes_the_weight_of_the_class_its_latest_jobs_route_gave_it() -> None:
    """The class travels with each job (x-kvgate-tenant-class, set by the route): a tenant of no entry of
    its own weighs its class's 3 in the queue's order, as it does in the gate's line; its own entry
    still wins, and a class kvgate.yaml does not have is none."""
    config = parse_config(
        "fairness: {classes: {partners: {weight: 3}}, tenants: {own: {weight: 1}}}"
    ).fairness
    fair = FairQueue(config)
    classed = [dataclasses.replace(job, tenant_class="partners") for job in jobs("p", 40)]
    fair.load(jobs("a", 40) + classed, per_group=100)
    assert sum(1 for name in dispatch(fair, 40) if name.startswith("p")) == 30

    for tenant, tenant_class in (("own", "partners"), ("p", "unknown")):
        fair = FairQueue(config)
        mine = [dataclasses.replace(job, tenant_class=tenant_class) for job in jobs(tenant, 40)]
        fair.load(jobs("a", 40) + mine, per_group=100)
        assert sum(1 for name in dispatch(fair, 40) if name.startswith(tenant)) == 20, tenant


def test_a_tenant_that_was_idle_does_not_cash_in_credit() -> None:
    now = [0.0]
    fair = FairQueue(clock=lambda: now[0])
    a, b = jobs("a", 20), jobs("b", 1)
    fair.load(a + b, per_group=100)
    assert dispatch(fair, 2) == ["a1", "b1"]
    assert dispatch(fair, 8) == [f"a{i}" for i in range(2, 10)]  # b idle meanwhile
    now[0] += ACTIVE_S + 1  # long enough that no replica served b either
    back = jobs("b", 5)
    fair.load(a[9:] + back, per_group=100)
    # b starts level with a: one turn each, not eight b's in a row (b first on the tie).
    assert dispatch(fair, 4) == ["b1", "a10", "b2", "a11"]


def test_a_batch_waiting_at_a_lower_priority_does_not_let_an_idle_tenant_keep_its_lead() -> None:
    now = [0.0]
    fair = FairQueue(clock=lambda: now[0])
    a, b, batch = jobs("a", 20), jobs("b", 1), jobs("batch", 5, priority=2)
    fair.load(a + b + batch, per_group=100)
    assert dispatch(fair, 2) == ["a1", "b1"]
    assert dispatch(fair, 8) == [f"a{i}" for i in range(2, 10)]  # b idle; the batch waits behind
    now[0] += ACTIVE_S + 1
    back = jobs("b", 5)
    fair.load(a[9:] + back + batch, per_group=100)
    # b is lifted to a's counter, not to the batch's (which no normal job ever waits behind).
    assert dispatch(fair, 4) == ["b1", "a10", "b2", "a11"]


def test_a_higher_priority_goes_first_and_ties_go_to_the_older_job() -> None:
    fair = FairQueue()
    normal = jobs("a", 2) + jobs("b", 2)
    urgent = jobs("c", 1, priority=0)
    fair.load(normal + urgent, per_group=100)
    assert dispatch(fair, 5) == ["c1", "a1", "b1", "a2", "b2"]


def test_a_job_taken_elsewhere_is_dropped_without_charging_its_tenant() -> None:
    fair = FairQueue()
    fair.load(jobs("a", 2) + jobs("b", 2), per_group=100)
    first = fair.next()
    assert first is not None and first.id == "a1"
    fair.drop(first)  # another replica claimed it
    assert dispatch(fair, 3) == ["a2", "b1", "b2"]


def test_a_group_read_only_in_part_asks_for_a_reload_once_it_runs_out() -> None:
    fair = FairQueue()
    fair.load(jobs("a", 2) + jobs("b", 1), per_group=2)
    assert not fair.needs_reload
    dispatch(fair, 2)
    assert not fair.needs_reload  # b was read whole; a still has one here
    dispatch(fair, 1)
    assert fair.needs_reload


def test_the_order_follows_the_service_the_agents_saw_from_every_replica_and_gate() -> None:
    """a and b wait level here; the agents' totals say a gate (or another replica) served a 50,000
    tokens meanwhile: b's jobs go first until b has as much. A replica that restarts reads the same
    totals, so nobody's share starts over."""
    for replica in (FairQueue(), FairQueue()):
        replica.load(jobs("a", 10) + jobs("b", 10), per_group=100)
        replica.observe({"a": 50_000.0, "b": 0.0})
        order = dispatch(replica, 8)
        assert order[:7] == ["b1", "b2", "b3", "b4", "b5", "b6", "b7"], order


def test_a_job_is_charged_as_the_gate_charges_and_one_stored_without_a_charge_its_tokens_once() -> None:
    """Its likeliest prompt + output_weight x its output budget, settled by the agent on what ran (the
    output weight travels with the charge); a job stored by a kvgate that kept no charge: its tokens,
    nothing to settle."""
    fair = FairQueue(parse_config("fairness: {enabled: true}").fairness)
    (charged,) = (
        dataclasses.replace(job, charge=JobCharge(3_000, 512)) for job in jobs("c", 1, tokens=4_097)
    )
    (legacy,) = jobs("c", 1, tokens=4_097)
    assert fair.charge_of(charged) == TenantCharge("c", 3_000 + 2 * 512, 2.0)
    assert fair.charge_of(legacy) == TenantCharge("c", 4_097, NOTHING_TO_SETTLE)
    fair.load([charged], per_group=10)
    fair.dispatched(charged)
    assert fair.fair_service("c") == 3_000 + 2 * 512
