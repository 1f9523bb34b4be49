"""The PostgreSQL adapter (psycopg 3, async): several replicas share one database.

Rows to run are claimed with `SELECT … FOR UPDATE SKIP LOCKED` inside the claiming UPDATE, so two
replicas that pick the same job at once never block on each other and only one of them gets it.
Every change another replica must hear of (a new job, a finished or cancelled one) is NOTIFYed on
one channel at commit; each replica LISTENs on a connection of its own, and when that connection is
lost it reconnects and tells its listeners to read the store again (RESYNC), since notifications
sent meanwhile are gone. Connections that fail or whose statement was interrupted are closed, never
reused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg

from kvgate.errors import StoreError
from kvgate.queue import schema
from kvgate.queue.database import CHANNEL, RESYNC, Listener, Row

log = logging.getLogger(__name__)

# Advisory lock keys ("kvgate" in the high digits): one for creating the tables, one that makes a
# bounds check and its insert atomic across replicas.
_SCHEMA_LOCK = 7271500
_BOUNDS_LOCK = 7271501
# libpq keepalives: a server that vanished without closing the socket is noticed in ~25 s, not hours.
_CONNECT_ARGS: dict[str, Any] = {
    "autocommit": True,
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def _pg(sql: str) -> str:
    """The shared SQL's `?` placeholders in psycopg's spelling (the shared SQL holds no `%`)."""
    return sql.replace("?", "%s")


class _PostgresTx:
    def __init__(self, connection: psycopg.AsyncConnection[Any], timeout_s: float) -> None:
        self._connection = connection
        self._timeout_s = timeout_s

    async def execute(self, sql: str, params: Sequence[object] = ()) -> list[Row]:
        async with asyncio.timeout(self._timeout_s):
            cursor = await self._connection.execute(_pg(sql), tuple(params))
            if cursor.description is None:
                return []
            return await cursor.fetchall()

    async def executemany(self, sql: str, rows: Sequence[Sequence[object]]) -> None:
        async with asyncio.timeout(self._timeout_s), self._connection.cursor() as cursor:
            await cursor.executemany(_pg(sql), [tuple(row) for row in rows])

    async def notify(self, event: str) -> None:
        await self.execute("SELECT pg_notify(?, ?)", (CHANNEL, event))


class PostgresDatabase:
    now_sql = "extract(epoch from clock_timestamp())::double precision"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    lock_bounds = f"SELECT pg_advisory_xact_lock({_BOUNDS_LOCK})"
    exclusive = False

    def __init__(self, url: str, pool_size: int = 4, timeout_s: float = 30.0) -> None:
        self._url = url
        self._slots = asyncio.Semaphore(pool_size)
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._timeout_s = timeout_s
        self._listeners: list[Listener] = []
        self._listening: asyncio.Task[None] | None = None
        self._heard = asyncio.Event()

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        async with self.transaction() as tx:
            await tx.execute(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK})")
            await tx.execute(schema.VERSION_TABLE)
            ((version,),) = await tx.execute(schema.READ_VERSION)
            tables = {row[0] for row in await tx.execute(schema.POSTGRESQL.tables_sql)}
            for statement in schema.plan(schema.POSTGRESQL, version, tables):
                await tx.execute(statement)
        self._listening = asyncio.create_task(self._listen(), name="kvgate-queue-listen")
        # Changes made after start() returns must reach this replica's listeners.
        async with asyncio.timeout(self._timeout_s):
            await self._heard.wait()

    async def reclaim(self) -> None:
        """Nothing to do: PostgreSQL's autovacuum reuses what deletes left (VACUUM cannot run inside a
        transaction, and VACUUM FULL would lock the tables)."""

    async def close(self) -> None:
        if self._listening is not None:
            self._listening.cancel()
            await asyncio.gather(self._listening, return_exceptions=True)
        while self._idle:
            await self._idle.pop().close()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        try:
            return await psycopg.AsyncConnection.connect(self._url, **_CONNECT_ARGS)
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to the PostgreSQL store: {exc}") from exc

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[_PostgresTx]:
        async with self._slots:
            connection = self._idle.pop() if self._idle else await self._connect()
            reusable = False
            try:
                async with connection.transaction():
                    yield _PostgresTx(connection, self._timeout_s)
                reusable = True
            except psycopg.Error as exc:
                # Constraint and data errors leave a healthy connection (the block rolled back).
                reusable = not isinstance(exc, psycopg.OperationalError) and not connection.closed
                raise StoreError(f"PostgreSQL store: {exc}") from exc
            except TimeoutError as exc:
                raise StoreError(f"PostgreSQL store: no answer within {self._timeout_s:g} s") from exc
            finally:
                if reusable and not connection.closed:
                    self._idle.append(connection)
                else:
                    await connection.close()

    async def _listen(self) -> None:
        delay = 0.1
        while True:
            try:
                connection = await psycopg.AsyncConnection.connect(self._url, **_CONNECT_ARGS)
                async with connection:
                    await connection.execute(f"LISTEN {CHANNEL}")
                    self._heard.set()
                    self._emit(RESYNC)
                    delay = 0.1
                    async for notification in connection.notifies():
                        self._emit(notification.payload)
            except psycopg.Error as exc:
                log.warning("lost the PostgreSQL notification connection (%s); reconnecting", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _emit(self, event: str) -> None:
        for listener in self._listeners:
            listener(event)
