"""The processes a test run leaves behind, found in /proc.

A test run marks itself with an environment variable holding a value of its own; every process it
starts inherits it, and keeps it in /proc/PID/environ even after its parent died and it was handed to
init. So a leftover is found whoever started it and wherever it ended up: a process alive at the end
of the run that carries the mark, or that descends from the run's own process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MARK = "KVGATE_TEST_RUN"
PROC = Path("/proc")
# Started by multiprocessing for the whole life of the process that uses it; it exits with it.
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@dataclass(frozen=True, slots=True)
class Leftover:
    pid: int
    started: int  # clock ticks after boot: with the pid, names the process even if the pid is reused
    cmdline: str
    cwd: str
    age_s: float

    def describe(self) -> str:
        return f"pid {self.pid}, running {self.age_s:.0f} s, cwd {self.cwd}: {self.cmdline[:300]}"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """State, parent pid and start time (clock ticks after boot) of a process."""
    raw = _read(PROC / str(pid) / "stat")
    if raw is None:
        return None
    fields = raw.decode(errors="replace").rpartition(")")[2].split()
    return fields[0], int(fields[1]), int(fields[19])


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie has ended; it only waits for its parent)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1 and (stat := _stat(pid)) is not None:
        pid = stat[1]
        found.add(pid)
    return found


def _uptime_s() -> float:
    raw = _read(PROC / "uptime")
    return float(raw.split()[0]) if raw else 0.0


def find(mark: str, root: int | None = None) -> list[Leftover]:
    """Live processes that carry `MARK=mark` or descend from `root` (this process by default), other
    than `root`, its ancestors and multiprocessing's own helpers."""
    root = os.getpid() if root is None else root
    excluded = _ancestors(root) | {root}
    wanted = f"{MARK}={mark}".encode()
    parents: dict[int, int] = {}
    candidates = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or (pid := int(entry.name)) in excluded:
            continue
        stat = _stat(pid)
        if stat is None or not alive(pid):
            continue
        parents[pid] = stat[1]
        candidates.append((pid, stat[2], wanted in (_read(entry / "environ") or b"").split(b"\0")))
    ticks, uptime = os.sysconf("SC_CLK_TCK"), _uptime_s()
    found = []
    for pid, started, marked in candidates:
        if not marked and not _descends(pid, root, parents):
            continue
        cmdline = (_read(PROC / str(pid) / "cmdline") or b"").replace(b"\0", b" ").decode(errors="replace")
        if any(helper in cmdline for helper in _HELPERS):
            continue
        try:
            cwd = os.readlink(PROC / str(pid) / "cwd")
        except OSError:
            cwd = "?"
        found.append(Leftover(pid, started, cmdline.strip(), cwd, max(0.0, uptime - started / ticks)))
    return found


def _descends(pid: int, root: int, parents: dict[int, int]) -> bool:
    seen = set()
    while pid in parents and pid not in seen:
        seen.add(pid)
        pid = parents[pid]
        if pid == root:
            return True
    return False


def settle(mark: str, grace_s: float) -> list[Leftover]:
    """The leftovers still alive after up to `grace_s` (processes told to stop may be on their way)."""
    deadline = time.monotonic() + grace_s
    while (found := find(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def kill(leftovers: list[Leftover]) -> None:
    """SIGKILL each leftover, by pid, if that pid still names the process found."""
    for leftover in leftovers:
        stat = _stat(leftover.pid)
        if stat is not None and stat[2] == leftover.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover.pid, signal.SIGKILL)
