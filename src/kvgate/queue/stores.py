"""The `--store` URL that picks the queue's database adapter.

    sqlite:///PATH          one replica (the file is locked); embedded, nothing to run
    postgresql://…          several replicas; rows claimed with SKIP LOCKED, LISTEN/NOTIFY wakes them

Apart from kvgate.queue.database so that the contract does not know its implementations.
"""

from __future__ import annotations

from kvgate.errors import ConfigError
from kvgate.queue.database import Database


def open_database(url: str) -> Database:
    """The adapter for a `--store` URL; ConfigError naming the flag when it is not one."""
    if url.startswith("sqlite:///"):
        from kvgate.queue.sqlite_db import SqliteDatabase

        path = url.removeprefix("sqlite:///")
        if not path:
            raise ConfigError("--store: sqlite:///PATH needs a file path")
        # sqlite:///relative/path and sqlite:////absolute/path, as SQLAlchemy spells them.
        return SqliteDatabase(path)
    if url.startswith(("postgresql://", "postgres://")):
        from kvgate.queue.postgres_db import PostgresDatabase

        return PostgresDatabase(url)
    raise ConfigError(f"--store: expected sqlite:///PATH or postgresql://..., got {url!r}")
