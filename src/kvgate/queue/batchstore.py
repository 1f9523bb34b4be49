"""Batches in the store, beside the jobs their lines become (written by the JobStore) and the files
they read and write (the FileStore).

A batch and all its lines are committed in one transaction (within the queue's bounds, or not at
all). It is settled once none of its lines is queued or running: its output and error files are
written and its status set in one transaction, by whichever replica gets there first (the status
update is conditional); those files belong to the batch's tenant and expire with its jobs' answers.
A batch's times are read on the database's clock, the one its lines' expiry is compared on. What a
client asks (get, list, cancel) is asked within its tenant: another tenant's batch is not found.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from kvgate.queue.batches import ENDED, OPEN, Batch, BatchStatus, Counts, StoredFile, encode_metadata
from kvgate.queue.database import Database, Row, Tx, literal, literals, owned_page
from kvgate.queue.filestore import FileStore
from kvgate.queue.jobs import ACTIVE, Job, JobState, NewJob
from kvgate.queue.store import JOB_COLUMNS, JobStore, Limits, QueueFull, job_from_row

_BATCH_COLUMNS = (
    "id, status, endpoint, input_file_id, completion_window, tenant, created_at, expires_at, total, "
    "completed, failed, metadata, errors, output_file_id, error_file_id, in_progress_at, finalizing_at, "
    "completed_at, failed_at, expired_at, cancelling_at, cancelled_at"
)
_OPEN_SQL = literals(OPEN)
_ENDED_SQL = literals(ENDED)
_ACTIVE_JOBS = literals(ACTIVE)


class BatchStore:
    def __init__(self, database: Database, jobs: JobStore, files: FileStore) -> None:
        self._database = database
        self._jobs = jobs
        self._files = files

    async def create(self, batch: Batch, lines: Sequence[NewJob], limits: Limits) -> Batch | QueueFull:
        """Commit `batch` and its lines, or the bound they would pass. The batch's times move onto the
        database's clock (the one its lines' expiry is compared on), and its lines expire with it."""
        async with self._database.transaction() as tx:
            batch = batch.on_clock(await self._now(tx))
            lines = [dataclasses.replace(line, expires_at=batch.expires_at) for line in lines]
            if lines:
                full = await self._jobs.add_many(tx, lines, limits)
                if full is not None:
                    return full
            await tx.execute(
                f"INSERT INTO kvgate_batches ({_BATCH_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                _batch_row(batch),
            )
        return batch

    async def batch(self, batch_id: str, tenant: str | None) -> Batch | None:
        """The batch, if `tenant`'s (None: whoever's, for the queue's own housekeeping)."""
        where, params = "id = ?", [batch_id]
        if tenant is not None:
            where += " AND tenant = ?"
            params.append(tenant)
        async with self._database.transaction() as tx:
            rows = await tx.execute(f"SELECT {_BATCH_COLUMNS} FROM kvgate_batches WHERE {where}", params)
            if not rows:
                return None
            found = _batch(rows[0])
            if found.status in OPEN:
                found = found.with_counts(await self._live_counts(tx, found))
        return found

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """`tenant`'s batches, newest first, after the cursor `after`; and whether there are more."""
        where, params = owned_page("kvgate_batches", tenant, after)
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {_BATCH_COLUMNS} FROM kvgate_batches WHERE {where} "
                "ORDER BY created_at DESC, id DESC LIMIT ?",
                (*params, limit + 1),
            )
            found = [_batch(row) for row in rows[:limit]]
            found = [b.with_counts(await self._live_counts(tx, b)) if b.status in OPEN else b for b in found]
        return found, len(rows) > limit

    async def cancel(self, batch_id: str, tenant: str) -> Batch | None:
        """Stop `tenant`'s open batch: its queued lines are cancelled, running ones finish; settled
        later. The batch as it is now (None: unknown to this tenant)."""
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_batches SET status = {literal(BatchStatus.CANCELLING)}, "
                f"cancelling_at = {self._database.now_sql} "
                f"WHERE id = ? AND tenant = ? AND status IN {_OPEN_SQL} AND cancelling_at IS NULL "
                "RETURNING id",
                (batch_id, tenant),
            )
            if rows:
                await self._jobs.cancel_batch(tx, batch_id)
        return await self.batch(batch_id, tenant)

    async def settled(self) -> list[str]:
        """Open batches none of whose lines is queued or running any more."""
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT id FROM kvgate_batches b WHERE status IN {_OPEN_SQL} AND NOT EXISTS "
                f"(SELECT 1 FROM kvgate_jobs j WHERE j.batch_id = b.id AND j.state IN {_ACTIVE_JOBS})"
            )
        return [row[0] for row in rows]

    async def lines(self, batch_id: str) -> list[Job]:
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {JOB_COLUMNS} FROM kvgate_jobs WHERE batch_id = ? ORDER BY line", (batch_id,)
            )
        return [job_from_row(row) for row in rows]

    async def finish(
        self,
        batch: Batch,
        status: BatchStatus,
        counts: Counts,
        output: tuple[StoredFile, bytes] | None,
        errors: tuple[StoredFile, bytes] | None,
        *,
        files_ttl_s: float,
    ) -> bool:
        """Settle `batch` with its output and error files, which expire `files_ttl_s` after it ended;
        False if another replica settled it first."""
        ended_column = {
            BatchStatus.COMPLETED: "completed_at",
            BatchStatus.CANCELLED: "cancelled_at",
            BatchStatus.EXPIRED: "expired_at",
        }[status]
        async with self._database.transaction() as tx:
            now = await self._now(tx)
            rows = await tx.execute(
                f"UPDATE kvgate_batches SET status = ?, finalizing_at = ?, {ended_column} = ?, "
                "completed = ?, failed = ?, output_file_id = ?, error_file_id = ? "
                f"WHERE id = ? AND status IN {_OPEN_SQL} RETURNING id",
                (
                    status.value,
                    now,
                    now,
                    counts.completed,
                    counts.failed,
                    output[0].id if output else None,
                    errors[0].id if errors else None,
                    batch.id,
                ),
            )
            if not rows:
                return False
            for stored, content in (f for f in (output, errors) if f is not None):
                stamped = dataclasses.replace(stored, created_at=now, expires_at=now + files_ttl_s)
                await self._files.put(tx, stamped, content)
        return True

    async def sweep(self, kept_s: float) -> int:
        """Delete batches that ended more than `kept_s` ago (their lines go with the JobStore's sweep,
        their files with their own expiry); how many."""
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"DELETE FROM kvgate_batches WHERE status IN {_ENDED_SQL} AND coalesce(completed_at, "
                f"failed_at, expired_at, cancelled_at, created_at) < {self._database.now_sql} - ? "
                "RETURNING id",
                (kept_s,),
            )
        return len(rows)

    async def _now(self, tx: Tx) -> float:
        """The database's clock, read once for times that must agree."""
        ((now,),) = await tx.execute(f"SELECT {self._database.now_sql}")
        return float(now)

    async def _live_counts(self, tx: Tx, batch: Batch) -> Counts:
        rows = await tx.execute(
            "SELECT state, count(*) FROM kvgate_jobs WHERE batch_id = ? GROUP BY state", (batch.id,)
        )
        by_state = {JobState(state): int(n) for state, n in rows}
        completed = by_state.get(JobState.SUCCEEDED, 0)
        ended = sum(n for state, n in by_state.items() if state not in ACTIVE)
        return Counts(batch.counts.total, completed, ended - completed)


