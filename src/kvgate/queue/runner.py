"""Running claimed jobs: the engine call, its result, the KV reservation's release, and the leases.

A job arrives here claimed in the store and reserved on a node; the runner sends it to that node's
engine, relays the answer to held clients on this replica (kvgate.queue.live), releases the
reservation as soon as the engine has answered, and records the result. While jobs run it renews
their claims in the store and their reservations on the agents every third of `claim_lease_s`; a
job whose claim it could not renew for two thirds of the lease is aborted before the lease can run
out, so another replica that reruns it never overlaps with this one.

How an attempt ends:
- the engine answered (any status): finished, its answer stored (2xx succeeded, else failed);
- the engine gave no complete answer: back in the queue, unless a held client already saw part of
  it or it was the last allowed attempt (then failed);
- cancelled (DELETE, hold timeout): the engine call is cut; the store already says cancelled;
- claim lost: the call is cut, the store is left alone (another replica runs it again);
- the replica stops: the call is cut and the job goes back to the queue at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from kvgate.config.queue import QueueSettings
from kvgate.errors import HeadroomError, StoreError
from kvgate.headroom import giveback
from kvgate.headroom.snapshot import ReleaseOutcome, ReserveOutcome
from kvgate.names import JOB_ID_HEADER
from kvgate.queue.engines import EngineFailure
from kvgate.queue.jobs import Job, JobError, JobRequest, JobResult
from kvgate.queue.live import Head, LiveRun, LiveRuns

log = logging.getLogger(__name__)


class Answer(Protocol):
    head: Head

    def chunks(self) -> AsyncIterator[bytes]: ...


class Engines(Protocol):
    def send(
        self, endpoint: str, request: JobRequest, headers: Mapping[str, str]
    ) -> AbstractAsyncContextManager[Answer]: ...


class RunStore(Protocol):
    async def finish(
        self, job: Job, owner: str, result: JobResult | None, error: JobError | None = None
    ) -> bool: ...

    async def requeue(self, job: Job, owner: str) -> bool: ...

    async def renew(self, owner: str, running: Sequence[str], lease_s: float) -> set[str]: ...


class Reservations(Protocol):
    async def reserve(self, node: str, request_id: str, tokens: int) -> ReserveOutcome: ...

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome: ...

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]: ...


class Abort(enum.Enum):
    CANCELLED = "cancelled"  # the store already says so
    LOST = "lost"  # the claim was lost: leave the store alone
    STOPPING = "stopping"  # requeue at once


@dataclass(eq=False, slots=True)
class _Running:
    job: Job
    agent: str
    reservation: str
    valid_until: float
    task: asyncio.Task[None] | None = None
    abort: Abort | None = None


class Runner:
    def __init__(
        self,
        store: RunStore,
        reservations: Reservations,
        engines: Engines,
        live: LiveRuns,
        *,
        settings: QueueSettings,
        owner: str,
        on_end: Callable[[Job, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._reservations = reservations
        self._engines = engines
        self._live = live
        self._settings = settings
        self._owner = owner
        self._on_end = on_end
        self._clock = clock
        self._running: dict[str, _Running] = {}
        # The share of the claim lease a confirmation counts for; the rest is margin to abort in.
        self._trust_s = settings.claim_lease_s * 2 / 3

    def __len__(self) -> int:
        return len(self._running)

    def launch(self, job: Job, agent: str, endpoint: str, reservation: str, claimed_at: float) -> None:
        """Run `job` (claimed at monotonic time `claimed_at`, reserved as `reservation` on `agent`)."""
        entry = _Running(job, agent, reservation, claimed_at + self._trust_s)
        self._running[job.id] = entry
        entry.task = asyncio.create_task(self._run(entry, endpoint), name=f"kvgate-job-{job.id}")

    def abort(self, job_id: str, why: Abort) -> None:
        entry = self._running.get(job_id)
        if entry is not None and entry.task is not None and entry.abort is None:
            entry.abort = why
            entry.task.cancel()

    async def stop(self) -> None:
        """Cut every engine call and put those jobs back in the queue."""
        entries = list(self._running.values())
        for entry in entries:
            self.abort(entry.job.id, Abort.STOPPING)
        await asyncio.gather(*(e.task for e in entries if e.task is not None), return_exceptions=True)

    async def _run(self, entry: _Running, endpoint: str) -> None:
        job = entry.job
        live = self._live.open(job.id)
        ended = "failed"
        try:
            ended = await self._attempt(entry, endpoint, live)
        except asyncio.CancelledError:
            ended = (entry.abort or Abort.STOPPING).value
            live.end(
                JobError(ended, "The job's engine call was cut."), requeued=entry.abort is not Abort.CANCELLED
            )
            await asyncio.shield(self._after_abort(entry))
            raise
        except StoreError as error:
            # The claim lease brings it back if the result could not be recorded.
            log.warning("job %s: the store failed: %s", job.id, error)
            live.end(JobError("store_unavailable", str(error)), requeued=True)
        finally:
            self._live.close(job.id, live)
            del self._running[job.id]
            self._on_end(job, ended)

    async def _attempt(self, entry: _Running, endpoint: str, live: LiveRun) -> str:
        job = entry.job
        result: JobResult | None = None
        error: JobError | None = None
        try:
            result = await self._call(job, endpoint, live)
        except EngineFailure as failure:
            if not live.relayed and job.attempts < self._settings.max_attempts:
                # Ended before any await: no held client may start relaying this dead attempt.
                live.end(JobError("engine_failed", str(failure)), requeued=True)
                await self._release(entry)
                await self._store.requeue(job, self._owner)
                log.info("job %s requeued after attempt %d: %s", job.id, job.attempts, failure)
                return "requeued"
            error = JobError(
                "engine_failed", f"{failure} (attempt {job.attempts} of {self._settings.max_attempts})"
            )
        # The engine is done with it: give the capacity back before anything else.
        await self._release(entry)
        await self._store.finish(job, self._owner, result, error)
        live.end(error)
        if error is not None or result is None or not result.ok:
            return "failed"
        return "succeeded"

    async def _call(self, job: Job, endpoint: str, live: LiveRun) -> JobResult:
        assert job.request is not None, "a claimed job carries its request"
        headers = {JOB_ID_HEADER: job.id}
        if job.request_id:
            headers["x-request-id"] = job.request_id
        parts: list[bytes] = []
        async with self._engines.send(endpoint, job.request, headers) as answer:
            live.start(answer.head)
            async for chunk in answer.chunks():
                parts.append(chunk)
                live.add(chunk)
        return JobResult(answer.head.status, answer.head.content_type, b"".join(parts))

    async def _after_abort(self, entry: _Running) -> None:
        await self._release(entry)
        if entry.abort in (None, Abort.STOPPING):
            with contextlib.suppress(StoreError):
                await self._store.requeue(entry.job, self._owner)

    async def _release(self, entry: _Running) -> None:
        await giveback.release(self._reservations, entry.agent, entry.reservation)

    async def keep_claims(self) -> None:
        """Forever: renew claims and reservations, and abort what could not be renewed in time."""
        renewer = asyncio.create_task(self._renew_forever(), name="kvgate-queue-renew")
        try:
            while True:
                await asyncio.sleep(self._settings.claim_lease_s / 10)
                now = self._clock()
                for entry in list(self._running.values()):
                    if now > entry.valid_until:
                        log.warning(
                            "job %s: claim not renewed in time; cutting its engine call", entry.job.id
                        )
                        self.abort(entry.job.id, Abort.LOST)
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.claim_lease_s / 3)
            await self.renew()

    async def renew(self) -> None:
        entries = list(self._running.values())
        if not entries:
            return
        sent = self._clock()
        try:
            lost = await self._store.renew(
                self._owner, [e.job.id for e in entries], self._settings.claim_lease_s
            )
        except StoreError as error:
            log.warning("could not renew %d claims: %s", len(entries), error)
            return
        for entry in entries:
            if entry.job.id in lost:
                self.abort(entry.job.id, Abort.LOST)
            else:
                entry.valid_until = sent + self._trust_s
        by_agent: dict[str, list[str]] = {}
        for entry in entries:
            if entry.job.id not in lost:
                by_agent.setdefault(entry.agent, []).append(entry.reservation)
        await asyncio.gather(*(self._renew_reservations(agent, ids) for agent, ids in by_agent.items()))

    async def _renew_reservations(self, agent: str, reservations: list[str]) -> None:
        """One Renew for every running job's reservation on `agent`. One that lapsed is not booked
        again (its room may be another's by now): its job runs on, and the agent sees its KV in the
        engine's usage (kvgate.gate.leases says the same of the gate's)."""
        try:
            lapsed = await self._reservations.renew(agent, reservations)
        except HeadroomError as error:
            log.warning("could not renew %d reservations on %s: %s", len(reservations), agent, error)
            return
        for reservation in lapsed:
            log.warning(
                "reservation %s on %s lapsed before its renewal: its job runs on unreserved",
                reservation,
                agent,
            )
