"""Files in the store: uploaded chunk by chunk within their tenant's quotas, read chunk by chunk,
expired and swept.

An upload is a row in `uploading` status plus its chunks, each chunk written in a short transaction
of its own: SQLite has one writer, and an upload must never hold it while a client sends. The row
becomes `processed` (listed, readable, usable by a batch) once the whole file is in. Each quota
check and the write it allows are one transaction (PostgreSQL: under the bounds lock, so replicas see
each other's uploads). A row still `uploading` after queue.upload_timeout_s (its client stalled, or
its replica died) is swept with its chunks, and the upload, if it still runs, stops at its next
chunk. Every read names the tenant: another tenant's file is not found. An expired file is gone at
once for readers, and from the disk at the next sweep.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvgate.config.queue import QueueSettings
from kvgate.queue.batches import StoredFile
from kvgate.queue.database import Database, Row, Tx, literal, owned_page
from kvgate.queue.schema import FileStatus

# What one chunk row holds: an upload keeps at most this much in memory before writing it.
CHUNK_BYTES = 1024 * 1024

_COLUMNS = "id, tenant, purpose, filename, bytes, created_at, expires_at"
_UPLOADING = literal(FileStatus.UPLOADING)
_PROCESSED = literal(FileStatus.PROCESSED)


class Limit(enum.Enum):
    """The quota an upload would pass (queue.*; see the HTTP answer each gets in files_http)."""

    FILES = "max_files_per_tenant"
    UPLOADS = "max_uploads_per_tenant"
    BYTES = "max_file_bytes_per_tenant"
    TOTAL = "max_file_bytes_total"
    # Not a quota: the upload ran past queue.upload_timeout_s and was swept.
    TIMEOUT = "upload_timeout_s"


@dataclass(frozen=True, slots=True)
class OverQuota:
    limit: Limit
    message: str


@dataclass(frozen=True, slots=True)
class Quota:
    files: int
    uploads: int
    bytes: int
    total_bytes: int

    @classmethod
    def of(cls, settings: QueueSettings) -> Quota:
        return cls(
            settings.max_files_per_tenant,
            settings.max_uploads_per_tenant,
            settings.max_file_bytes_per_tenant,
            settings.max_file_bytes_total,
        )


class FileStore:
    def __init__(self, database: Database) -> None:
        self._database = database
        self._now = database.now_sql
        # Not expired: what readers and quotas see.
        self._live = f"(expires_at IS NULL OR expires_at > {self._now})"

    async def begin(self, file_id: str, tenant: str, quota: Quota) -> OverQuota | None:
        """Open an upload for `tenant`, or the quota (file count, concurrent uploads) it would pass."""
        async with self._database.transaction() as tx:
            if self._database.lock_bounds:
                await tx.execute(self._database.lock_bounds)
            ((files, uploads),) = await tx.execute(
                f"SELECT count(*), coalesce(sum(CASE WHEN status = {_UPLOADING} THEN 1 ELSE 0 END), 0) "
                f"FROM kvgate_files WHERE tenant = ? AND {self._live}",
                (tenant,),
            )
            if int(files) >= quota.files:
                return OverQuota(
                    Limit.FILES,
                    f"Tenant {tenant!r} holds {int(files)} files: queue.max_files_per_tenant is "
                    f"{quota.files}. Delete some, or wait for them to expire.",
                )
            if int(uploads) >= quota.uploads:
                return OverQuota(
                    Limit.UPLOADS,
                    f"Tenant {tenant!r} has {int(uploads)} uploads running: queue.max_uploads_per_tenant "
                    f"is {quota.uploads}. Retry once one has finished.",
                )
            await tx.execute(
                f"INSERT INTO kvgate_files ({_COLUMNS}, status) VALUES (?, ?, '', '', 0, {self._now}, NULL, "
                f"{_UPLOADING})",
                (file_id, tenant),
            )
        return None

    async def append(
        self, file_id: str, tenant: str, seq: int, data: bytes, quota: Quota
    ) -> OverQuota | None:
        """Add chunk `seq` to an open upload, or the quota (bytes) it would pass, or TIMEOUT when the
        upload was swept meanwhile."""
        async with self._database.transaction() as tx:
            if self._database.lock_bounds:
                await tx.execute(self._database.lock_bounds)
            ((total, mine),) = await tx.execute(
                "SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT), "
                "CAST(coalesce(sum(CASE WHEN tenant = ? THEN bytes ELSE 0 END), 0) AS BIGINT) "
                f"FROM kvgate_files WHERE {self._live}",
                (tenant,),
            )
            if int(mine) + len(data) > quota.bytes:
                return OverQuota(
                    Limit.BYTES,
                    f"Tenant {tenant!r} holds {int(mine)} bytes of files and this upload needs more: "
                    f"queue.max_file_bytes_per_tenant is {quota.bytes}. Delete some, or wait for them "
                    "to expire.",
                )
            if int(total) + len(data) > quota.total_bytes:
                return OverQuota(
                    Limit.TOTAL,
                    f"The queue's files take {int(total)} bytes: queue.max_file_bytes_total is "
                    f"{quota.total_bytes}. Retry later.",
                )
            rows = await tx.execute(
                f"UPDATE kvgate_files SET bytes = bytes + ? WHERE id = ? AND status = {_UPLOADING} "
                "RETURNING id",
                (len(data), file_id),
            )
            if not rows:
                return OverQuota(Limit.TIMEOUT, "The upload did not finish within queue.upload_timeout_s.")
            await tx.execute(
                "INSERT INTO kvgate_file_chunks (file_id, seq, data) VALUES (?, ?, ?)", (file_id, seq, data)
            )
        return None

    async def finish(self, file_id: str, purpose: str, filename: str, ttl_s: float) -> StoredFile | None:
        """Make an upload a file, expiring `ttl_s` after it began; None when it was swept meanwhile."""
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"UPDATE kvgate_files SET status = {_PROCESSED}, purpose = ?, filename = ?, "
                f"expires_at = created_at + ? WHERE id = ? AND status = {_UPLOADING} RETURNING {_COLUMNS}",
                (purpose, filename, ttl_s, file_id),
            )
        return _file(rows[0]) if rows else None

    async def drop(self, file_id: str) -> None:
        """Forget an upload that did not finish, and what it had written."""
        async with self._database.transaction() as tx:
            await tx.execute(f"DELETE FROM kvgate_files WHERE id = ? AND status = {_UPLOADING}", (file_id,))
            await tx.execute("DELETE FROM kvgate_file_chunks WHERE file_id = ?", (file_id,))

    async def put(self, tx: Tx, stored: StoredFile, content: bytes) -> None:
        """Write a whole file the queue made (a batch's output), in the caller's transaction; no quota:
        a tenant's results are always kept (they count against its later uploads)."""
        await tx.execute(
            f"INSERT INTO kvgate_files ({_COLUMNS}, status) VALUES (?, ?, ?, ?, ?, ?, ?, {_PROCESSED})",
            (
                stored.id,
                stored.tenant,
                stored.purpose,
                stored.filename,
                stored.bytes,
                stored.created_at,
                stored.expires_at,
            ),
        )
        await tx.executemany(
            "INSERT INTO kvgate_file_chunks (file_id, seq, data) VALUES (?, ?, ?)",
            [
                (stored.id, seq, content[start : start + CHUNK_BYTES])
                for seq, start in enumerate(range(0, len(content), CHUNK_BYTES))
            ],
        )

    async def file(self, file_id: str, tenant: str) -> StoredFile | None:
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {_COLUMNS} FROM kvgate_files WHERE id = ? AND tenant = ? AND status = {_PROCESSED} "
                f"AND {self._live}",
                (file_id, tenant),
            )
        return _file(rows[0]) if rows else None

    async def chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's content, one chunk (and one short transaction) at a time. The caller has found
        the file (`file`): its tenant may read it."""
        seq = 0
        while True:
            async with self._database.transaction() as tx:
                rows = await tx.execute(
                    "SELECT data FROM kvgate_file_chunks WHERE file_id = ? AND seq = ?", (file_id, seq)
                )
            if not rows:
                return
            yield bytes(rows[0][0])
            seq += 1

    async def files(
        self, tenant: str, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[StoredFile], bool]:
        """`tenant`'s files, newest first, after the cursor `after`; and whether there are more."""
        where, params = owned_page("kvgate_files", tenant, after)
        where += f" AND status = {_PROCESSED} AND {self._live}"
        if purpose is not None:
            where += " AND purpose = ?"
            params.append(purpose)
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"SELECT {_COLUMNS} FROM kvgate_files WHERE {where} "
                "ORDER BY created_at DESC, id DESC LIMIT ?",
                (*params, limit + 1),
            )
        return [_file(row) for row in rows[:limit]], len(rows) > limit

    async def delete(self, file_id: str, tenant: str) -> bool:
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"DELETE FROM kvgate_files WHERE id = ? AND tenant = ? AND status = {_PROCESSED} "
                "RETURNING id",
                (file_id, tenant),
            )
            if rows:
                await tx.execute("DELETE FROM kvgate_file_chunks WHERE file_id = ?", (file_id,))
        return bool(rows)

    async def sweep(self, upload_timeout_s: float) -> int:
        """Delete expired files, and uploads begun more than `upload_timeout_s` ago that are still
        running (0: every running upload, for a store only this process uses); how many."""
        async with self._database.transaction() as tx:
            rows = await tx.execute(
                f"DELETE FROM kvgate_files WHERE expires_at <= {self._now} OR (status = {_UPLOADING} AND "
                f"created_at <= {self._now} - ?) RETURNING id",
                (upload_timeout_s,),
            )
            await _delete_chunks(tx, rows)
        return len(rows)


async def _delete_chunks(tx: Tx, rows: Sequence[Row]) -> None:
    if rows:
        await tx.executemany("DELETE FROM kvgate_file_chunks WHERE file_id = ?", [(row[0],) for row in rows])


def _file(row: Row) -> StoredFile:
    expires_at = None if row[6] is None else float(row[6])
    return StoredFile(row[0], row[1], row[2], row[3], int(row[4]), float(row[5]), expires_at)
