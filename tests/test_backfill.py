"""One waiting order with EASY backfilling (issue 28, item 2): the agent's claims and the head's slot,
the gate's line that wakes only its head, and `kvgate queue` in the same order as the gates.

Every test runs in-process on manual clocks: FakeHeadroom's nodes decide through the agent's own
ledger and waiting claims (kvgate.agent.backfill), as NodeState does.
"""

from __future__ import annotations

import asyncio

from test_admission import long_route, refused, run, until

from kvgate.agent.backfill import CLAIM_TTL_S, Waiter, WaitingClaims
from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.config import AdmissionConfig, FairnessConfig, ModelConfig
from kvgate.gate.admission import Admission, Admitted
from kvgate.headroom.shadow import ahead_of, room_behind, slot_after_s
from kvgate.headroom.snapshot import ExpectedRelease, HeadClaim, ReserveReason, TenantCharge
from kvgate.policy import Reason
from kvgate.queue.dispatcher import Dispatcher
from kvgate.queue.jobs import Job, JobError, JobState, Waiting

MODEL = ModelConfig()
S = 1_000_000_000  # nanoseconds in a second: waiting times are wall-clock ns
RATE = 10.0  # output tokens per second per request, as the node's agent measured it


def node_with(clock: ManualClock, capacity: int = 100_000) -> FakeHeadroom:
    source = FakeHeadroom(clock, stale_after_s=60.0)
    source.add_node("a", capacity)
    source.measure_decode_rate("a", RATE)
    return source


async def hold(source: FakeHeadroom, request_id: str, tokens: int, ends_after_s: float) -> None:
    """A running request that is expected to end `ends_after_s` from now (its output at RATE)."""
    outcome = await source.reserve("a", request_id, tokens, output_tokens=round(ends_after_s * RATE))
    assert outcome.granted, outcome


def test_the_slot_is_where_expected_releases_first_fit_the_head_and_the_rest_is_extra() -> None:
    releases = (ExpectedRelease(2.0, 20_000), ExpectedRelease(4.0, 30_000), ExpectedRelease(6.0, 30_000))
    assert slot_after_s(20_000, releases, 60_000) == 4.0
    assert room_behind(20_000, releases, 60_000, 4.0) == 10_000, "20k now + 50k freed by 4 s - 60k"
    assert slot_after_s(70_000, releases, 60_000) == 0.0, "it fits now"
    assert room_behind(70_000, releases, 60_000, 0.0) == 10_000
    assert slot_after_s(20_000, releases, 200_000) is None, "the forecast never fits it"
    assert room_behind(20_000, releases, 200_000, None) == 0, "then it holds the node against everyone behind"


def test_backfill_never_delays_the_head_past_its_slot() -> None:
    """Releases come when the agent forecast them; small requests keep arriving behind the head and take
    all they are let take, for good. The head still starts at its slot, not later."""

    async def scenario() -> None:
        clock = ManualClock()
        source = node_with(clock)
        for name, tokens, ends in (("r1", 20_000, 2.0), ("r2", 30_000, 4.0), ("r3", 30_000, 6.0)):
            await hold(source, name, tokens, ends)  # headroom 20k
        head = {"waiting_since_unix_ns": 1 * S, "rank": 1}
        refusal = await source.reserve("a", "head", 60_000, hold_slot=True, **head)
        assert refusal.reason == ReserveReason.INSUFFICIENT_HEADROOM
        (view,) = source.snapshot()
        assert view.headroom is not None and view.headroom.head == HeadClaim(60_000, 1 * S, 1, 4.0)
        ends = {"r1": 2.0, "r2": 4.0, "r3": 6.0}
        backfilled, started = 0, None
        for step in range(17):  # every 0.5 s for 8 s
            now = step * 0.5
            for name in [n for n, end in ends.items() if end <= now]:
                await source.release("a", name)
                del ends[name]
            if (await source.reserve("a", "head", 60_000, hold_slot=True, **head)).granted:
                started = now
                break
            for i in range(3):  # later arrivals, fresh and waiting, each 5k that never ends
                since = {"waiting_since_unix_ns": (2 + step) * S, "rank": 1} if i else {}
                if (await source.reserve("a", f"s{step}-{i}", 5_000, **since)).granted:
                    backfilled += 5_000
            clock.advance(0.5)
        assert started == 4.0, "the head starts at its slot, as if nobody had backfilled"
        assert backfilled == 10_000, "and what its slot left over was used meanwhile"

    run(scenario)


