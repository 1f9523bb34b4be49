"""A real PostgreSQL server for tests: Debian's `postgresql` package, started in a temp directory on
a free 127.0.0.1 port, stopped at the end.

initdb refuses to run as root, so as root the server runs as the `postgres` user (`runuser`), in a
directory handed to it. Where PostgreSQL is not installed the tests that need it skip, saying why;
in CI (CI=true) they fail instead, since .ci/run installs it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from kvgate.localports import free_port

_ROOT = Path("/usr/lib/postgresql")


def _bin_dir() -> Path | None:
    versions = sorted(
        (p for p in _ROOT.glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    return versions[-1] if versions else None


def _as_server_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class PostgresServer:
    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self._bin = bin_dir
        self._root = root
        self.port = port
        self._data = root / "data"

    def start(self) -> None:
        run = _as_server_user()
        subprocess.run(
            [
                *run,
                str(self._bin / "initdb"),
                "-D",
                str(self._data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
            check=True,
            capture_output=True,
        )
        options = (
            f"-p {self.port} -k {self._root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )
        log = str(self._root / "log")
        start = [str(self._bin / "pg_ctl"), "-D", str(self._data), "-o", options, "-l", log, "-w", "start"]
        subprocess.run([*run, *start], check=True, capture_output=True)

    def stop(self) -> None:
        subprocess.run(
            [
                *_as_server_user(),
                str(self._bin / "pg_ctl"),
                "-D",
                str(self._data),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
            check=False,
            capture_output=True,
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = "kvgate_" + secrets.token_hex(4)
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url(name)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A running server, or a skip (a failure in CI) when PostgreSQL is not installed."""
    bin_dir = _bin_dir()
    if bin_dir is None or (os.geteuid() == 0 and shutil.which("runuser") is None):
        reason = f"PostgreSQL is not installed (no {_ROOT}/*/bin/initdb); `make setup` installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    server = PostgresServer(bin_dir, root, free_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
