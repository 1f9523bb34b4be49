"""Jobs in the store: every transition one conditional write, every acknowledgement one commit.

A job is acknowledged (the held answer is awaited, or 202 sent) only after `add` returned, that is
after its row was committed; with SQLite's synchronous=FULL and PostgreSQL's defaults a committed
row survives kill -9 of the queue. Claims carry a lease the owning replica renews; `recover` puts
back in the queue the running jobs whose lease ran out (their replica died or lost the store), and
on an exclusive store (SQLite) every running job at start-up.

Every write to a job goes through this store, batch lines' included, and each transition is announced
(see kvgate.queue.database): `new` when a job may have become runnable, `done:ID` when a job ended,
`cancel:ID` when a running job was cancelled (its owner aborts the engine call).

A held job carries a hold in `expires_at` (a batch line's is its batch's window): the replica that
holds its client renews it (`hold`), so a job whose client left, or whose replica died, lapses. A lapsed
job is neither offered to the dispatcher nor claimed, and `abandon` cancels it (`client_gone`): an
engine would otherwise run it for nobody, charged to its tenant. A client that comes back with the same
request id revives it (`add`).

What a client asks of a job (get, cancel, attach by request id) is asked within its tenant: another
tenant's job is not found. A request id names at most one job of each tenant.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.queue import batches
from kvgate.queue.database import Database, Row, Tx, literal, literals
from kvgate.queue.jobs import (
    ACTIVE,
    TERMINAL,
    Job,
    JobCharge,
    JobError,
    JobRequest,
    JobResult,
    JobState,
    NewJob,
    Waiting,
)

NEW = "new"
CLIENT_GONE = "client_gone"
DONE = "done:"
CANCEL = "cancel:"

JOB_COLUMNS = (
    "id, state, tokens, priority, tenant, created_at, model, stream, request_id, started_at, "
    "finished_at, attempts, owner, node, reservation, batch_id, custom_id, line, result_status, "
    "result_type, result_body, error_code, error_message"
)
_REQUEST_COLUMNS = "path, headers, body"
_WAITING_COLUMNS = (
    "id, priority, tenant, tokens, seq, attempts, created_at, charge_prompt_tokens, charge_output_tokens, "
    "tenant_class"
)
_INSERT = (
    "INSERT INTO kvgate_jobs (id, request_id, state, priority, tenant, tokens, model, stream, path, "
    "headers, body, created_at, expires_at, batch_id, custom_id, line, finished_at, error_code, "
    "error_message, charge_prompt_tokens, charge_output_tokens, tenant_class) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {now}, COALESCE(?, {now} + ?), ?, ?, ?, {finished}, ?, ?, ?, "
    "?, ?)"
)
# The states as the SQL below names them (kvgate.queue.database.literal): never spelled by hand.
_QUEUED = literal(JobState.QUEUED)
_RUNNING = literal(JobState.RUNNING)
_ACTIVE = literals(ACTIVE)
_ENDED = literals(TERMINAL)
_BATCH_OPEN = literals(batches.OPEN)


@dataclass(frozen=True, slots=True)
class Limits:
    max_jobs: int
    max_tokens_waiting: int


@dataclass(frozen=True, slots=True)
class QueueFull:
    """The bound a new job would pass, in words for the 429."""

    why: str


@dataclass(frozen=True, slots=True)
class QueueStats:
    jobs: dict[str, int]
    oldest_queued_s: float | None
    tokens_waiting: dict[str, int]


class JobStore:
    def __init__(self, database: Database) -> None:
        self.database = database
        self._now = database.now_sql
        self._unexpired = f"(expires_at IS NULL OR expires_at >= {self._now})"

    async def start(self) -> list[Job]:
        """Open the store; on an exclusive store, requeue what a dead process left running (returned,
        so their reservations can be released)."""
        await self.database.start()
        return await self.recover(everything=self.database.exclusive)

    async def close(self) -> None:
        await self.database.close()

    async def add(self, job: NewJob, limits: Limits) -> Job | QueueFull:
        """Commit `job`, or the job of its tenant already holding its request id, or the bound it
        would pass."""
        async with self.database.transaction() as tx:
            if self.database.lock_bounds:
                # Before the look-up: two replicas adding one request id at once must not both insert.
                await tx.execute(self.database.lock_bounds)
            if job.request_id is not None:
                rows = await tx.execute(
                    f"SELECT {JOB_COLUMNS} FROM kvgate_jobs WHERE tenant = ? AND request_id = ?",
                    (job.tenant, job.request_id),
                )
                if rows:
                    return await self._revived(tx, job_from_row(rows[0]), job.hold_s)
            full = await self._check_bounds(tx, limits, 1, job.tokens)
            if full is not None:
                return full
            await self._insert(tx, [job])
            rows = await tx.execute(f"SELECT {JOB_COLUMNS} FROM kvgate_jobs WHERE id = ?", (job.id,))
            await tx.notify(NEW)
        return job_from_row(rows[0])

    async def _revived(self, tx: Tx, found: Job, hold_s: float | None) -> Job:
        """`found` queued again when its client had gone before it started and has come back."""
        if found.state is not JobState.CANCELLED or found.error is None or found.error.code != CLIENT_GONE:
            return found
        rows = await tx.execute(
            f"UPDATE kvgate_jobs SET state = {_QUEUED}, finished_at = NULL, error_code = NULL, "
            f"error_message = NULL, expires_at = {self._now} + ? WHERE id = ? AND state = "
            f"{literal(JobState.CANCELLED)} RETURNING {JOB_COLUMNS}",
            (hold_s, found.id),
        )
        if not rows:
            return found
        await tx.notify(NEW)
        return job_from_row(rows[0])

    async def add_many(self, tx: Tx, jobs: Sequence[NewJob], limits: Limits) -> QueueFull | None:
        """Insert a batch's lines inside the caller's transaction, all or none within the bounds."""
        waiting = [job for job in jobs if job.error is None]
        full = await self._check_bounds(tx, limits, len(waiting), sum(job.tokens for job in waiting))
        if full is not None:
            return full
        await self._insert(tx, jobs)
        if waiting:
            await tx.notify(NEW)
        return None

    async def room(self, limits: Limits, jobs: int) -> QueueFull | None:
        """Whether `jobs` more fit under queue.max_jobs now: a batch's lines are counted against it
        before they are read (the insert checks again, with their tokens)."""
        async with self.database.transaction() as tx:
            return await self._check_bounds(tx, limits, jobs, 0)

    async def _check_bounds(self, tx: Tx, limits: Limits, jobs: int, tokens: int) -> QueueFull | None:
        if self.database.lock_bounds:
            await tx.execute(self.database.lock_bounds)
        ((count, waiting),) = await tx.execute(
            f"SELECT count(*), CAST(coalesce(sum(CASE WHEN state = {_QUEUED} THEN tokens ELSE 0 END), 0) "
            f"AS BIGINT) FROM kvgate_jobs WHERE state IN {_ACTIVE}"
        )
        if count + jobs > limits.max_jobs:
            return QueueFull(f"{count} jobs are queued or running (queue.max_jobs is {limits.max_jobs})")
        if waiting + tokens > limits.max_tokens_waiting:
            return QueueFull(
                f"{waiting} tokens are waiting and this needs {tokens} more "
                f"(queue.max_tokens_waiting is {limits.max_tokens_waiting})"
            )
        return None

    async def _insert(self, tx: Tx, jobs: Sequence[NewJob]) -> None:
        # Refused batch lines are stored already failed, for the batch's error file.
        for failed in (False, True):
            chosen = [job for job in jobs if (job.error is not None) == failed]
            if not chosen:
                continue
            sql = _INSERT.format(now=self._now, finished=self._now if failed else "NULL")
            await tx.executemany(sql, [_insert_row(job) for job in chosen])

    async def get(self, key: str, tenant: str) -> Job | None:
        """`tenant`'s job with this id, or the one created for this request id."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {JOB_COLUMNS} FROM kvgate_jobs WHERE tenant = ? AND (id = ? OR request_id = ?)",
                (tenant, key, key),
            )
        return job_from_row(rows[0]) if rows else None

    async def position(self, job: Job) -> int:
        """Queued jobs ahead of `job` in priority-then-age order (fair sharing may reorder tenants)."""
        async with self.database.transaction() as tx:
            ((ahead,),) = await tx.execute(
                f"SELECT count(*) FROM kvgate_jobs WHERE state = {_QUEUED} AND (priority < ? OR "
                "(priority = ? AND seq < (SELECT seq FROM kvgate_jobs WHERE id = ?)))",
                (job.priority, job.priority, job.id),
            )
        return int(ahead)

    async def waiting(self, per_group: int) -> list[Waiting]:
        """The oldest `per_group` queued jobs of every (priority, tenant)."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {_WAITING_COLUMNS} FROM (SELECT {_WAITING_COLUMNS}, row_number() OVER (PARTITION BY "
                f"priority, tenant ORDER BY seq) AS n FROM kvgate_jobs WHERE state = {_QUEUED} AND "
                f"{self._unexpired}) AS heads "
                "WHERE n <= ?",
                (per_group,),
            )
        return [
            Waiting(
                r[0],
                int(r[1]),
                r[2],
                int(r[3]),
                int(r[4]),
                int(r[5]),
                float(r[6]),
                None if r[7] is None else JobCharge(int(r[7]), int(r[8] or 0)),
                r[9],
            )
            for r in rows
        ]

    async def claim(self, job_id: str, owner: str, node: str, reservation: str, lease_s: float) -> Job | None:
        """Mark a queued job running for `owner`; None when it is no longer queued (or another replica
        is claiming it this instant). Returns the job with its request."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = {_RUNNING}, owner = ?, node = ?, reservation = ?, "
                f"attempts = attempts + 1, started_at = {self._now}, lease_until = {self._now} + ? "
                f"WHERE id = (SELECT id FROM kvgate_jobs WHERE id = ? AND state = {_QUEUED} AND "
                f"{self._unexpired}{self.database.skip_locked}) RETURNING {JOB_COLUMNS}, {_REQUEST_COLUMNS}",
                (owner, node, reservation, lease_s, job_id),
            )
        if not rows:
            return None
        row = rows[0]
        headers = tuple((str(k), str(v)) for k, v in json.loads(row[-2]))
        request = JobRequest(row[-3], headers, bytes(row[-1]))
        return job_from_row(row[:-3], request)

    async def hold(self, job_ids: Sequence[str], hold_s: float) -> None:
        """Renew the holds of held jobs whose clients are still connected to the caller."""
        if not job_ids:
            return
        marks = ", ".join("?" * len(job_ids))
        async with self.database.transaction() as tx:
            await tx.execute(
                f"UPDATE kvgate_jobs SET expires_at = {self._now} + ? WHERE id IN ({marks}) "
                f"AND batch_id IS NULL AND state IN {_ACTIVE}",
                (hold_s, *job_ids),
            )

    async def abandon(self) -> list[str]:
        """Cancel the queued held jobs whose hold lapsed (see the module doc), each announced ended;
        their ids."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = {literal(JobState.CANCELLED)}, finished_at = {self._now}, "
                f"error_code = '{CLIENT_GONE}', error_message = 'Its client left before it started and did "
                "not come back for it.' WHERE state = "
                f"{_QUEUED} AND batch_id IS NULL AND expires_at < {self._now} RETURNING id"
            )
            for (job_id,) in rows:
                await tx.notify(DONE + job_id)
        return [row[0] for row in rows]

    async def renew(self, owner: str, running: Sequence[str], lease_s: float) -> set[str]:
        """Extend the lease of `owner`'s running jobs; the ids of `running` it no longer holds."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET lease_until = {self._now} + ? "
                f"WHERE owner = ? AND state = {_RUNNING} RETURNING id",
                (lease_s, owner),
            )
        return set(running) - {row[0] for row in rows}

    async def finish(
        self, job: Job, owner: str, result: JobResult | None, error: JobError | None = None
    ) -> bool:
        """Record how `owner`'s attempt ended; False when the job was taken from it meanwhile."""
        state = JobState.SUCCEEDED if result is not None and result.ok and error is None else JobState.FAILED
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = ?, finished_at = {self._now}, lease_until = NULL, "
                "result_status = ?, result_type = ?, result_body = ?, error_code = ?, error_message = ? "
                f"WHERE id = ? AND state = {_RUNNING} AND owner = ? AND attempts = ? RETURNING id",
                (
                    state.value,
                    result.status if result else None,
                    result.content_type if result else None,
                    result.body if result else None,
                    error.code if error else None,
                    error.message if error else None,
                    job.id,
                    owner,
                    job.attempts,
                ),
            )
            if rows:
                await tx.notify(DONE + job.id)
        return bool(rows)

    async def requeue(self, job: Job, owner: str) -> bool:
        """Put `owner`'s running attempt back in the queue (engine dropped it, replica stopping)."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = {_QUEUED}, owner = NULL, lease_until = NULL "
                f"WHERE id = ? AND state = {_RUNNING} AND owner = ? AND attempts = ? RETURNING id",
                (job.id, owner, job.attempts),
            )
            if rows:
                await tx.notify(NEW)
        return bool(rows)

    async def fail_waiting(self, job_id: str, error: JobError) -> bool:
        """Fail a queued job that can never run (bigger than every node)."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = {literal(JobState.FAILED)}, finished_at = {self._now}, "
                f"error_code = ?, error_message = ? WHERE id = ? AND state = {_QUEUED} RETURNING id",
                (error.code, error.message, job_id),
            )
            if rows:
                await tx.notify(DONE + job_id)
        return bool(rows)

    async def cancel(
        self, key: str, tenant: str, error: JobError, *, queued_only: bool = False
    ) -> Job | None:
        """Cancel `tenant`'s queued or running job (`queued_only`: only a queued one) by id or request id;
        the job as it is now (None: unknown to this tenant)."""
        states = f"= {_QUEUED}" if queued_only else f"IN {_ACTIVE}"
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = {literal(JobState.CANCELLED)}, finished_at = {self._now}, "
                "lease_until = NULL, error_code = ?, error_message = ? WHERE tenant = ? AND "
                f"(id = ? OR request_id = ?) AND state {states} RETURNING {JOB_COLUMNS}",
                (error.code, error.message, tenant, key, key),
            )
            for row in rows:
                await tx.notify(CANCEL + row[0])
                await tx.notify(DONE + row[0])
        return job_from_row(rows[0]) if rows else await self.get(key, tenant)

    async def cancel_batch(self, tx: Tx, batch_id: str) -> list[str]:
        """Cancel a batch's queued lines inside the caller's transaction (the one that marks the batch
        cancelling), each announced ended; their ids. Running lines finish."""
        rows = await tx.execute(
            f"UPDATE kvgate_jobs SET state = {literal(JobState.CANCELLED)}, finished_at = {self._now}, "
            "error_code = 'batch_cancelled', error_message = 'The batch was cancelled before this request "
            f"ran.' WHERE batch_id = ? AND state = {_QUEUED} RETURNING id",
            (batch_id,),
        )
        for (job_id,) in rows:
            await tx.notify(DONE + job_id)
        return [row[0] for row in rows]

    async def recover(self, everything: bool = False) -> list[Job]:
        """Requeue running jobs whose claim lease ran out (all running ones if `everything`). They keep
        their node and reservation, for the caller to release."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = {_QUEUED}, owner = NULL, lease_until = NULL "
                f"WHERE state = {_RUNNING} AND (lease_until < {self._now} OR ? = 1) RETURNING {JOB_COLUMNS}",
                (1 if everything else 0,),
            )
            if rows:
                await tx.notify(NEW)
        return [job_from_row(row) for row in rows]

    async def expire(self) -> list[str]:
        """Expire queued batch lines whose batch window closed, each announced ended; the batch ids
        touched."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_jobs SET state = {literal(JobState.EXPIRED)}, finished_at = {self._now}, "
                "error_code = 'batch_expired', error_message = 'This request could not be executed before "
                f"the completion window expired.' WHERE state = {_QUEUED} AND batch_id IS NOT NULL AND "
                f"expires_at < {self._now} "
                "RETURNING id, batch_id"
            )
            for job_id, _ in rows:
                await tx.notify(DONE + job_id)
        return sorted({row[1] for row in rows if row[1] is not None})

    async def sweep(self, result_ttl_s: float) -> int:
        """Delete jobs that ended more than `result_ttl_s` ago (batch lines once their batch is no
        longer open: ended, or swept itself)."""
        async with self.database.transaction() as tx:
            rows = await tx.execute(
                f"DELETE FROM kvgate_jobs WHERE state IN {_ENDED} AND finished_at < {self._now} - ? AND "
                f"(batch_id IS NULL OR batch_id NOT IN (SELECT id FROM kvgate_batches WHERE status IN "
                f"{_BATCH_OPEN})) RETURNING id",
                (result_ttl_s,),
            )
        return len(rows)

    async def stats(self) -> QueueStats:
        async with self.database.transaction() as tx:
            states = await tx.execute("SELECT state, count(*) FROM kvgate_jobs GROUP BY state")
            ((oldest,),) = await tx.execute(
                f"SELECT {self._now} - created_at FROM kvgate_jobs WHERE seq = "
                f"(SELECT min(seq) FROM kvgate_jobs WHERE state = {_QUEUED}) UNION ALL SELECT NULL LIMIT 1"
            )
            tenants = await tx.execute(
                f"SELECT tenant, CAST(sum(tokens) AS BIGINT) FROM kvgate_jobs WHERE state = {_QUEUED} "
                "GROUP BY tenant"
            )
        return QueueStats(
            {state: int(count) for state, count in states},
            None if oldest is None else float(oldest),
            {tenant: int(tokens) for tenant, tokens in tenants},
        )


