"""What the queue's stores need of a SQL database (the adapters: sqlite_db, postgres_db; the URL
that picks one: stores.open_database).

Both adapters take the same SQL (`?` placeholders, standard SQL the two share); the few places they
differ are named here: the store's clock, row locking, and the lock that makes a bounds check and
its insert one step across replicas. Database errors become StoreError at the adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from enum import StrEnum
from typing import Any, Protocol

Row = tuple[Any, ...]
Listener = Callable[[str], None]

# Events the stores announce (PostgreSQL: NOTIFY on this channel, delivered at commit).
CHANNEL = "kvgate_queue"
RESYNC = "resync"  # notifications may have been missed (the listening connection was lost)


class Tx(Protocol):
    async def execute(self, sql: str, params: Sequence[object] = ()) -> list[Row]: ...

    async def executemany(self, sql: str, rows: Sequence[Sequence[object]]) -> None: ...

    async def notify(self, event: str) -> None:
        """Announce `event` to every replica's listeners once this transaction commits."""


class Database(Protocol):
    # SQL for "now" in seconds since the epoch, by the database's clock: with several replicas,
    # leases are compared on one clock.
    now_sql: str
    # Appended to a SELECT that picks a row to claim: replicas skip rows another one is claiming.
    skip_locked: str
    # Run first in a transaction that checks the queue's bounds and then inserts.
    lock_bounds: str
    # True when one process owns the store: jobs found running at start-up belong to a dead process.
    exclusive: bool

    def transaction(self) -> AbstractAsyncContextManager[Tx]: ...

    def subscribe(self, listener: Listener) -> None: ...

    async def start(self) -> None:
        """Connect, create the tables if missing (or bring an older store's up to date: schema.plan),
        start listening."""

    async def reclaim(self) -> None:
        """Give back the disk that deleted rows held, where the database does not do it by itself."""

    async def close(self) -> None: ...


def literal(value: StrEnum) -> str:
    """An enum's value as a SQL string literal: how the stores' SQL names a job state or a batch
    status (never by hand). Only enum values pass here, never client input."""
    text = str(value.value)
    assert text.isidentifier(), f"{text!r} is not a plain word"
    return f"'{text}'"


def owned_page(table: str, tenant: str, after: str | None) -> tuple[str, list[object]]:
    """The WHERE clause and its parameters of a list page: `tenant`'s rows, past the cursor `after`
    (a row id; one of another tenant's ids reads as none, leaving the page empty). `table` is one
    of the store's own table names, never client input."""
    if after is None:
        return "tenant = ?", [tenant]
    return (
        f"tenant = ? AND (created_at, id) < (SELECT created_at, id FROM {table} WHERE id = ? AND tenant = ?)",
        [tenant, after, tenant],
    )


def literals(values: Iterable[StrEnum]) -> str:
    """Enum values as a parenthesised SQL list for `IN`, in a stable order."""
    return "(" + ", ".join(sorted(map(literal, values))) + ")"
