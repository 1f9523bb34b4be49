"""The SQLite adapter: one file, one replica, every statement on one thread off the event loop.

The file is locked for the process's life (a second `kvgate queue` on it exits with a message), so
the jobs marked running in it at start-up were running in a process that is gone: the store
requeues them at once. WAL journal with synchronous=FULL: a committed job survives kill -9 and power
loss alike. Transactions take the write lock up front (BEGIN IMMEDIATE) and run one at a time.

Disk comes back after deletes: the file is in incremental auto-vacuum, and `reclaim` (after each
sweep) truncates its free pages and checkpoints the WAL to nothing; between sweeps the WAL is cut
back to JOURNAL_LIMIT after each checkpoint. A file
made before that setting (auto_vacuum NONE) is converted once at start by a VACUUM, which rewrites
it whole and needs as much free disk again; when that fails the queue starts all the same, without.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from kvgate.errors import StoreError
from kvgate.queue import schema
from kvgate.queue.database import Listener, Row

log = logging.getLogger(__name__)

T = TypeVar("T")
# The WAL is truncated back to this after a checkpoint (it would otherwise stay at its largest: a
# 200 MiB upload's worth). sqlite.org/pragma.html#pragma_journal_size_limit
JOURNAL_LIMIT = 64 * 1024 * 1024
# sqlite.org/pragma.html#pragma_auto_vacuum: 0 NONE, 1 FULL, 2 INCREMENTAL.
_INCREMENTAL = 2


class _SqliteTx:
    def __init__(self, database: SqliteDatabase) -> None:
        self._database = database
        self.events: list[str] = []

    async def execute(self, sql: str, params: Sequence[object] = ()) -> list[Row]:
        def run(connection: sqlite3.Connection) -> list[Row]:
            return connection.execute(sql, tuple(params)).fetchall()

        return await self._database.call(run)

    async def executemany(self, sql: str, rows: Sequence[Sequence[object]]) -> None:
        def run(connection: sqlite3.Connection) -> None:
            connection.executemany(sql, [tuple(row) for row in rows])

        await self._database.call(run)

    async def notify(self, event: str) -> None:
        self.events.append(event)


class SqliteDatabase:
    # Julian days to Unix seconds, with the milliseconds SQLite keeps.
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    skip_locked = ""
    lock_bounds = ""
    # Only one process uses the file: running jobs found at start-up belong to a dead process.
    exclusive = True

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-sqlite")
        self._connection: sqlite3.Connection | None = None
        self._lock_file: int | None = None
        self._write = asyncio.Lock()
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        self._lock_file = _lock(self.path)
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._open)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open SQLite store {self.path}: {exc}") from exc

    def _open(self) -> None:
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        # Before any table exists, or it takes a VACUUM (sqlite.org/pragma.html#pragma_auto_vacuum).
        connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("PRAGMA busy_timeout=5000")
        connection.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT}")
        try:
            _vacuum_into_incremental(connection, self.path)
            _migrate(connection)
        except BaseException:
            connection.close()
            raise
        self._connection = connection

    async def reclaim(self) -> None:
        """Give the file's free pages back to the disk (what deletes left)."""
        async with self._write:
            # executescript steps each statement to its end (incremental_vacuum frees one page a
            # step); the checkpoint moves the shrunken pages into the file and truncates the WAL.
            await self.call(
                lambda connection: connection.executescript(
                    "PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);"
                )
            )

    async def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            await asyncio.get_running_loop().run_in_executor(self._executor, connection.close)
        self._executor.shutdown(wait=True)
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None

    async def call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        connection = self._connection
        if connection is None:
            raise StoreError("the SQLite store is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work, connection)
        except sqlite3.Error as exc:
            raise StoreError(f"SQLite store {self.path}: {exc}") from exc

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[_SqliteTx]:
        async with self._write:
            tx = _SqliteTx(self)
            await self.call(_execute("BEGIN IMMEDIATE"))
            try:
                yield tx
                await asyncio.shield(self.call(_execute("COMMIT")))
            except BaseException:
                # Shielded: a cancelled caller must not leave the write lock's transaction open.
                with contextlib.suppress(StoreError):
                    await asyncio.shield(self.call(_execute("ROLLBACK")))
                raise
        for event in tx.events:
            for listener in self._listeners:
                listener(event)


def _execute(sql: str) -> Callable[[sqlite3.Connection], Any]:
    return lambda connection: connection.execute(sql)


def _migrate(connection: sqlite3.Connection) -> None:
    """Create the tables, or bring an older store's up to date, in one transaction."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        connection.execute(schema.VERSION_TABLE)
        ((version,),) = connection.execute(schema.READ_VERSION).fetchall()
        tables = {row[0] for row in connection.execute(schema.SQLITE.tables_sql)}
        for statement in schema.plan(schema.SQLITE, version, tables):
            connection.execute(statement)
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise


def _vacuum_into_incremental(connection: sqlite3.Connection, path: Path) -> None:
    """A file made with auto_vacuum NONE takes the setting only through a VACUUM (a new, empty file
    has it already)."""
    ((mode,),) = connection.execute("PRAGMA auto_vacuum").fetchall()
    if mode == _INCREMENTAL:
        return
    try:
        connection.execute("VACUUM")
    except sqlite3.Error as exc:
        log.warning(
            "SQLite store %s: VACUUM to turn on incremental auto-vacuum failed (%s); deleted rows will "
            "not give disk back until it succeeds on a later start",
            path,
            exc,
        )


def _lock(path: Path) -> int:
    """Hold an exclusive lock beside the database file for as long as the process runs."""
    lock_path = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot create {lock_path}: {exc.strerror}") from exc
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(descriptor)
        raise StoreError(
            f"another kvgate queue uses {path} (SQLite serves one replica; use PostgreSQL for several)"
        ) from exc
    return descriptor
