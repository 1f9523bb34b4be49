"""The queue's store against both databases it runs on: SQLite and a real PostgreSQL server.

Every transition is one conditional write: these tests check that two replicas claiming the same job
get it once, that a stale owner cannot record a result, that bounds hold, that leases run out into
the queue again, and that the events replicas wake on are sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest
from postgres import PostgresServer, postgres_server
from waiting import until_async

from kvgate.errors import StoreError
from kvgate.queue.batches import Batch, BatchStatus, Counts
from kvgate.queue.batchstore import BatchStore
from kvgate.queue.filestore import FileStore
from kvgate.queue.jobs import JobError, JobRequest, JobResult, JobState, NewJob, new_id
from kvgate.queue.store import CANCEL, DONE, NEW, JobStore, Limits, QueueFull
from kvgate.queue.stores import open_database

T = TypeVar("T")
ROOMY = Limits(max_jobs=1000, max_tokens_waiting=10**9)
Opener = Callable[[], JobStore]


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens a store on one fresh database; each call is another replica (or a restart) on it."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'queue.db'}"
    else:
        url = request.getfixturevalue("postgres").new_database()
    return lambda: JobStore(open_database(url))


@asynccontextmanager
async def opened(opener: Opener) -> AsyncIterator[JobStore]:
    store = opener()
    await store.start()
    try:
        yield store
    finally:
        await store.close()


def job(tokens: int = 1000, tenant: str = "t", priority: int = 1, request_id: str | None = None) -> NewJob:
    return NewJob(
        id=new_id("job_"),
        request=JobRequest("/v1/chat/completions", (("content-type", "application/json"),), b"{}"),
        tokens=tokens,
        priority=priority,
        tenant=tenant,
        request_id=request_id,
    )


async def added(store: JobStore, new: NewJob, limits: Limits = ROOMY) -> str:
    result = await store.add(new, limits)
    assert not isinstance(result, QueueFull), result
    return result.id


def test_a_job_is_found_by_id_and_by_request_id_and_a_request_id_names_one_job(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            first = await added(store, job(request_id="req-1"))
            again = await store.add(job(request_id="req-1"), ROOMY)
            assert not isinstance(again, QueueFull) and again.id == first
            by_request = await store.get("req-1", "t")
            assert by_request is not None and by_request.id == first
            found = await store.get(first, "t")
            assert found is not None and found.state is JobState.QUEUED and found.tokens == 1000

    run(scenario)


def test_bounds_refuse_past_max_jobs_and_past_max_tokens_waiting(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            limits = Limits(max_jobs=2, max_tokens_waiting=2500)
            await added(store, job(1000), limits)
            full = await store.add(job(2000), limits)
            assert isinstance(full, QueueFull) and "queue.max_tokens_waiting is 2500" in full.why
            await added(store, job(1000), limits)
            full = await store.add(job(10), limits)
            assert isinstance(full, QueueFull) and "queue.max_jobs is 2" in full.why

    run(scenario)


def test_two_replicas_claiming_one_job_at_once_get_it_once(postgres: PostgresServer) -> None:
    """PostgreSQL only: SQLite serves one replica (see the last test)."""
    url = postgres.new_database()

    def opener() -> JobStore:
        return JobStore(open_database(url))

    async def scenario() -> None:
        async with opened(opener) as one, opened(opener) as two:
            for _ in range(10):
                job_id = await added(one, job())
                claims = await asyncio.gather(
                    one.claim(job_id, "r1", "node-a", "res-1", 30),
                    two.claim(job_id, "r2", "node-b", "res-2", 30),
                )
                winners = [c for c in claims if c is not None]
                assert len(winners) == 1
                assert winners[0].request is not None and winners[0].attempts == 1

    run(scenario)


def test_a_claimed_job_carries_its_request_and_only_its_owner_records_the_result(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            job_id = await added(store, job())
            claimed = await store.claim(job_id, "r1", "node-a", "res-1", 30)
            assert claimed is not None and claimed.request is not None
            assert claimed.request.headers == (("content-type", "application/json"),)
            assert await store.claim(job_id, "r2", "node-a", "res-2", 30) is None
            result = JobResult(200, "application/json", b'{"ok": true}')
            assert not await store.finish(claimed, "r2", result)
            assert await store.finish(claimed, "r1", result)
            done = await store.get(job_id, "t")
            assert done is not None and done.state is JobState.SUCCEEDED and done.result == result
            assert not await store.finish(claimed, "r1", result)

    run(scenario)


def test_an_engine_error_answer_is_kept_and_the_job_failed(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            claimed = await store.claim(await added(store, job()), "r1", "n", "res", 30)
            assert claimed is not None
            await store.finish(claimed, "r1", JobResult(400, "application/json", b'{"error": {}}'))
            done = await store.get(claimed.id, "t")
            assert done is not None and done.state is JobState.FAILED and done.result is not None

    run(scenario)


def test_a_claim_whose_lease_ran_out_goes_back_to_the_queue_with_its_reservation(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            job_id = await added(store, job())
            claimed = await store.claim(job_id, "r1", "node-a", "res-1", 3600)
            assert claimed is not None
            assert await store.recover() == []
            # The lease runs out: renewed to end now, it has ended once the database clock moves on.
            assert await store.renew("r1", [job_id], 0) == set()
            (recovered,) = await until_async(store.recover, "the claim whose lease ran out")
            assert (recovered.id, recovered.node, recovered.reservation) == (job_id, "node-a", "res-1")
            assert recovered.state is JobState.QUEUED
            # The old owner's late result is not recorded; the next claim is attempt 2.
            assert not await store.finish(claimed, "r1", JobResult(200, "text/plain", b""))
            again = await store.claim(job_id, "r2", "node-b", "res-2", 30)
            assert again is not None and again.attempts == 2

    run(scenario)


def test_renewing_keeps_claims_and_names_the_ones_lost(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            kept, cancelled = await added(store, job()), await added(store, job())
            for job_id in (kept, cancelled):
                # Leases that end at once: only the renewal below keeps the claim.
                assert await store.claim(job_id, "r1", "n", f"res-{job_id}", 0) is not None
            await store.cancel(cancelled, "t", JobError("cancelled", "by test"))
            assert await store.renew("r1", [kept, cancelled], 3600) == {cancelled}
            await asyncio.sleep(0.05)  # the database clock moves past the claims' own leases
            assert await store.recover() == []

    run(scenario)


def test_a_held_job_whose_hold_lapses_is_not_run_and_is_cancelled_until_its_client_comes_back(
    opener: Opener,
) -> None:
    """A held job's client left (or its replica died): nothing renews its hold, and an engine would
    otherwise run it for nobody, charged to its tenant (kvgate.queue.live)."""

    async def scenario() -> None:
        async with opened(opener) as store:
            held = dataclasses.replace(job(request_id="req-held"), hold_s=3600.0)
            kept = await added(store, dataclasses.replace(job(), hold_s=3600.0))
            lapsing, deferred = await added(store, held), await added(store, job())
            # Renewed to end now: once the database clock moves on, the hold has lapsed.
            await store.hold([lapsing], 0)
            await store.hold([kept], 3600)
            (waiting,) = await until_async(
                lambda: _ids_once(store, lambda ids: lapsing not in ids), "the lapsed job out of the line"
            )
            assert waiting == {kept, deferred}
            assert await store.claim(lapsing, "r1", "n", "res", 30) is None
            assert await store.abandon() == [lapsing]
            found = await store.get("req-held", "t")
            assert found is not None and found.state is JobState.CANCELLED
            assert found.error is not None and found.error.code == "client_gone"
            assert await store.abandon() == []
            # Its client comes back with the same request id: the same job, queued again and held.
            back = await store.add(held, ROOMY)
            assert not isinstance(back, QueueFull) and (back.id, back.state) == (lapsing, JobState.QUEUED)
            assert back.error is None and back.finished_at is None
            assert await store.claim(lapsing, "r1", "n", "res", 30) is not None

    run(scenario)


async def _ids_once(store: JobStore, wanted: Callable[[set[str]], bool]) -> tuple[set[str]] | None:
    """The ids of the waiting jobs once `wanted` holds of them."""
    ids = {w.id for w in await store.waiting(10)}
    return (ids,) if wanted(ids) else None


def test_a_batch_lines_window_is_no_hold_and_a_holds_lapse_is_no_batch_expiry(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            batches = BatchStore(store.database, store, FileStore(store.database))
            closed, late = batch_of(1, window_s=-1.0)
            await batches.create(closed, late, ROOMY)
            held = await added(store, dataclasses.replace(job(), hold_s=3600.0))
            await store.hold([held, late[0].id], 0)
            await until_async(lambda: _ids_once(store, lambda ids: not ids), "both out of the line")
            assert await store.abandon() == [held]
            assert await store.expire() == [closed.id]
            assert [line.state for line in await batches.lines(closed.id)] == [JobState.EXPIRED]

    run(scenario)


def test_cancel_ends_a_waiting_job_and_leaves_an_ended_one_alone(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            job_id = await added(store, job())
            cancelled = await store.cancel(job_id, "t", JobError("cancelled", "by test"))
            assert cancelled is not None and cancelled.state is JobState.CANCELLED
            assert await store.claim(job_id, "r1", "n", "res", 30) is None
            claimed = await store.claim(await added(store, job()), "r1", "n", "res", 30)
            assert claimed is not None
            await store.finish(claimed, "r1", JobResult(200, "text/plain", b"done"))
            ended = await store.cancel(claimed.id, "t", JobError("cancelled", "too late"))
            assert ended is not None and ended.state is JobState.SUCCEEDED
            assert await store.cancel("job_unknown", "t", JobError("cancelled", "")) is None

    run(scenario)


def test_waiting_gives_the_oldest_jobs_of_each_priority_and_tenant(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            ids = {}
            for tenant, priority, count in (("a", 1, 5), ("b", 1, 1), ("a", 0, 2)):
                ids[(tenant, priority)] = [
                    await added(store, job(tenant=tenant, priority=priority)) for _ in range(count)
                ]
            heads = await store.waiting(per_group=3)
            by_group: dict[tuple[str, int], list[str]] = {}
            for head in sorted(heads, key=lambda w: w.seq):
                by_group.setdefault((head.tenant, head.priority), []).append(head.id)
            assert by_group == {("a", 1): ids[("a", 1)][:3], ("b", 1): ids[("b", 1)], ("a", 0): ids[("a", 0)]}

    run(scenario)


def test_store_events_announce_new_ended_and_cancelled_jobs(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            heard: list[str] = []
            store.database.subscribe(heard.append)
            first = await added(store, job())
            claimed = await store.claim(first, "r1", "n", "res", 30)
            assert claimed is not None
            await store.finish(claimed, "r1", JobResult(200, "text/plain", b""))
            second = await added(store, job())
            await store.cancel(second, "t", JobError("cancelled", "by test"))
            wanted = [NEW, DONE + first, NEW, CANCEL + second, DONE + second]
            await until_async(lambda: [e for e in heard if e in wanted] == wanted, f"the events {wanted}")

    run(scenario)


def test_results_older_than_their_ttl_are_deleted(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            claimed = await store.claim(await added(store, job()), "r1", "n", "res", 30)
            assert claimed is not None
            await store.finish(claimed, "r1", JobResult(200, "text/plain", b""))
            waiting = await added(store, job())
            assert await store.sweep(result_ttl_s=60) == 0
            await asyncio.sleep(0.2)
            assert await store.sweep(result_ttl_s=0.1) == 1
            assert await store.get(claimed.id, "t") is None and await store.get(waiting, "t") is not None

    run(scenario)


def test_sqlite_serves_one_process_and_requeues_what_a_dead_one_left_running(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'queue.db'}"

    async def scenario() -> None:
        first = JobStore(open_database(url))
        await first.start()
        job_id = await added(first, job())
        assert await first.claim(job_id, "r1", "node-a", "res-1", 3600) is not None
        second = JobStore(open_database(url))
        with pytest.raises(StoreError, match="another kvgate queue uses"):
            await second.start()
        await first.close()
        restarted = JobStore(open_database(url))
        (left,) = await restarted.start()
        assert (left.id, left.state, left.node, left.reservation) == (
            job_id,
            JobState.QUEUED,
            "node-a",
            "res-1",
        )
        await restarted.close()

    run(scenario)


def test_stats_count_jobs_by_state_the_oldest_wait_and_tokens_per_tenant(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            empty = await store.stats()
            assert (empty.jobs, empty.oldest_queued_s, empty.tokens_waiting) == ({}, None, {})
            first = await added(store, job(1000, tenant="a"))
            await asyncio.sleep(0.2)
            await added(store, job(2000, tenant="a"))
            await added(store, job(500, tenant="b"))
            assert await store.claim(first, "r1", "n", "res", 30) is not None
            stats = await store.stats()
            assert stats.jobs == {"queued": 2, "running": 1}
            assert stats.tokens_waiting == {"a": 2000, "b": 500}
            assert stats.oldest_queued_s is not None and 0 <= stats.oldest_queued_s < 3600

    run(scenario)


def batch_of(lines: int, window_s: float = 24 * 3600.0) -> tuple[Batch, list[NewJob]]:
    """A batch created now (by this process's clock), open for `window_s`, and its lines."""
    now = time.time()
    batch = Batch(
        new_id("batch_"), BatchStatus.IN_PROGRESS, "/v1/chat/completions", "file-x", "24h", "t", now,
        now + window_s, Counts(lines), in_progress_at=now,
    )  # fmt: skip
    return batch, [
        dataclasses.replace(job(), batch_id=batch.id, line=n, custom_id=f"c{n}", expires_at=batch.expires_at)
        for n in range(lines)
    ]


def test_a_cancelled_batchs_waiting_lines_end_in_the_job_store_and_are_announced(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            heard: list[str] = []
            store.database.subscribe(heard.append)
            batches = BatchStore(store.database, store, FileStore(store.database))
            batch, lines = batch_of(3)
            assert isinstance(await batches.create(batch, lines, ROOMY), Batch)
            assert await store.claim(lines[0].id, "r1", "n", "res", 30) is not None
            cancelling = await batches.cancel(batch.id, "t")
            assert cancelling is not None and cancelling.status is BatchStatus.CANCELLING
            states = [line.state for line in await batches.lines(batch.id)]
            assert states == [JobState.RUNNING, JobState.CANCELLED, JobState.CANCELLED], (
                "running lines finish"
            )
            wanted = {DONE + lines[1].id, DONE + lines[2].id}
            await until_async(lambda: wanted <= set(heard), f"the events {wanted}")
            assert DONE + lines[0].id not in heard

    run(scenario)


def test_expired_batch_lines_are_announced_ended(opener: Opener) -> None:
    async def scenario() -> None:
        async with opened(opener) as store:
            heard: list[str] = []
            store.database.subscribe(heard.append)
            batches = BatchStore(store.database, store, FileStore(store.database))
            closed, late = batch_of(2, window_s=-1.0)
            await batches.create(closed, late, ROOMY)
            assert await store.expire() == [closed.id]
            assert [line.state for line in await batches.lines(closed.id)] == [JobState.EXPIRED] * 2
            wanted = {DONE + line.id for line in late}
            await until_async(lambda: wanted <= set(heard), f"the events {wanted}")

    run(scenario)


def test_a_batchs_times_and_its_lines_expiry_are_read_on_the_databases_clock(opener: Opener) -> None:
    """A replica whose clock is ten days behind the database's must not expire its batch at once."""

    async def scenario() -> None:
        async with opened(opener) as store:
            batches = BatchStore(store.database, store, FileStore(store.database))
            batch, lines = batch_of(2)
            behind = batch.on_clock(batch.created_at - 10 * 24 * 3600)
            created = await batches.create(behind, lines, ROOMY)
            assert isinstance(created, Batch) and abs(created.created_at - time.time()) < 3600
            assert created.expires_at == pytest.approx(created.created_at + 24 * 3600)
            assert created.in_progress_at == created.created_at
            assert await store.expire() == []
            assert [line.state for line in await batches.lines(batch.id)] == [JobState.QUEUED] * 2
            cancelling = await batches.cancel(batch.id, "t")
            assert cancelling is not None and cancelling.cancelling_at is not None
            assert created.created_at <= cancelling.cancelling_at < created.created_at + 3600

    run(scenario)
