"""Files and batches in the store, beside the jobs their lines become (written by the JobStore).

A batch and all its lines are committed in one transaction (within the queue's bounds, or not at
all). It is settled once none of its lines is queued or running: its output and error files are
written and its status set in one transaction, by whichever replica gets there first (the status
update is conditional). A batch's times are read on the database's clock, the one its lines' expiry
is compared on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from kvgate.queue.batches import OPEN, Batch, BatchStatus, Counts, StoredFile, encode_metadata
from kvgate.queue.database import Database, Row, Tx, literal, literals
from kvgate.queue.jobs import ACTIVE, Job, JobState, NewJob
from kvgate.queue.store import JOB_COLUMNS, JobStore, Limits, QueueFull, job_from_row

_FILE_COLUMNS = "id, purpose, filename, bytes, created_at"
_BATCH_COLUMNS = (
    "id, status, endpoint, input_file_id, completion_window, tenant, created_at, expires_at, total, "
    "completed, failed, metadata, errors, output_file_id, error_file_id, in_progress_at, finalizing_at, "
    "completed_at, failed_at, expired_at, cancelling_at, cancelled_at"
)
_OPEN_SQL = literals(OPEN)
_ACTIVE_JOBS = literals(ACTIVE)


class BatchStore:
    def __init__(self, database: Database, jobs: JobStore) -> None:
        self._database = database
        self._jobs = jobs

    async def put_file(self, stored: StoredFile, content: bytes) -> None:
        async with self._database.transaction() as tx:
            await tx.execute(
                f"INSERT INTO kvgate_files ({_FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?)",
                (stored.id, stored.purpose, stored.filename, stored.bytes, stored.created_at, content),
            )

    async def file(self, file_id: str) -> StoredFile | None:
        async with self._database.transaction() as tx:
            rows = await tx.execute(f"SELECT {_FILE_COLUMNS} FROM kvgate_files WHERE id = ?", (file_id,))
        return _file(rows[0]) if rows else None

    async def content(self, file_id: str) -> bytes | None:
        async with self._database.transaction() as tx:
            rows = await tx.execute("SELECT content FROM kvgate_files WHERE id = ?", (file_id,))
        return bytes(rows[0][0]) if rows else None

    async def files(
        self, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[StoredFile], bool]:
        """Newest first, after the cursor `after`; and whether there are more."""
        where, params = _after("kvgate_files", after)
        if purpose is not None:
            where += " AND purpose = ?"
            params.append(purpose)
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {_FILE_COLUMNS} FROM kvgate_files WHERE {where} ORDER BY created_at DESC, id DESC "
                "LIMIT ?",
                (*params, limit + 1),
            )
        return [_file(row) for row in rows[:limit]], len(rows) > limit

    async def delete_file(self, file_id: str) -> bool:
        async with self._database.transaction() as tx:
            rows = await tx.execute("DELETE FROM kvgate_files WHERE id = ? RETURNING id", (file_id,))
        return bool(rows)

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

    async def batch(self, batch_id: str) -> Batch | None:
        async with self._database.transaction() as tx:
            rows = await tx.execute(f"SELECT {_BATCH_COLUMNS} FROM kvgate_batches WHERE id = ?", (batch_id,))
            if not rows:
                return None
            found = _batch(rows[0])
            if found.status in OPEN:
                found = found.with_counts(await self._live_counts(tx, found))
        return found

    async def batches(self, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        where, params = _after("kvgate_batches", after)
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {_BATCH_COLUMNS} FROM kvgate_batches WHERE {where} "
                "ORDER BY created_at DESC, id DESC LIMIT ?",
                (*params, limit + 1),
            )
            found = [_batch(row) for row in rows[:limit]]
            found = [b.with_counts(await self._live_counts(tx, b)) if b.status in OPEN else b for b in found]
        return found, len(rows) > limit

    async def cancel(self, batch_id: str) -> Batch | None:
        """Stop an open batch: its queued lines are cancelled, running ones finish; settled later."""
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_batches SET status = {literal(BatchStatus.CANCELLING)}, "
                f"cancelling_at = {self._database.now_sql} "
                f"WHERE id = ? AND status IN {_OPEN_SQL} AND cancelling_at IS NULL RETURNING id",
                (batch_id,),
            )
            if rows:
                await self._jobs.cancel_batch(tx, batch_id)
        return await self.batch(batch_id)

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
    ) -> bool:
        """Settle `batch` with its output and error files; False if another replica settled it first."""
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
                await tx.execute(
                    f"INSERT INTO kvgate_files ({_FILE_COLUMNS}, content) VALUES (?, ?, ?, ?, ?, ?)",
                    (stored.id, stored.purpose, stored.filename, stored.bytes, stored.created_at, content),
                )
        return True

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


def _after(table: str, after: str | None) -> tuple[str, list[object]]:
    if after is None:
        return "1 = 1", []
    return (
        f"(created_at, id) < (SELECT created_at, id FROM {table} WHERE id = ?)",
        [after],
    )


def _file(row: Row) -> StoredFile:
    return StoredFile(row[0], row[1], row[2], int(row[3]), float(row[4]))


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
