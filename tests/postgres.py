"""A real PostgreSQL server for tests (kvgate.harness.postgres). Where PostgreSQL is not installed
the tests that need it skip, saying why; in CI (CI=true) they fail instead, since .ci/run installs it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from kvgate.harness.postgres import PostgresServer, missing_postgres, running_postgres

__all__ = ["PostgresServer", "postgres_server"]


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A running server, or a skip (a failure in CI) when PostgreSQL is not installed."""
    reason = missing_postgres()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    with running_postgres() as server:
        yield server
