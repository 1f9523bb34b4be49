"""Killing a replay's processes at their fault times and starting them again (kvgate.demo.faults).

A fault sends its signal to the process, waits for it to be gone, and RESTART_S later starts it again
with the same command, ports and log (ProcessGroup.restart), then waits until it listens. A killed
gate's reservations are followed on every agent's /metrics (`kvgate_agent_holder_tokens`, its holder
being `<host>:<pid>`) until none is left. The routing layer's CPU meter banks a killed process's CPU
and follows its successor.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvgate.agent.sources.engines import promtext
from kvgate.demo.cpu import CpuMeter
from kvgate.demo.faults import RESTART_S, Fault, Injected
from kvgate.demo.runner import Progress
from kvgate.demo.stacks import Stack
from kvgate.errors import ConfigError, HeadroomError
from kvgate.harness.processes import ProcessGroup

HOLDER_TOKENS = "kvgate_agent_holder_tokens"
# How long a dead gate's reservations are followed: well past a lease and its renewal period (40 s).
HELD_WATCH_S = 120.0
_POLL_S = 0.5
_SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}


def target_process(fault: Fault, stack: Stack) -> tuple[str, str | None]:
    """The ProcessGroup name a fault kills, and the node it stands for (agent and node faults)."""
    first_long = stack.long_pool[0]
    names = {
        "gate": ("gate", None),
        "queue": ("queue", None),
        "agent": (f"agent-{first_long}", first_long),
        "node": (first_long, first_long),
    }
    name, node = names[fault.target]
    if name not in stack.listens:
        raise ConfigError(f"--faults: this run has no {fault.target} to kill")
    return name, node


async def inject_faults(
    faults: Sequence[Fault],
    group: ProcessGroup,
    stack: Stack,
    meters: Sequence[CpuMeter],
    *,
    first_at: float,
    progress: Progress,
) -> list[Injected]:
    """Each fault at `first_at` (the first request's time.monotonic()) + its time, one after the other;
    what happened, on the monotonic clock (`shift` puts it on the requests' clock)."""
    kills: list[tuple[_Kill, asyncio.Task[float | None] | None]] = []
    for fault in faults:
        await asyncio.sleep(max(0.0, first_at + fault.at_s - time.monotonic()))
        kill = await _kill_and_restart(fault, group, stack, meters, progress)
        watch = None
        if kill.holder is not None and kill.held:
            watch = asyncio.create_task(_held_back_s(kill.agents, kill.holder, kill.killed))
        kills.append((kill, watch))
    return [
        Injected(k.fault, k.killed, k.back, k.node, k.held, None if watch is None else await watch)
        for k, watch in kills
    ]


@dataclass(frozen=True, slots=True)
class _Kill:
    fault: Fault
    node: str | None
    killed: float
    back: float
    holder: str | None  # a killed gate's holder name on the agents
    held: int | None
    agents: tuple[str, ...]  # the agents' /metrics URLs


async def _kill_and_restart(
    fault: Fault, group: ProcessGroup, stack: Stack, meters: Sequence[CpuMeter], progress: Progress
) -> _Kill:
    name, node = target_process(fault, stack)
    service = group[name]
    holder = f"{socket.gethostname()}:{service.process.pid}" if fault.target == "gate" else None
    agents = tuple(stack.agent_metrics.values())
    held = await _held(agents, holder) if holder is not None else None
    watching = [meter for meter in meters if meter.watches(name)]
    for meter in watching:
        meter.retire(name)
    killed = time.monotonic()
    service.signal(_SIGNALS[fault.signal])
    await asyncio.to_thread(service.process.wait)
    service.end_session()
    holding = f" holding {held} tokens" if held else ""
    progress.done(f"fault: {name}{holding} got SIG{fault.signal}")
    await asyncio.sleep(RESTART_S)
    restarted = group.restart(name)
    await restarted.listening(stack.listens[name])
    back = time.monotonic()
    for meter in watching:
        meter.follow(name, restarted.process.pid)
    progress.done(f"fault: {name} is back {back - killed:.1f} s after it died")
    return _Kill(fault, node, killed, back, holder, held, agents)


async def _held(agents: Sequence[str], holder: str) -> int:
    """What `holder` holds on the agents now, by their /metrics (an agent that does not answer: 0)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        pages = await asyncio.gather(*(_page(session, url) for url in agents))
    return sum(_holder_tokens(page, holder) for page in pages)


async def _page(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url) as response:
            return await response.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return ""


def _holder_tokens(page: str, holder: str) -> int:
    try:
        samples = promtext.samples(page, HOLDER_TOKENS)
    except HeadroomError:
        return 0
    return sum(int(s.value) for s in samples if promtext.label(s, "holder") == holder)


async def _held_back_s(agents: Sequence[str], holder: str, killed: float) -> float | None:
    """Seconds after the kill when the agents showed nothing of `holder` held; None past HELD_WATCH_S."""
    while time.monotonic() - killed < HELD_WATCH_S:
        if await _held(agents, holder) == 0:
            return time.monotonic() - killed
        await asyncio.sleep(_POLL_S)
    return None


def shift(injected: Sequence[Injected], start: float) -> list[Injected]:
    """The events on the requests' clock (seconds since the replay's `start`)."""
    return [
        Injected(e.fault, e.killed_s - start, e.back_s - start, e.target_node, e.held_tokens, e.held_back_s)
        for e in injected
    ]