def _insert_row(job: NewJob) -> tuple[object, ...]:
    state = JobState.QUEUED if job.error is None else JobState.FAILED
    return (
        job.id,
        job.request_id,
        state.value,
        job.priority,
        job.tenant,
        job.tokens,
        job.model,
        1 if job.stream else 0,
        job.request.path,
        json.dumps(job.request.headers),
        job.request.body,
        job.expires_at,
        job.hold_s,
        job.batch_id,
        job.custom_id,
        job.line,
        job.error.code if job.error else None,
        job.error.message if job.error else None,
        job.charge.prompt_tokens if job.charge else None,
        job.charge.output_tokens if job.charge else None,
        job.tenant_class,
    )


def job_from_row(row: Row, request: JobRequest | None = None) -> Job:
    r: Sequence[Any] = row
    result = None if r[18] is None else JobResult(int(r[18]), r[19] or "", bytes(r[20] or b""))
    error = None if r[21] is None else JobError(r[21], r[22] or "")
    return Job(
        id=r[0],
        state=JobState(r[1]),
        tokens=int(r[2]),
        priority=int(r[3]),
        tenant=r[4],
        created_at=float(r[5]),
        model=r[6],
        stream=bool(r[7]),
        request_id=r[8],
        started_at=r[9],
        finished_at=r[10],
        attempts=int(r[11]),
        owner=r[12],
        node=r[13],
        reservation=r[14],
        batch_id=r[15],
        custom_id=r[16],
        line=r[17],
        result=result,
        error=error,
        request=request,
    )
