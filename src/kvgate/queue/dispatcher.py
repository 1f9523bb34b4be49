"""The dispatch loop: the next job by priority and fair share, on a node whose agent reserved for it.

Each round reads the heads of the waiting groups from the store (only when something changed),
asks the fair queue for the next job, and tries the nodes the gate's own rule picks for its tokens
(kvgate.policy.nodes.choose_nodes) until an agent grants the Reserve; then it claims the job in the
store and hands it to the runner. Order is strict: when the next job fits no node, nothing behind it
is dispatched (a big job is never starved by small ones); the loop waits for the headroom stream,
a job that ends here, or a store event. A job bigger than every node's admissible capacity fails.

Reserve comes before the claim: the reservation id names this replica, so when two replicas reserve
for the same job only the one whose claim lands keeps it, and the other gives its reservation back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from kvgate.errors import HeadroomError, StoreError
from kvgate.headroom import giveback
from kvgate.headroom.snapshot import NodeView, ReleaseOutcome, ReserveOutcome
from kvgate.policy.nodes import StalePolicy, choose_nodes
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


class HeadroomSource(Protocol):
    """What the dispatcher needs of the long pool's agents (kvgate.headroom.view.HeadroomView, whose
    reservations the service gives the lease `queue.reservation_lease_s`)."""

    def snapshot(self) -> tuple[NodeView, ...]: ...

    async def reserve(self, node: str, request_id: str, tokens: int) -> ReserveOutcome: ...

    async def release(self, node: str, request_id: str, *, unanswered: bool = False) -> ReleaseOutcome: ...

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
    ) -> None:
        self._store = store
        self._source = source
        self._launcher = launcher
        self._owner = owner
        self._claim_lease_s = claim_lease_s
        self._stale = stale_nodes
        self._refresh_s = refresh_s
        self._on_dispatch = on_dispatch
        self._clock = clock
        self._fair = FairQueue()
        self._wake = asyncio.Event()
        # The next job fits no node now: headroom updates are worth a round.
        self._blocked = False
        self._stopping = False
        self._last_reload = -math.inf

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
            if await self._source.wait_update(1.0) and self._blocked:
                self._wake.set()

    async def _round(self) -> None:
        if self._fair.needs_reload:
            await self._reload()
        self._blocked = False
        while (job := self._fair.next()) is not None:
            nodes = self._source.snapshot()
            if placement.fit(nodes, job.tokens) is Fit.TOO_BIG:
                await self._store.fail_waiting(job.id, placement.too_big_error(nodes, job.tokens))
                self._fair.drop(job)
                continue
            if not await self._dispatch(job, nodes):
                self._blocked = True
                return
            if self._fair.needs_reload:
                await self._reload()

    async def _reload(self) -> None:
        wait = self._last_reload + MIN_RELOAD_S - self._clock()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_reload = self._clock()
        self._fair.load(await self._store.waiting(PER_GROUP), PER_GROUP)

    async def _dispatch(self, job: Waiting, nodes: tuple[NodeView, ...]) -> bool:
        """Reserve, claim and launch `job`; False when no node granted it room."""
        reservation = f"{job.id}/{job.attempts + 1}/{self._owner}"
        for node in choose_nodes(nodes, job.tokens, self._stale).candidates:
            if node.headroom is None or not await self._reserve(node.agent, reservation, job.tokens):
                continue
            claimed_at = self._clock()
            try:
                claimed = await self._store.claim(
                    job.id, self._owner, node.agent, reservation, self._claim_lease_s
                )
            except BaseException:
                await asyncio.shield(self._release(node.agent, reservation))
                raise
            if claimed is None:
                # Cancelled meanwhile, or another replica claimed it first.
                await self._release(node.agent, reservation)
                self._fair.drop(job)
                return True
            self._fair.dispatched(job)
            self._launcher.launch(claimed, node.agent, node.headroom.endpoint, reservation, claimed_at)
            self._on_dispatch(claimed)
            return True
        return False

    async def _reserve(self, agent: str, reservation: str, tokens: int) -> bool:
        try:
            outcome = await self._source.reserve(agent, reservation, tokens)
        except HeadroomError as error:
            log.warning("reserve on %s failed: %s", agent, error)
            if giveback.unanswered(error):
                # The agent may have granted it all the same: nothing else would ever release it.
                await self._release(agent, reservation, unanswered=True)
            return False
        return outcome.granted

    async def _release(self, agent: str, reservation: str, *, unanswered: bool = False) -> None:
        await giveback.release(self._source, agent, reservation, unanswered=unanswered)
