"""The store's password is in neither the queue's logs nor its argv (issue 27, security review
finding 11: "logged at INFO on every start and sits in the queue's argv").

`kvgate queue` reads the store URL from KVGATE_QUEUE_STORE (or the variable `--store-env` names) or
from `--store-file`, refuses one with a password in `--store`, and logs it redacted.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres import PostgresServer, postgres_server
from test_queue_uploads import queue_process

from kvgate.harness.processes import kvgate_command
from kvgate.localports import free_port
from kvgate.queue.stores import holds_password, redacted, shown


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


def test_urls_are_logged_with_their_passwords_hidden() -> None:
    assert redacted("postgresql://kvgate:S3cret@db:5432/queue") == "postgresql://kvgate:***@db:5432/queue"
    assert redacted("postgres://:S3cret@db/queue") == "postgres://:***@db/queue"
    assert redacted("postgresql://kvgate@db/queue?sslmode=require&password=S3cret") == (
        "postgresql://kvgate@db/queue?sslmode=require&password=***"
    )
    for plain in ("sqlite:////var/lib/kvgate/queue.db", "postgresql://kvgate@db:5432/queue"):
        assert redacted(plain) == plain and not holds_password(plain)
    assert redacted("postgresql://u:S3cret@[::1/queue") == "postgresql:***", "unreadable: nothing shown"


def test_a_sqlite_store_is_logged_with_the_file_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three slashes make a relative path: the store lands under the directory the queue started in.
    monkeypatch.chdir(tmp_path)
    assert shown("sqlite:///var/lib/kvgate/queue.db") == (
        f"sqlite:///var/lib/kvgate/queue.db (the file {tmp_path}/var/lib/kvgate/queue.db)"
    )
    assert shown("sqlite:////var/lib/kvgate/queue.db") == (
        "sqlite:////var/lib/kvgate/queue.db (the file /var/lib/kvgate/queue.db)"
    )
    assert shown("postgresql://kvgate:S3cret@db/queue") == "postgresql://kvgate:***@db/queue"


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_password_is_in_neither_the_logs_nor_argv(
    postgres: PostgresServer, tmp_path: Path, source: str
) -> None:
    password = "S3cret-" + secrets.token_hex(8)
    # Trust authentication takes any password: the queue connects, serves, and stops as usual.
    url = postgres.new_database().replace("postgresql://postgres@", f"postgresql://postgres:{password}@")
    if source == "env":
        service = queue_process(tmp_path, {"KVGATE_QUEUE_STORE": url})
    else:
        (tmp_path / "store-url").write_text(url + "\n")
        service = queue_process(tmp_path, {}, "--store-file", str(tmp_path / "store-url"))
    try:
        cmdline = Path(f"/proc/{service.process.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
    finally:
        service.stop()
    log = service.log()
    assert f"postgresql://postgres:***@127.0.0.1:{postgres.port}/" in log, log[-2000:]
    assert password not in log


def queue_command(
    tmp: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`kvgate queue FLAGS` to its end (its agent is nowhere: it never gets that far)."""
    config = tmp / "queue.yaml"
    config.write_text(f"headroom: {{agents: ['127.0.0.1:{free_port()}']}}\n")
    argv = kvgate_command("queue", "--config", str(config), "--metrics-listen", "off", *flags)
    return subprocess.run(
        argv, check=False, env={**os.environ, **(env or {})}, capture_output=True, timeout=60
    )


def test_the_log_line_before_connecting_is_redacted_too(tmp_path: Path) -> None:
    password = "S3cret-" + secrets.token_hex(8)
    url = f"postgresql://kvgate:{password}@127.0.0.1:{free_port()}/queue"  # nothing listens there
    done = queue_command(tmp_path, env={"KVGATE_QUEUE_STORE": url})
    assert done.returncode == 1, done.stderr[-500:]
    assert b"postgresql://kvgate:***@127.0.0.1" in done.stderr and password.encode() not in done.stderr


def test_a_password_on_the_command_line_is_refused_without_being_shown(tmp_path: Path) -> None:
    password = "S3cret-" + secrets.token_hex(8)
    url = f"postgresql://kvgate:{password}@127.0.0.1:{free_port()}/queue"
    for argv in (["--store", url], ["--store", url.replace(f":{password}@", "@") + f"?password={password}"]):
        done = queue_command(tmp_path, *argv)
        assert done.returncode == 2, done.stderr[-500:]
        assert b"KVGATE_QUEUE_STORE" in done.stderr and password.encode() not in done.stderr
    missing = queue_command(tmp_path, "--store-env", "NO_SUCH_VARIABLE")
    assert missing.returncode == 2 and b"no store: set NO_SUCH_VARIABLE" in missing.stderr