def test_a_later_request_goes_at_once_beside_the_slot_and_is_refused_held_for_head_past_it() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        source = node_with(clock)
        await hold(source, "r1", 80_000, 5.0)  # headroom 20k; 80k frees in 5 s
        head = {"waiting_since_unix_ns": 1 * S, "rank": 1, "hold_slot": True}
        assert not (await source.reserve("a", "head", 90_000, **head)).granted
        # slot at 5 s: 20k + 80k - 90k = 10k may go now without delaying the head.
        later = {"waiting_since_unix_ns": 2 * S, "rank": 1}
        assert (await source.reserve("a", "small", 6_000, **later)).granted
        past = await source.reserve("a", "medium", 6_000, **later)
        assert (past.granted, past.reason) == (False, ReserveReason.HELD_FOR_HEAD), "it fits the headroom"
        fresh = await source.reserve("a", "fresh", 4_000)  # names no place: behind every waiter
        assert fresh.granted, "4k still leaves the slot whole"
        ahead = await source.reserve("a", "urgent", 10_000, waiting_since_unix_ns=3 * S, rank=0)
        assert ahead.granted, "a higher rank is ahead of the head: it is not held back"
        assert (
            await source.reserve("a", "head", 90_000, **head)
        ).reason == ReserveReason.INSUFFICIENT_HEADROOM

    run(scenario)


def test_claims_expire_unless_renewed_and_stay_within_their_bounds() -> None:
    clock = ManualClock()
    claims = WaitingClaims(clock, max_claims=3, max_per_holder=2)
    first, second = Waiter("g1", "a", 1, 10 * S), Waiter("g1", "b", 1, 20 * S)
    assert claims.claim(first, 1000) and claims.claim(second, 1000)
    assert not claims.claim(Waiter("g1", "c", 1, 30 * S), 1000), "past its holder's bound, later: not kept"
    assert claims.claim(Waiter("g1", "d", 0, 40 * S), 1000), "earlier in the order: replaces its latest"
    assert {c.waiter.request_id for c in (claims.head(),) if c} == {"d"} and len(claims) == 2
    assert claims.claim(Waiter("g2", "e", 1, 5 * S), 1000)
    assert not claims.claim(Waiter("g3", "f", 2, 1 * S), 1000), "all claims at the bound, later: not kept"
    assert len(claims) == 3
    clock.advance(CLAIM_TTL_S / 2)
    assert claims.claim(Waiter("g2", "e", 1, 5 * S), 1000), "a retry renews it"
    clock.advance(CLAIM_TTL_S / 2)
    assert len(claims) == 1, "the others were not renewed"
    clock.advance(CLAIM_TTL_S / 2)
    assert claims.head() is None


def node_nearly_full() -> NodeState:
    """An agent's node of 100,000 tokens, 80,000 of them reserved until a release."""
    state = NodeState(
        NodeSettings("n", "n.engine:8000", capacity_tokens=100_000, safety_ratio=1.0),
        ManualClock(),
        uses_engine=False,
        uses_nvml=False,
    )
    assert state.reserve("r1", 80_000, 60.0, "gate", output_tokens=50).granted
    return state


def test_among_one_rank_the_waiter_whose_tenant_was_served_least_is_the_head_whatever_its_arrival() -> None:
    """Fair shares across replicas: each gate and queue names its waiter's fair service (its tenant's
    weighted attained service), and the agent orders waiters of one rank by it before arrival, so the
    heads of different replicas meet in the one fair order. Rank still comes first; without fair
    shares (0 for every waiter) the order is by arrival, as before."""
    clock = ManualClock()
    claims = WaitingClaims(clock)
    flood = Waiter("gate-0", "flood", 1, 10 * S, fair_service=90_000.0)
    light = Waiter("gate-1", "light", 1, 30 * S, fair_service=20_000.0)
    assert claims.claim(flood, 1000) and claims.claim(light, 1000)
    head = claims.head()
    assert head is not None and head.waiter.request_id == "light", "served less, though it came later"
    published = claims.published(50_000, ())
    assert published is not None and published.fair_service == 20_000.0
    assert ahead_of(1, 40 * S, published, fair_service=10_000.0), "a waiter served even less goes first"
    assert not ahead_of(1, 5 * S, published, fair_service=30_000.0), "an earlier one served more does not"
    assert ahead_of(0, 50 * S, published, fair_service=1e9), "a higher priority before any service"
    urgent = Waiter("gate-0", "urgent", 0, 50 * S, fair_service=1e9)
    assert claims.claim(urgent, 1000)
    head = claims.head()
    assert head is not None and head.waiter.request_id == "urgent"
    plain = WaitingClaims(clock)
    assert plain.claim(Waiter("g", "late", 1, 30 * S), 1000) and plain.claim(
        Waiter("g", "early", 1, 10 * S), 1000
    )
    first = plain.head()
    assert first is not None and first.waiter.request_id == "early"


