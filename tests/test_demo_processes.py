"""The demo's process supervisor: readiness, early exits reported with their log, cleanup."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from kvgate.demo.processes import DemoError, Supervisor, find_envoy
from kvgate.localports import free_ports


def test_a_child_that_exits_early_fails_with_its_log(tmp_path: Path) -> None:
    async def case() -> None:
        with Supervisor(tmp_path) as supervisor:
            supervisor.start(
                "broken", [sys.executable, "-c", "print('bad flag --nope'); raise SystemExit(3)"]
            )
            with pytest.raises(DemoError, match=r"(?s)broken exited with code 3.*bad flag --nope"):
                await supervisor.wait_listening("broken", free_ports(1)[0], timeout_s=10)

    asyncio.run(case())


@pytest.mark.slow
def test_children_are_ready_when_listening_and_stopped_on_exit(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    server = f"import socket, time; s = socket.create_server(('127.0.0.1', {port})); time.sleep(60)"
    # Ignores SIGTERM: the supervisor must escalate to SIGKILL after its grace period.
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"

    async def case() -> None:
        with Supervisor(tmp_path) as supervisor:
            listening = supervisor.start("server", [sys.executable, "-c", server])
            stuck = supervisor.start("stubborn", [sys.executable, "-c", stubborn])
            await supervisor.wait_listening("server", port, timeout_s=10)
            supervisor.check_alive()
        assert listening.poll() is not None
        assert stuck.poll() is not None

    started = time.monotonic()
    asyncio.run(case())
    assert time.monotonic() - started < 20


def test_envoy_binary_is_found() -> None:
    assert find_envoy().is_file()