def _batch_row(batch: Batch) -> tuple[object, ...]:
    return (
        batch.id,
        batch.status.value,
        batch.endpoint,
        batch.input_file_id,
        batch.completion_window,
        batch.tenant,
        batch.created_at,
        batch.expires_at,
        batch.counts.total,
        batch.counts.completed if batch.status not in OPEN else None,
        batch.counts.failed if batch.status not in OPEN else None,
        encode_metadata(batch.metadata),
        json.dumps(list(batch.errors)) if batch.errors else None,
        batch.output_file_id,
        batch.error_file_id,
        batch.in_progress_at,
        batch.finalizing_at,
        batch.completed_at,
        batch.failed_at,
        batch.expired_at,
        batch.cancelling_at,
        batch.cancelled_at,
    )


def _batch(row: Row) -> Batch:
    r: Sequence[Any] = row
    return Batch(
        id=r[0],
        status=BatchStatus(r[1]),
        endpoint=r[2],
        input_file_id=r[3],
        completion_window=r[4],
        tenant=r[5],
        created_at=float(r[6]),
        expires_at=r[7],
        counts=Counts(int(r[8]), int(r[9] or 0), int(r[10] or 0)),
        metadata=json.loads(r[11]) if r[11] else None,
        errors=tuple(json.loads(r[12])) if r[12] else (),
        output_file_id=r[13],
        error_file_id=r[14],
        in_progress_at=r[15],
        finalizing_at=r[16],
        completed_at=r[17],
        failed_at=r[18],
        expired_at=r[19],
        cancelling_at=r[20],
        cancelled_at=r[21],
    )