def test_a_gate_and_the_queue_name_their_tenants_fair_service_to_the_agents() -> None:
    """The fair service a gate's try and the queue's dispatch send reaches the agent's claim: a gate
    head of a tenant served less holds the node's room against an older queued job of a tenant served
    more."""
    state = node_nearly_full()
    queued = {"waiting_since_unix_ns": 5 * S, "rank": 1, "hold_slot": True, "fair_service": 50_000.0}
    fair_head = {"waiting_since_unix_ns": 9 * S, "rank": 1, "hold_slot": True, "fair_service": 1_000.0}
    assert not state.reserve("job", 30_000, 60.0, "queue", **queued).granted  # type: ignore[arg-type]
    assert not state.reserve("b", 30_000, 60.0, "gate", **fair_head).granted  # type: ignore[arg-type]
    published = state.snapshot(0).head
    assert published is not None and published.fair_service == 1_000.0
    assert published.waiting_since_unix_ns == 9 * S, "the gate's head, not the older job"


def test_a_head_that_stops_asking_stops_holding_room() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        source = node_with(clock)
        await hold(source, "r1", 80_000, 5.0)
        assert not (
            await source.reserve("a", "head", 90_000, waiting_since_unix_ns=S, hold_slot=True)
        ).granted
        assert not (await source.reserve("a", "big", 15_000)).granted, "held for the head"
        clock.advance(CLAIM_TTL_S)
        assert (await source.reserve("a", "big", 15_000)).granted, "its claim lapsed"

    run(scenario)


def test_the_agent_publishes_its_head_and_the_head_is_not_held_back_by_itself() -> None:
    state = node_nearly_full()
    head = {"waiting_since_unix_ns": 7 * S, "rank": 1, "hold_slot": True}
    refusal = state.reserve("head", 30_000, 60.0, "gate", **head)  # type: ignore[arg-type]
    assert refusal.reason == ReserveReason.INSUFFICIENT_HEADROOM
    published = state.snapshot(0).head
    assert published is not None and (published.tokens, published.waiting_since_unix_ns) == (30_000, 7 * S)
    assert published.slot_after_s is None, "no decode rate measured: no forecast, everything behind waits"
    assert state.reserve("later", 5_000, 60.0, "gate").reason == ReserveReason.HELD_FOR_HEAD
    state.release("r1", "gate")
    assert state.reserve("head", 30_000, 60.0, "gate", **head).granted  # type: ignore[arg-type]
    assert state.snapshot(0).head is None, "a grant ends the claim"
    assert state.reserve("later", 5_000, 60.0, "gate").granted


def setup_gate(source: FakeHeadroom, clock: ManualClock, **config: object) -> Admission:
    settings = AdmissionConfig(**{"max_wait_s": 5.0, **config})  # type: ignore[arg-type]
    arrivals = iter(range(100, 10_000))
    return Admission(settings, source, clock=clock, wall_ns=lambda: next(arrivals) * S)


async def admit(admission: Admission, tokens: int, request_id: str) -> Admitted:
    return await admission.admit(long_route(tokens), MODEL, None, request_id)


def test_only_the_head_is_woken_and_a_waiter_behind_it_only_when_it_fits_beside_the_slot() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        source = node_with(clock, 40_000)
        await hold(source, "b1", 25_000, 5.0)
        await hold(source, "b2", 10_000, 60.0)  # headroom 5k
        admission = setup_gate(source, clock)
        await admission.start()
        head = asyncio.create_task(admit(admission, 30_000, "head"))
        await until(lambda: clock.sleeping == 1)
        assert source.reserves[-1] == ("a", "head", True), "the head holds its place on the node"
        behind = [asyncio.create_task(admit(admission, 12_000, f"w{i}")) for i in range(4)]
        small = asyncio.create_task(admit(admission, 8_000, "small"))
        await until(lambda: clock.sleeping == 6)
        woken = admission.waiters_woken
        source.tick()  # every agent speaks: nothing freed
        await until(lambda: admission.waiters_woken > woken and clock.sleeping == 6)
        assert admission.waiters_woken == woken + 1, "only the head was woken"
        await source.release("a", "b2")  # 15k free; the head's slot (5 s) leaves 15 + 25 - 30 = 10k
        placed = await small
        assert placed.ticket is not None, "it fits beside the slot: woken and admitted"
        await until(lambda: clock.sleeping == 5)
        assert admission.waiters_woken == woken + 3, "the head and the small waiter, not the four 12k ones"
        for task in (head, *behind):
            task.cancel()
        await asyncio.gather(head, *behind, return_exceptions=True)
        await admission.stop()

    run(scenario)


