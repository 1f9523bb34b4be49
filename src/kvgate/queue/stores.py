"""The store URL that picks the queue's database adapter, and the URL as logs may show it.

    sqlite:///PATH          one replica (the file is locked); embedded, nothing to run; PATH is
                            relative to the working directory (sqlite:///out/queue.db) unless it
                            starts with a slash of its own (sqlite:////var/lib/kvgate/queue.db)
    postgresql://…          several replicas; rows claimed with SKIP LOCKED, LISTEN/NOTIFY wakes them

A PostgreSQL URL may hold a password: in its user info (`postgresql://user:secret@host/db`) or as a
`password` (or `sslpassword`) query parameter, both of which libpq reads (PostgreSQL 17 docs,
libpq "Connection URIs" and "Parameter Key Words"). `redacted` replaces each with `***`; nothing
logs or echoes a store URL otherwise. `shown` adds the file a SQLite URL opens, since a path meant
absolute but written with three slashes puts the store under whatever directory the queue started in.

Apart from kvgate.queue.database so that the contract does not know its implementations.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from kvgate.errors import ConfigError
from kvgate.queue.database import Database

_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})
HIDDEN = "***"
SQLITE = "sqlite:///"


def open_database(url: str) -> Database:
    """The adapter for a store URL; ConfigError when it is not one."""
    if url.startswith(SQLITE):
        from kvgate.queue.sqlite_db import SqliteDatabase

        path = url.removeprefix(SQLITE)
        if not path:
            raise ConfigError("the store: sqlite:///PATH needs a file path")
        # sqlite:///relative/path and sqlite:////absolute/path, as SQLAlchemy spells them.
        return SqliteDatabase(path)
    if url.startswith(("postgresql://", "postgres://")):
        from kvgate.queue.postgres_db import PostgresDatabase

        return PostgresDatabase(url)
    raise ConfigError(f"the store: expected sqlite:///PATH or postgresql://..., got {redacted(url)!r}")


def shown(url: str) -> str:
    """The URL as the queue logs it: `redacted`, and for SQLite the absolute path of the file it opens."""
    if url.startswith(SQLITE) and url != SQLITE:
        return f"{url} (the file {Path(url.removeprefix(SQLITE)).absolute()})"
    return redacted(url)


def holds_password(url: str) -> bool:
    """Whether the URL carries a password (in its user info or its query); True when it cannot be
    read, so that an unreadable URL is never shown."""
    try:
        parts = urlsplit(url)
        return parts.password is not None or any(
            name in _SECRET_PARAMETERS for name, _ in parse_qsl(parts.query, keep_blank_values=True)
        )
    except ValueError:
        return True


def redacted(url: str) -> str:
    """The URL with its passwords as `***` (`postgresql://user:***@host/db`); only the scheme when it
    cannot be read."""
    if not holds_password(url):
        return url
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user_info, _, host = netloc.rpartition("@")
            netloc = f"{user_info.partition(':')[0]}:{HIDDEN}@{host}"
        query = "&".join(
            f"{name}={HIDDEN if name in _SECRET_PARAMETERS else value}"
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        )
    except ValueError:
        return f"{url.partition(':')[0][:20]}:{HIDDEN}"
    return parts._replace(netloc=netloc, query=query).geturl()
