"""CPU time a set of processes spent, read from Linux's /proc/<pid>/stat (user + system).

A process counts with its descendants (a router's helpers, a gate's workers): its own utime + stime,
what its waited-for children left (cutime + cstime), and each live descendant's the same way. Read
once before a replay and once after it, the difference is what the routing layer cost while the
traffic ran; the load generator is the demo's own process, never among them. Read over a quiet spell
before the replay (`idle_cpu_per_s`), it is what each process costs with no traffic at all: its
timers (an agent's engine scrapes and headroom messages, the queue's store polls), which the replay
report charges as the fixed part of its CPU (kvgate.demo.trace_report.cpu_split).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its waited-for children); None when it is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after its last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / _TICKS


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[0]
    return parents


def tree_cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """Per root pid, the CPU seconds of it and its live descendants (0.0 for a root that is gone)."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    totals: dict[int, float] = {}
    for root in pids:
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            stat = _stat(pid)
            if stat is not None:
                total += stat[1]
            todo += children.get(pid, [])
        totals[root] = total
    return totals


class CpuMeter:
    """CPU seconds of named processes between `start` and `stop`; `seconds`: how long that was."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)
        self._before: dict[int, float] = {}
        self._banked: dict[str, float] = {}  # CPU of processes killed (`retire`)
        self._started = 0.0
        self.seconds = 0.0

    def start(self) -> None:
        self._before = tree_cpu_seconds(self._pids.values())
        self._started = time.monotonic()

    def watches(self, name: str) -> bool:
        return name in self._pids

    def retire(self, name: str) -> None:
        """`name` is about to be killed: bank what its process spent, read now while it lives."""
        old = self._pids[name]
        spent = tree_cpu_seconds([old])[old] - self._before.pop(old, 0.0)
        self._banked[name] = self._banked.get(name, 0.0) + max(0.0, spent)

    def follow(self, name: str, pid: int) -> None:
        """`name` runs on as `pid` (restarted after `retire`): counted from here."""
        self._pids[name] = pid
        self._before[pid] = 0.0

    def stop(self) -> dict[str, float]:
        after = tree_cpu_seconds(self._pids.values())
        self.seconds = time.monotonic() - self._started
        return {
            name: round(self._banked.get(name, 0.0) + max(0.0, after[pid] - self._before.get(pid, 0.0)), 3)
            for name, pid in self._pids.items()
        }


async def idle_cpu_per_s(pids: Mapping[str, int], seconds: float) -> dict[str, float]:
    """CPU seconds per second each process spends over `seconds` with no traffic."""
    meter = CpuMeter(pids)
    meter.start()
    await asyncio.sleep(seconds)
    spent = meter.stop()
    return {name: round(value / meter.seconds, 5) for name, value in spent.items()}
