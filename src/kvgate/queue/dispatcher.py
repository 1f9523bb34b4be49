"""The dispatch loop: the next job by priority and fair share, on a node whose agent reserved for it.

Each round reads the heads of the waiting groups from the store (only when something changed),
asks the fair queue for the next job, and tries the nodes the gate's own rule picks for its tokens
(kvgate.policy.nodes.choose_nodes) until an agent grants the Reserve; then it claims the job in the
store and hands it to the runner. A job bigger than every node's admissible capacity fails.

The queue keeps the one waiting order the gates keep (EASY backfilling, kvgate.agent.backfill): each
Reserve carries the job's priority as its rank and the time it was queued as its waiting time, so the
agents order queued jobs and gate waiters together, and fresh gate arrivals cannot starve the oldest
queued job. The first job of a round that finds no room is the queue's head: it holds its place on
the node whose expected releases fit it first (kvgate.policy.slot), and that agent holds the room its
slot needs against everything behind it. Jobs after it in the fair order are still tried, each where
it fits beside the heads' slots by the latest messages (at most `MAX_PASSED` jobs without room per
round), so a big job no longer idles the room small ones could use, and is delayed at most to its
slot. With fair shares a job goes beside the head only while its tenant is within reach of the
tenants waiting here and of the heads the agents hold room for, as in a gate's line
(`FairShare.may_pass`): a tenant far ahead cannot take, job after job, what frees around a light
tenant's head. The loop then waits for the headroom stream, a job that ends here, or a store event.

Reserve comes before the claim: the reservation id names this replica, so when two replicas reserve
for the same job only the one whose claim lands keeps it, and the other gives its reservation back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.config import FairnessConfig
from kvgate.errors import HeadroomError, StoreError
from kvgate.headroom import giveback
from kvgate.headroom.snapshot import HeadClaim, NodeView, ReleaseOutcome, ReserveOutcome, TenantCharge
from kvgate.policy.fair_share import agents_heads, agents_lifts, agents_totals, heads_elsewhere
from kvgate.policy.nodes import StalePolicy, choose_nodes
from kvgate.policy.slot import fits_beside_heads, slot_node
from kvgate.queue import placement
from kvgate.queue.fairness import FairQueue
from kvgate.queue.jobs import Job, JobError, Waiting
from kvgate.queue.placement import Fit

log = logging.getLogger(__name__)

# Jobs read per (priority, tenant) group in one round; more are read once a group runs out.
PER_GROUP = 8
# Reading the waiting heads costs a scan of the queued jobs' index (~15 ms at 10,000 queued on
# SQLite): during a burst of arrivals, read them at most this often.
MIN_RELOAD_S = 0.05
# Jobs a round passes over for want of room before it waits for a change: each costs a Reserve at most
# (none where the latest messages show no room beside the heads), and a round past them is unlikely to
# find a job that fits.
MAX_PASSED = 16
# How often the head tells the agent it holds its place on that it still waits: a quarter of the
# agent's claim lifetime (kvgate.agent.backfill.CLAIM_TTL_S, 2 s); rounds come at least every
# refresh_s (1 s) while it waits.
CLAIM_RENEW_S = 0.5


class HeadroomSource(Protocol):
    """What the dispatcher needs of the long pool's agents (kvgate.headroom.view.HeadroomView, whose
    reservations the service gives the lease `queue.reservation_lease_s`)."""

    def snapshot(self) -> tuple[NodeView, ...]: ...

    async def reserve(
        self,
        node: str,
        request_id: str,
        tokens: int,
        *,
        waiting_since_unix_ns: int = 0,
        rank: int = 0,
        fair_service: float = 0.0,
        hold_slot: bool = False,
        output_tokens: int = 0,
        charge: TenantCharge | None = None,
    ) -> ReserveOutcome: ...

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome: ...

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]: ...

    async def wait_update(self, timeout_s: float) -> bool: ...


class DispatchStore(Protocol):
    async def waiting(self, per_group: int) -> list[Waiting]: ...

    async def claim(
        self, job_id: str, owner: str, node: str, reservation: str, lease_s: float
    ) -> Job | None: ...

    async def fail_waiting(self, job_id: str, error: JobError) -> bool: ...


class Launcher(Protocol):
    def launch(self, job: Job, agent: str, endpoint: str, reservation: str, claimed_at: float) -> None: ...


class Dispatcher:
    def __init__(
        self,
        store: DispatchStore,
        source: HeadroomSource,
        launcher: Launcher,
        owner: str,
        *,
        claim_lease_s: float,
        stale_nodes: StalePolicy = "probe",
        refresh_s: float = 1.0,
        on_dispatch: Callable[[Job], None] = lambda job: None,
        clock: Callable[[], float] = time.monotonic,
        demand: Callable[[bool], None] = lambda wanted: None,
        fairness: FairnessConfig | None = None,
    ) -> None:
        """`demand`: told after each round whether jobs wait, so a view that follows the agents only
        while needed (HeadroomView's on_demand) does so. `fairness`: the tenants' weights."""
        self._store = store
        self._source = source
        self._launcher = launcher
        self._owner = owner
        self._claim_lease_s = claim_lease_s
        self._stale = stale_nodes
        self._refresh_s = refresh_s
        self._on_dispatch = on_dispatch
        self._clock = clock
        self._demand = demand
        self._fair = FairQueue(fairness, clock)
        # With fair shares on, each try names its tenant's fair service to the agents, as the gates do.
        self._fair_shares = fairness is not None and fairness.enabled
        self._wake = asyncio.Event()
        # The next job fits no node now: headroom updates are worth a round.
        self._blocked = False
        self._updated = False  # an agent spoke since the round began
        self._stopping = False
        self._last_reload = -math.inf
        self._hold: _Hold | None = None  # where the queue's head holds its place

    def poke(self, reload: bool = False) -> None:
        """Something changed: a job was added or ended (`reload`: the waiting set may differ)."""
        if reload:
            self._fair.needs_reload = True
        self._wake.set()

    async def run(self) -> None:
        follower = asyncio.create_task(self._follow_headroom(), name="kvgate-queue-headroom")
        try:
            while True:
                self._wake.clear()
                try:
                    await self._round()
                except StoreError as error:
                    log.warning("dispatch round failed: %s", error)
                    self._fair.needs_reload = True
                # Not asyncio.wait_for: on Python 3.11 a cancel that meets the event being set is lost.
                try:
                    async with asyncio.timeout(self._refresh_s):
                        await self._wake.wait()
                except TimeoutError:
                    # A missed event must not leave a job waiting: read the store again now and then.
                    self._fair.needs_reload = True
        finally:
            self._stopping = True
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    async def _follow_headroom(self) -> None:
        # The flag as well as the cancel: a source's wait_update may lose a cancel (see above).
        while not self._stopping:
            if await self._source.wait_update(1.0):
                self._updated = True
                if self._blocked:
                    self._wake.set()

    async def _round(self) -> None:
        if self._fair.needs_reload:
            await self._reload()
        self._blocked = False
        self._updated = False
        self._observe_service(self._source.snapshot())
        passed: set[str] = set()  # jobs this round found no room for: the first is the head
        held_back: set[tuple[int, str]] = set()  # tenants too far ahead to go beside the head
        while (job := self._fair.next(passed, held_back)) is not None and len(passed) < MAX_PASSED:
            nodes = self._source.snapshot()
            if placement.fit(nodes, job.tokens) is Fit.TOO_BIG:
                await self._store.fail_waiting(job.id, placement.too_big_error(nodes, job.tokens))
                self._fair.drop(job)
                continue
            if passed and self._fair_shares and not self._may_pass(job, nodes):
                held_back.add((job.priority, job.tenant))
                continue
            if not await self._dispatch(job, nodes, head=not passed):
                passed.add(job.id)
                continue
            if self._fair.needs_reload:
                await self._reload()
        self._blocked = bool(passed)
        self._demand(self._blocked)
        if self._blocked and self._updated:
            self._wake.set()  # room may have freed while this round ran: look again now
        if not passed:
            await self._let_go()

    def _may_pass(self, job: Waiting, nodes: Sequence[NodeView]) -> bool:
        """Whether `job`, behind the round's head, may go beside it: only within reach of the tenants
        waiting here and of the heads the agents hold room for, as a gate's waiter may
        (kvgate.policy.fair_share). Held back, its tenant's jobs wait their turn."""
        return self._fair.may_pass(job, heads_elsewhere(nodes, job.priority))

    def _observe_service(self, nodes: Sequence[NodeView]) -> None:
        """Each tenant's service as the agents count it, every gate's and queue replica's grants alike
        (kvgate.queue.fairness)."""
        totals = agents_totals(nodes)
        if totals is not None:
            self._fair.observe(totals, agents_lifts(nodes), agents_heads(nodes))

    async def _reload(self) -> None:
        wait = self._last_reload + MIN_RELOAD_S - self._clock()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_reload = self._clock()
        self._fair.load(await self._store.waiting(PER_GROUP), PER_GROUP)

    async def _dispatch(self, job: Waiting, nodes: tuple[NodeView, ...], *, head: bool) -> bool:
        """Reserve, claim and launch `job`; False when no node granted it room. Tried only where it
        fits beside the heads' slots; the `head` (the round's first job without room) also holds its
        place on its slot node."""
        reservation = f"{job.id}/{job.attempts + 1}/{self._owner}"
        since = round(job.created_at * 1e9)
        hold = self._hold
        if head and hold is not None and hold.job != job.id:
            await self._let_go()  # the head changed: the old one's place goes at once
            hold = None
        slot = slot_node(nodes, job.tokens, 0, hold.agent if hold else None) if head else None
        if head and hold is not None and hold.agent != slot:
            await self._let_go()  # it holds its place on one node only
            hold = None

        service = self._fair.fair_service(job.tenant) if self._fair_shares else 0.0

        def local(node: NodeView) -> HeadClaim | None:
            """The head's claim where it holds, for the jobs behind it (the messages may not show it yet)."""
            return hold.claim if hold is not None and not head and node.agent == hold.agent else None

        tries = [
            n
            for n in choose_nodes(nodes, job.tokens, self._stale).candidates
            if not n.fresh
            or fits_beside_heads(n, job.tokens, job.priority, since, local(n), fair_service=service)
        ]
        renew = hold is None or self._clock() - hold.at >= CLAIM_RENEW_S
        if slot is not None and renew and all(n.agent != slot for n in tries):
            tries += [n for n in nodes if n.agent == slot]
        for node in tries:
            holds = node.agent == slot
            if holds:
                claim = HeadClaim(job.tokens, since, job.priority, None, service)
                self._hold = _Hold(job.id, node.agent, reservation, claim, self._clock())
            granted = node.headroom is not None and await self._reserve(
                node.agent, reservation, job, since, service, hold=holds
            )
            if not granted:
                continue
            if self._hold is not None and self._hold.job == job.id:
                if self._hold.agent == node.agent:
                    self._hold = None  # the agent ended its claim with the grant
                else:
                    await self._let_go()
            assert node.headroom is not None
            claimed_at = self._clock()
            try:
                claimed = await self._store.claim(
                    job.id, self._owner, node.agent, reservation, self._claim_lease_s
                )
            except BaseException:
                await asyncio.shield(self._release(node.agent, reservation))
                raise
            if claimed is None:
                # Cancelled meanwhile, or another replica claimed it first: nothing will run under this
                # reservation, which the agent treats as it does a grant whose answer was lost (its
                # tenant's charge taken back, the id never granted again).
                await self._release(node.agent, reservation, unanswered=True)
                self._fair.drop(job)
                return True
            self._fair.dispatched(job)
            self._launcher.launch(claimed, node.agent, node.headroom.endpoint, reservation, claimed_at)
            self._on_dispatch(claimed)
            return True
        return False

    async def _reserve(
        self, agent: str, reservation: str, job: Waiting, since: int, service: float, *, hold: bool
    ) -> bool:
        try:
            outcome = await self._source.reserve(
                agent,
                reservation,
                job.tokens,
                waiting_since_unix_ns=since,
                rank=job.priority,
                fair_service=service,
                hold_slot=hold,
                output_tokens=job.charge.output_tokens if job.charge is not None else 0,
                charge=self._fair.charge_of(job),
            )
        except HeadroomError as error:
            log.warning("reserve on %s failed: %s", agent, error)
            if giveback.unanswered(error):
                # The agent may have granted it all the same: nothing else would ever release it.
                await self._release(agent, reservation, unanswered=True)
            return False
        return outcome.granted

    async def _release(self, agent: str, reservation: str, *, unanswered: bool = False) -> None:
        await giveback.release(self._source, agent, reservation, unanswered=unanswered)

    async def _let_go(self) -> None:
        """The head no longer holds its place: a Release of its id ends its claim at once, rather than
        the agent holding room for it until the claim lapses."""
        hold, self._hold = self._hold, None
        if hold is not None:
            await self._release(hold.agent, hold.reservation)


@dataclass(frozen=True, slots=True)
class _Hold:
    """Where the queue's head holds its place, and since when (the dispatcher's clock)."""

    job: str
    agent: str
    reservation: str
    claim: HeadClaim
    at: float
