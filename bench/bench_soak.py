"""Soak: mixed traffic at a steady rate through the real Envoy while agents, nodes and the gate are killed.

The stack (bench/soak_stack.py): Envoy from envoy/envoy.yaml, `kvgate gate --workers 2`, two agents in
front of simulated long-context nodes, a simulated interactive node; the gate's lease is short
(--lease-s, 15 s) so the run sees it. The traffic (bench/soak_traffic.py): short chats, long requests,
long requests that generate for 1.5 leases (alive only if the gate renews them), too-long and
malformed requests, gzip bodies. Meanwhile, one at a time (bench/soak_faults.py): an agent SIGKILLed
and started again; the whole gate (supervisor and workers) SIGKILLed and started again on its port
3 s later; the gate worker holding Envoy's ext_proc connection SIGKILLed (the supervisor starts a new
one); a long node's engine SIGKILLed and started again with an empty cache; the gate SIGTERMed (it
drains) and started again.

It reports:
- every process's RSS over time (growth from the first to the last quarter of the run, for processes
  that lived through it; per lifetime for the ones killed);
- outcomes by kind, and every failed answer (no answer, Envoy's error, failed open, a refusal its
  kind should not get) charged to the fault it followed: in flight at the kill, sent while the
  process was down, or sent after it was back (target: none), or `steady` before any fault;
- per fault on the gate (kill, worker kill, SIGTERM): what its processes held on the agents
  (`kvgate_agent_holder_tokens` of each one's holder, `<hostname>:<pid>`, every worker's for a whole
  gate) and how long after the signal every agent showed none of it (target: lease + lease/3; the
  signal waits up to 5 s for the gate to hold something, so the measure means something). A drain
  releases what ends within it; a request still running after it is left to its lease, like a kill's;
- the agents' renewals and lapsed renewals (`kvgate_agent_reservations_total`), the lapsed ones
  charged to the fault they followed (target: none in `steady`; a restarted agent's empty ledger
  lapses the renewals of what its predecessor had granted);
- the reservations still held on the agents once the traffic has stopped: right away (releases lost
  with killed gates) and after the lease (leaked for good).
Targets: zero failed outside a fault, zero leaked, zero lapsed in steady state, flat memory.

    python -m bench soak                  10 minutes (KVGATE_SOAK_SECONDS=60 to shorten it)
    python -m bench.bench_soak --seconds 60 --rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak_faults import (
    PHASES,
    STEADY,
    Chaos,
    FaultKind,
    Injected,
    charge_events,
    charge_failures,
    holder_tokens,
    new_events,
    reservation_events,
)
from bench.soak_stack import DECODE_TOKENS_PER_S, LONG_NODES, RESTART_S, ROOT, WORKERS, SoakStack, rss_bytes
from bench.soak_traffic import Tally, send_steady
from kvgate.config.headroom import HeadroomSettings
from kvgate.gate.leases import RENEWALS_PER_LEASE
from kvgate.headroom.view import HeadroomView

DEFAULT_SECONDS = 600.0
DEFAULT_RATE = 8.0
MiB = 1024 * 1024
# Imports and first allocations of a fresh process are not growth.
WARMUP_S = 5.0
# A long_held request generates this many leases long: it lives only if its reservation is renewed.
HELD_LEASES = 1.5
# Agents and nodes are killed on the same side: long-0's agent and engine live through the run, so
# their memory can be judged.
CHAOS_SIDE = len(LONG_NODES) - 1
# A gate that holds nothing when it dies shows nothing of the lease: its kill waits this long for a
# reservation to be held.
HOLD_WAIT_S = 5.0
# A gate started again has no ext_proc connection until Envoy's next request opens one: a worker kill
# right after a gate fault waits this long for a worker to hold it.
CONNECTED_WAIT_S = 5.0
POLL_S = 0.5
# How long a dead gate's reservations are followed past their bound before the soak calls it "never".
FREE_WATCH_SLACK_S = 10.0
AGENT_EVENTS_EVERY_S = 1.0


@dataclass
class RssSeries:
    role: str
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)

    def quarter_means(self) -> tuple[float, float]:
        """Mean RSS over the first and the last quarter of this process's life, its start-up apart."""
        start = self.samples[0][0] + WARMUP_S
        values = [rss for t, rss in self.samples if t >= start] or [rss for _t, rss in self.samples]
        quarter = max(1, len(values) // 4)
        return statistics.fmean(values[:quarter]), statistics.fmean(values[-quarter:])

    def lifetime_s(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if self.samples else 0.0


@dataclass
class SoakReport:
    duration_s: float
    rate: float
    sent: int
    skipped: int
    outcomes: dict[str, dict[str, int]]
    lost: int
    unexpected_refusals: int
    fail_open: int
    errors: int
    ok_p50_ms: float
    ok_p99_ms: float
    fault_counts: dict[str, int]
    faults: list[dict[str, Any]]
    failures_by_fault: dict[str, dict[str, dict[str, int]]]
    agent_events: dict[str, int]
    lapsed_by_fault: dict[str, int]
    reserved_after_drain: dict[str, int]
    reserved_after_lease: dict[str, int]
    lease_s: float
    held_free_bound_s: float
    rss: list[dict[str, float | int | str]]

    @property
    def leaked(self) -> int:
        return sum(self.reserved_after_lease.values())


def _role(name: str) -> str:
    return "gate-worker" if name.startswith("gate-worker:") else name


async def _sample_rss(stack: SoakStack, series: dict[int, RssSeries], period_s: float, t0: float) -> None:
    while True:
        now = time.monotonic() - t0
        for name, pid in stack.pids().items():
            rss = rss_bytes(pid)
            if rss is not None:
                series.setdefault(pid, RssSeries(_role(name), pid)).samples.append((now, rss))
        await asyncio.sleep(period_s)


def _busy_worker(stack: SoakStack) -> int | None:
    """The gate worker holding Envoy's ext_proc connection (the one whose death Envoy notices)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == stack.ports.gate and fields[3] == "01":
                inodes.add(fields[9])
    for pid in stack.gate_workers():
        try:
            links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            return pid
    return None


async def _connected_worker(stack: SoakStack, limit_s: float) -> int | None:
    """`_busy_worker` once every worker runs and one holds Envoy's connection, waited for up to
    `limit_s` (a fault planned just after a gate restart comes before Envoy connects again)."""
    deadline = time.monotonic() + limit_s
    while True:
        if len(stack.gate_workers()) >= WORKERS and (busy := _busy_worker(stack)) is not None:
            return busy
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(POLL_S / 5)


def _holder(pid: int) -> str:
    """A gate process's holder name on the agents (its headroom view's subscriber name)."""
    return f"{socket.gethostname()}:{pid}"


async def _page(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as response:
            response.raise_for_status()
            return await response.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


async def _held(session: aiohttp.ClientSession, stack: SoakStack, holders: Sequence[str]) -> int | None:
    """What `holders` hold on all the agents; None while one does not answer (it may hold some)."""
    pages = await asyncio.gather(*(_page(session, url) for url in stack.agent_metrics_urls))
    if any(page is None for page in pages):
        return None
    return sum(holder_tokens(page, holders) for page in pages if page is not None)


async def _holding(session: aiohttp.ClientSession, stack: SoakStack, holders: Sequence[str]) -> int | None:
    """What `holders` hold, once it is something or HOLD_WAIT_S has passed (None: an agent was silent)."""
    deadline = time.monotonic() + HOLD_WAIT_S
    while True:
        held = await _held(session, stack, holders)
        if held or time.monotonic() > deadline:
            return held
        await asyncio.sleep(POLL_S / 2)


async def _free_after_s(
    session: aiohttp.ClientSession, stack: SoakStack, holders: Sequence[str], since: float, limit_s: float
) -> float | None:
    """Seconds after `since` when every agent showed nothing held by `holders`; None past `limit_s`."""
    while time.monotonic() - since < limit_s:
        if await _held(session, stack, holders) == 0:
            return time.monotonic() - since
        await asyncio.sleep(POLL_S)
    return None


async def _inject(
    stack: SoakStack, kind: FaultKind, session: aiohttp.ClientSession, watch_s: float
) -> tuple[Injected, asyncio.Task[float | None] | None] | None:
    """One fault, from the signal until the process is back, and for a gate fault the task that follows
    its holders from the signal on for up to `watch_s` (`_free_after_s`); None when there was nothing
    to kill."""
    holders: tuple[str, ...] = ()
    exit_code = None
    if kind == "worker":
        if (busy := await _connected_worker(stack, CONNECTED_WAIT_S)) is None:
            return None
        holders = (_holder(busy),)
    elif kind in ("gate_kill", "gate_term"):
        # Each worker reserves as a holder of its own; the supervisor holds nothing.
        holders = tuple(_holder(pid) for pid in stack.gate_workers())
    held = await _holding(session, stack, holders) if holders else None
    killed = time.monotonic()
    watch = asyncio.create_task(_free_after_s(session, stack, holders, killed, watch_s)) if holders else None
    if kind == "agent":
        await asyncio.to_thread(stack.restart_agent, CHAOS_SIDE)
    elif kind == "node":
        await asyncio.to_thread(stack.kill_node, CHAOS_SIDE)
        await asyncio.sleep(RESTART_S)
        await asyncio.to_thread(stack.start_node, CHAOS_SIDE)
    elif kind == "worker":
        stack.kill_gate_worker(busy)
        # The supervisor starts another after 1 s.
        await asyncio.to_thread(stack.wait_gate_workers)
    else:
        if kind == "gate_kill":
            await asyncio.to_thread(stack.kill_gate)
        else:
            exit_code = await asyncio.to_thread(stack.term_gate)
        await asyncio.sleep(RESTART_S)
        await asyncio.to_thread(stack.start_gate)
    return Injected(kind, killed, time.monotonic(), holders, held, exit_code), watch


async def _chaos(
    stack: SoakStack,
    chaos: Chaos,
    session: aiohttp.ClientSession,
    *,
    stop: asyncio.Event,
    injected: list[Injected],
    frees: list[asyncio.Task[float | None] | None],
) -> None:
    """The planned faults in turn until `stop`; a gate fault's holders are followed until they are free."""
    t0 = time.monotonic()
    watch_s = free_bound_s(stack.lease_s) + FREE_WATCH_SLACK_S
    for planned in chaos.planned:
        try:
            await asyncio.wait_for(stop.wait(), t0 + planned.at_s - time.monotonic())
            return
        except TimeoutError:
            pass
        done = await _inject(stack, planned.kind, session, watch_s)
        if done is not None:
            injected.append(done[0])
            frees.append(done[1])


async def _watch_agent_events(
    stack: SoakStack, session: aiohttp.ClientSession, seen: list[tuple[float, str, int]]
) -> None:
    """Forever: each agent's new reservation events, with when they were seen. A restarted agent
    counts from zero again, so each process's counts are kept apart (by pid)."""
    last: dict[tuple[int, int], dict[str, int]] = {}
    while True:
        for index, url in enumerate(stack.agent_metrics_urls):
            key = (index, stack.agent_pid(index))
            page = await _page(session, url)
            if page is None:
                continue
            counts = reservation_events(page)
            now = time.monotonic()
            seen.extend((now, event, n) for event, n in new_events(last.get(key, {}), counts).items())
            last[key] = counts
        await asyncio.sleep(AGENT_EVENTS_EVERY_S)


async def _reserved(agents: tuple[str, ...]) -> dict[str, int]:
    """Every agent's reserved tokens, read from its own headroom stream like a gate reads it."""
    view = HeadroomView(HeadroomSettings(agents=agents))
    await view.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            nodes = view.snapshot()
            if all(node.headroom is not None and node.fresh for node in nodes):
                return {node.agent: node.headroom.reserved_tokens for node in nodes if node.headroom}
            await view.wait_update(0.5)
        raise RuntimeError(f"agents did not all report within 10 s: {nodes}")
    finally:
        await view.stop()


async def _reserved_after_lease(agents: tuple[str, ...], lease_s: float) -> dict[str, int]:
    deadline = time.monotonic() + lease_s + 5
    while True:
        reserved = await _reserved(agents)
        if not any(reserved.values()) or time.monotonic() > deadline:
            return reserved
        await asyncio.sleep(1.0)


def free_bound_s(lease_s: float) -> float:
    """How long a dead gate's reservations may outlive it (kvgate.gate.leases): a lease after its last
    renewal, and a renewal period."""
    return lease_s * (1 + 1 / RENEWALS_PER_LEASE)


def held_output_tokens(lease_s: float) -> int:
    """The output of a long_held request: HELD_LEASES leases of decoding on a soak node."""
    return int(HELD_LEASES * lease_s * DECODE_TOKENS_PER_S)


async def _soak(stack: SoakStack, duration_s: float, rate: float, seed: int) -> SoakReport:
    t0 = time.monotonic()
    series: dict[int, RssSeries] = {}
    injected: list[Injected] = []
    frees: list[asyncio.Task[float | None] | None] = []
    events: list[tuple[float, str, int]] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        background = [
            asyncio.create_task(_sample_rss(stack, series, max(1.0, duration_s / 300), t0)),
            asyncio.create_task(_watch_agent_events(stack, session, events)),
        ]
        chaos = asyncio.create_task(
            _chaos(stack, Chaos.for_duration(duration_s), session, stop=stop, injected=injected, frees=frees)
        )
        try:
            tally = await send_steady(
                stack.url, rate, duration_s, seed, held_output_tokens=held_output_tokens(stack.lease_s)
            )
            # A fault under way ends (its process is back) before the stack is judged.
            stop.set()
            await chaos
            held_free = [None if watch is None else await watch for watch in frees]
            stack.check_alive()
            # Give the gate's releases (sent when Envoy ends each ext_proc stream) a moment to land.
            await asyncio.sleep(1.0)
            after_drain = await _reserved(stack.agent_addresses)
            after_lease = await _reserved_after_lease(stack.agent_addresses, stack.lease_s)
        finally:
            pending = [*background, chaos, *(watch for watch in frees if watch is not None)]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return _report(
        duration_s,
        rate,
        tally,
        t0=t0,
        injected=injected,
        held_free=held_free,
        events=events,
        after_drain=after_drain,
        after_lease=after_lease,
        lease_s=stack.lease_s,
        series=series,
    )


def _rss_rows(series: dict[int, RssSeries]) -> list[dict[str, float | int | str]]:
    rows: list[dict[str, float | int | str]] = []
    for s in sorted(series.values(), key=lambda s: (s.role, s.samples[0][0])):
        first, last = s.quarter_means()
        rows.append({
            "role": s.role,
            "pid": s.pid,
            "from_s": round(s.samples[0][0], 1),
            "lifetime_s": round(s.lifetime_s(), 1),
            "first_quarter_mib": round(first / MiB, 1),
            "last_quarter_mib": round(last / MiB, 1),
            "growth": round(last / first - 1, 4),
        })  # fmt: skip
    return rows


def _percentile_ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _fault_rows(
    injected: Sequence[Injected], held_free: Sequence[float | None], t0: float
) -> list[dict[str, Any]]:
    return [
        {
            "kind": event.kind,
            "at_s": round(event.killed_at - t0, 1),
            "back_after_s": round(event.back_at - event.killed_at, 1),
            "holders": list(event.holders),
            "held_tokens": event.held_tokens,
            "held_free_after_s": None if free is None else round(free, 1),
            "exit_code": event.exit_code,
        }
        for event, free in zip(injected, held_free, strict=True)
    ]


def _report(
    duration_s: float,
    rate: float,
    tally: Tally,
    *,
    t0: float,
    injected: Sequence[Injected],
    held_free: Sequence[float | None],
    events: Sequence[tuple[float, str, int]],
    after_drain: dict[str, int],
    after_lease: dict[str, int],
    lease_s: float,
    series: dict[int, RssSeries],
) -> SoakReport:
    outcomes: dict[str, dict[str, int]] = defaultdict(dict)
    for (kind, outcome), n in sorted(tally.outcomes.items()):
        outcomes[kind][outcome] = n
    agent_events: Counter[str] = Counter()
    for _seen, event, n in events:
        agent_events[event] += n
    lapsed = charge_events([e for e in events if e[1] == "lapsed"], injected, lease_s / RENEWALS_PER_LEASE)
    return SoakReport(
        duration_s=duration_s,
        rate=rate,
        sent=tally.sent,
        skipped=tally.skipped,
        outcomes=dict(outcomes),
        lost=tally.count("lost"),
        unexpected_refusals=tally.unexpected_refusals(),
        fail_open=tally.count("fail_open"),
        errors=tally.count("error"),
        ok_p50_ms=_percentile_ms(tally.latencies_s, 50),
        ok_p99_ms=_percentile_ms(tally.latencies_s, 99),
        fault_counts=dict(Counter(event.kind for event in injected)),
        faults=_fault_rows(injected, held_free, t0),
        failures_by_fault=charge_failures(tally.failures, injected),
        agent_events=dict(sorted(agent_events.items())),
        lapsed_by_fault={kind: counts["lapsed"] for kind, counts in lapsed.items()},
        reserved_after_drain=after_drain,
        reserved_after_lease=after_lease,
        lease_s=lease_s,
        held_free_bound_s=free_bound_s(lease_s),
        rss=_rss_rows(series),
    )


def run_soak(
    duration_s: float, rate: float, work_dir: Path, lease_s: float = 15.0, seed: int = 7
) -> SoakReport:
    with SoakStack(work_dir / "logs", lease_s) as stack:
        # Every step is bounded on its own; this bounds their sum, so a stuck soak fails instead of hanging:
        # the traffic and its last answers, the holders of a last gate fault followed, then the lease.
        bound_s = duration_s + 3 * lease_s + 180
        return asyncio.run(asyncio.wait_for(_soak(stack, duration_s, rate, seed), bound_s))


def _fault_line(row: dict[str, Any], bound_s: float) -> str:
    line = f"    {row['at_s']:>6} s {row['kind']:<9} back after {row['back_after_s']} s"
    if row["exit_code"] is not None:
        line += f", exit code {row['exit_code']}"
    if row["holders"]:
        free = row["held_free_after_s"]
        after = "never" if free is None else f"{free} s after the signal"
        line += (f"; its {len(row['holders'])} holder(s) held {row['held_tokens']} tokens, none left "
                 f"on any agent {after} (target {bound_s:.1f} s)")  # fmt: skip
    return line


def _phase_text(outcomes: dict[str, int] | None) -> str:
    if not outcomes:
        return "0"
    return f"{sum(outcomes.values())} (" + ", ".join(f"{o}: {n}" for o, n in outcomes.items()) + ")"


def print_report(report: SoakReport) -> None:
    counts = ", ".join(f"{n} {kind}" for kind, n in report.fault_counts.items())
    print(f"soak: {report.duration_s:.0f} s at {report.rate:g} req/s, {report.sent} sent "
          f"({report.skipped} skipped: client backlog); faults: {counts}")  # fmt: skip
    print(f"  lost (no answer): {report.lost}   fail-open: {report.fail_open}   other errors: "
          f"{report.errors}   unexpected refusals: {report.unexpected_refusals}   "
          f"ok latency p50 {report.ok_p50_ms:.0f} ms, p99 {report.ok_p99_ms:.0f} ms")  # fmt: skip
    for kind, outcomes in report.outcomes.items():
        print(f"  {kind:<11} " + ", ".join(f"{outcome}: {n}" for outcome, n in outcomes.items()))
    print("  faults (s since the traffic started):")
    for row in report.faults:
        print(_fault_line(row, report.held_free_bound_s))
    print("  failed answers by the fault they followed (in flight at the signal / sent while down / "
          "sent after it was back, target 0):")  # fmt: skip
    steady = report.failures_by_fault.get(STEADY, {})
    print(f"    {STEADY:<9} {_phase_text(steady.get(STEADY))} (target 0)")
    for kind in report.fault_counts:
        phases = report.failures_by_fault.get(kind, {})
        print(f"    {kind:<9} " + " / ".join(_phase_text(phases.get(phase)) for phase in PHASES))
    lapsed = ", ".join(f"{kind} {n}" for kind, n in report.lapsed_by_fault.items()) or "none"
    print(f"  agents' renewals: {report.agent_events.get('renewed', 0)} renewed, "
          f"{report.agent_events.get('lapsed', 0)} lapsed; lapsed by the fault they followed: {lapsed} "
          f"(target: none {STEADY})")  # fmt: skip
    print(f"  reserved tokens once traffic stopped: {report.reserved_after_drain} "
          f"(releases lost with killed gates); after the {report.lease_s:g} s lease: "
          f"{report.reserved_after_lease}  -> leaked {report.leaked} (target 0)")  # fmt: skip
    print("  RSS (MiB) first quarter -> last quarter of each process's life:")
    for row in report.rss:
        print(f"    {row['role']:<22} pid {row['pid']:>7}  from {row['from_s']:>6} s for "
              f"{row['lifetime_s']:>6} s  {row['first_quarter_mib']:>7} -> {row['last_quarter_mib']:>7}  "
              f"({float(row['growth']):+.1%})")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_soak", description=__doc__.splitlines()[0])
    default_s = float(os.environ.get("KVGATE_SOAK_SECONDS", DEFAULT_SECONDS))
    parser.add_argument("--seconds", type=float, default=default_s, help="traffic duration (default 600)")
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests per second (default 8)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "soak", help="logs and report.json")
    parser.add_argument(
        "--lease-s",
        type=float,
        default=15.0,
        help="reservation lease: how long a lost release holds (default 15)",
    )
    args = parser.parse_args(argv if argv is not None else [])
    # The soak restarts agents on purpose: the reconnect warnings of its own headroom reads are noise.
    logging.getLogger("kvgate.headroom").setLevel(logging.ERROR)
    report = run_soak(args.seconds, args.rate, args.out, lease_s=args.lease_s)
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(asdict(report), indent=2))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