def test_a_fresh_arrival_goes_at_once_beside_the_slot_and_joins_the_line_when_it_does_not() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        source = node_with(clock, 40_000)
        await hold(source, "b1", 25_000, 5.0)  # headroom 15k
        admission = setup_gate(source, clock)
        head = asyncio.create_task(admit(admission, 30_000, "head"))
        await until(lambda: clock.sleeping == 1)
        over = asyncio.create_task(admit(admission, 12_000, "over"))  # fits the headroom, not beside
        await until(lambda: clock.sleeping == 2)
        assert not [r for r in source.reserves if r[1] == "over"], "the gate did not even ask: it waits"
        assert (await admit(admission, 8_000, "fits")).ticket is not None, (
            "15 + 25 - 30 = 10k beside the slot"
        )
        later = asyncio.create_task(admit(admission, 8_000, "waits"))  # 2k left beside the slot
        await until(lambda: clock.sleeping == 3)
        assert admission.gauges().waiting == 3
        clock.advance(5.0)
        assert [refused(await t) for t in (over, later)] == [Reason.NO_CAPACITY] * 2
        assert refused(await head) is Reason.NO_CAPACITY
        await until(lambda: ("a", "head") in source.released)  # the head that gave up dropped its claim
        assert source.snapshot()[0].headroom.head is None  # type: ignore[union-attr]

    run(scenario)


async def two_nodes_freeing_b_first(clock: ManualClock) -> FakeHeadroom:
    """Nodes a and b of 40k, 10k free on each; 30k frees on a in 9 s, 10k on b in 3 s."""
    source = FakeHeadroom(clock, stale_after_s=60.0)
    for name in ("a", "b"):
        source.add_node(name, 40_000)
        source.measure_decode_rate(name, RATE)
    await source.reserve("a", "on-a", 30_000, output_tokens=round(9 * RATE))
    await source.reserve("b", "on-b", 10_000, output_tokens=round(3 * RATE))
    await source.reserve("b", "long-on-b", 20_000, output_tokens=round(60 * RATE))
    return source


def test_a_head_holds_its_place_on_the_node_whose_releases_fit_it_first_only() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        source = await two_nodes_freeing_b_first(clock)
        admission = setup_gate(source, clock)
        head = asyncio.create_task(admit(admission, 20_000, "head"))
        await until(lambda: clock.sleeping == 1)
        holds = {node for node, request, held in source.reserves if request == "head" and held}
        assert holds == {"b"}, "the earliest slot (3 s on b, 9 s on a), on one node only"
        beside = await admit(admission, 9_000, "beside")  # b's slot leaves nothing beside it
        assert beside.ticket is not None and beside.ticket.agent == "a", "node a keeps backfilling"
        head.cancel()
        await asyncio.gather(head, return_exceptions=True)

    run(scenario)


def test_room_that_frees_beside_the_heads_slot_goes_to_the_head_before_a_newcomer() -> None:
    """The head holds its place on b. Node a's request ends: the head fits there now, but a's agent
    holds nothing for it. A newcomer that arrives before the head is woken may take only what the
    head leaves on a."""

    async def scenario() -> None:
        clock = ManualClock()
        source = await two_nodes_freeing_b_first(clock)
        admission = setup_gate(source, clock)
        await admission.start()
        head = asyncio.create_task(admit(admission, 20_000, "head"))
        await until(lambda: clock.sleeping == 1)
        assert ("b", "head", True) in source.reserves
        await source.release("a", "on-a")  # 40k free on a
        newcomer = asyncio.create_task(admit(admission, 25_000, "newcomer"))  # 40 - 20 = 20k beside
        placed = await head
        assert placed.ticket is not None and placed.ticket.agent == "a"
        await until(lambda: clock.sleeping == 1)  # the newcomer, at the head now
        assert not newcomer.done() and source.reserved_tokens("a") == 20_000
        newcomer.cancel()
        await asyncio.gather(newcomer, return_exceptions=True)
        await admission.stop()

    run(scenario)


