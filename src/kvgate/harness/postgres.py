"""A private PostgreSQL server: Debian's `postgresql` package, started in a directory of its own on a
free 127.0.0.1 port, stopped at the end. The tests' store uses `running_postgres`; the demo's queue
replicas use `foreground_server`, which a ProcessGroup runs and stops like any other child.

initdb refuses to run as root, so as root the server runs as the `postgres` user (`runuser`), in a
directory handed to it.
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

from kvgate.harness.processes import ChildError
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


def missing_postgres() -> str | None:
    """Why no server can start here, or None when one can."""
    if _bin_dir() is None:
        return f"PostgreSQL is not installed (no {_ROOT}/*/bin/initdb); `make setup` installs it"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "PostgreSQL must run as the postgres user, and runuser is not installed"
    return None


def _installed_bin_dir() -> Path:
    """Where the server's programs are; ChildError saying why when no server can start here."""
    bin_dir, reason = _bin_dir(), missing_postgres()
    if reason is not None or bin_dir is None:
        raise ChildError(reason or "PostgreSQL is not installed")
    return bin_dir


def url(port: int, database: str = "postgres") -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/{database}"


def foreground_server(root: Path, port: int) -> list[str]:
    """Initialise a data directory under `root` and return the command that serves it in the
    foreground on 127.0.0.1:`port` (SIGTERM stops it). `root` is made traversable, not readable, by the
    server user; the directory itself is theirs."""
    bin_dir = _installed_bin_dir()
    data = root / "postgres"
    data.mkdir()
    if os.geteuid() == 0:
        root.chmod(root.stat().st_mode | 0o111)
        shutil.chown(data, "postgres")
    server = PostgresServer(bin_dir, data, port)
    server.initdb()
    return server.foreground()


class PostgresServer:
    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self._bin = bin_dir
        self._root = root
        self.port = port
        self._data = root / "data"

    def initdb(self) -> None:
        initdb = [
            str(self._bin / "initdb"),
            "-D",
            str(self._data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
        ]
        self._run([*_as_server_user(), *initdb])

    def _options(self) -> list[str]:
        settings = ("listen_addresses=127.0.0.1", "fsync=off", "max_connections=200")
        return ["-p", str(self.port), "-k", str(self._root), *(f"-c{s}" for s in settings)]

    def start(self) -> None:
        """initdb, then the server in the background (pg_ctl), until `stop`."""
        self.initdb()
        log = str(self._root / "log")
        options = " ".join(self._options())
        pg_ctl = [str(self._bin / "pg_ctl"), "-D", str(self._data), "-o", options, "-l", log, "-w", "start"]
        self._run([*_as_server_user(), *pg_ctl])

    def foreground(self) -> list[str]:
        return [*_as_server_user(), str(self._bin / "postgres"), "-D", str(self._data), *self._options()]

    def _run(self, command: list[str]) -> None:
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            program = Path(command[len(_as_server_user())]).name
            raise ChildError(f"{program} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")

    def stop(self) -> None:
        stop = [str(self._bin / "pg_ctl"), "-D", str(self._data), "-m", "immediate", "-w", "stop"]
        subprocess.run([*_as_server_user(), *stop], check=False, capture_output=True)

    def url(self, database: str = "postgres") -> str:
        return url(self.port, database)

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = "kvgate_" + secrets.token_hex(4)
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url(name)


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A running server, stopped and removed at the end; ChildError when none can start here."""
    bin_dir = _installed_bin_dir()
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