class Store:
    """The queue's store, in memory: the jobs waiting, and which were claimed where."""

    def __init__(self, *jobs: Waiting) -> None:
        self.queued = {job.id: job for job in jobs}
        self.claimed: dict[str, str] = {}

    async def waiting(self, per_group: int) -> list[Waiting]:
        return list(self.queued.values())

    async def claim(self, job_id: str, owner: str, node: str, reservation: str, lease_s: float) -> Job | None:
        job = self.queued.pop(job_id, None)
        if job is None:
            return None
        self.claimed[job_id] = node
        return Job(job.id, JobState.RUNNING, job.tokens, job.priority, job.tenant, job.created_at)

    async def fail_waiting(self, job_id: str, error: JobError) -> bool:
        return self.queued.pop(job_id, None) is not None


class Launcher:
    def launch(self, job: Job, agent: str, endpoint: str, reservation: str, claimed_at: float) -> None:
        pass


def test_fresh_gate_arrivals_cannot_starve_the_oldest_queued_job() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        source = FakeHeadroom(clock, stale_after_s=60.0)
        source.add_node("a", 40_000)
        await source.reserve("a", "busy", 30_000)  # no forecast of when it ends
        store = Store(Waiting("job", 1, "tenant", 30_000, 1, created_at=50.0))  # queued first
        dispatcher = Dispatcher(store, source, Launcher(), "q1", claim_lease_s=60.0, clock=clock)
        running = asyncio.create_task(dispatcher.run())
        await until(lambda: ("a", "job/1/q1", True) in source.reserves)
        admission = setup_gate(source, clock, max_wait_s=0.0)  # the gate's arrivals come later
        await source.release("a", "busy")  # 40k free: the room the job waits for
        taker = await admit(admission, 20_000, "taker")  # before the queue's next round
        assert refused(taker) is Reason.NO_CAPACITY, "it would take the job's room"
        assert (await admit(admission, 8_000, "beside")).ticket is not None, "40 - 30 = 10k beside it"
        source.tick()  # the agent's next message: the queue's next round
        await until(lambda: "job" in store.claimed)
        assert store.claimed == {"job": "a"}
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    run(scenario)


def test_the_queue_backfills_behind_a_job_that_does_not_fit() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        source = node_with(clock, 40_000)
        await hold(source, "busy", 25_000, 5.0)
        big = Waiting("big", 1, "t1", 30_000, 1, created_at=10.0)
        small = Waiting("small", 1, "t2", 10_000, 2, created_at=11.0)
        store = Store(big, small)
        dispatcher = Dispatcher(store, source, Launcher(), "q1", claim_lease_s=60.0, clock=clock)
        running = asyncio.create_task(dispatcher.run())
        await until(lambda: "small" in store.claimed)
        assert "big" in store.queued, "the big job waits; the small one did not wait behind it"
        await source.release("a", "busy")
        source.tick()
        await until(lambda: "big" in store.claimed)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    run(scenario)


def test_the_queue_holds_back_a_tenant_far_ahead_of_the_head_it_would_go_beside() -> None:
    """As above, with fair shares: the small job's tenant has been served 100k by the agents' count,
    the big job's nothing. The small job fits beside the big one's slot but waits its turn."""

    async def scenario() -> None:
        clock = ManualClock()
        source = node_with(clock, 40_000)
        served = await source.reserve("a", "before", 1, charge=TenantCharge("t2", 100_000.0))
        assert served.granted
        await source.release("a", "before")
        await hold(source, "busy", 25_000, 5.0)
        big = Waiting("big", 1, "t1", 30_000, 1, created_at=10.0)
        small = Waiting("small", 1, "t2", 10_000, 2, created_at=11.0)
        store = Store(big, small)
        dispatcher = Dispatcher(
            store,
            source,
            Launcher(),
            "q1",
            claim_lease_s=60.0,
            clock=clock,
            fairness=FairnessConfig(enabled=True),
        )
        running = asyncio.create_task(dispatcher.run())
        await until(lambda: ("a", "big/1/q1", True) in source.reserves)  # the head holds its place
        for _ in range(100):  # the loop finishes its round; no time passes
            await asyncio.sleep(0)
        assert not store.claimed, "t2 is 100k ahead of t1: its job did not go beside t1's"
        await source.release("a", "busy")
        source.tick()
        await until(lambda: set(store.claimed) == {"big", "small"})
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    run(scenario)
