"""Soak: mixed traffic at a steady rate through the real Envoy while agents and gate workers are killed.

The stack (bench/soak_stack.py): Envoy from envoy/envoy.yaml, `kvgate gate --workers 2`, two agents in
front of simulated long-context nodes, a simulated interactive node. The traffic
(bench/soak_traffic.py): short chats, long requests, long requests that generate for 1.5 leases
(alive only if the gate renews them), too-long and malformed requests, gzip bodies.
Meanwhile, periodically, one agent is SIGKILLed and started again, and the gate worker that holds
Envoy's ext_proc connection is SIGKILLed (the gate's supervisor starts a new one).

It reports every process's RSS over time (growth from the first to the last quarter of the run, for
processes that lived through it; per lifetime for the ones killed), outcomes by kind (lost requests
apart from explicit refusals), and the reservations still held on the agents once the traffic has
stopped: right away (releases lost with killed workers) and after the lease (leaked for good).
Targets: zero lost, zero leaked, flat memory.

    python -m bench soak                  10 minutes (KVGATE_SOAK_SECONDS=60 to shorten it)
    python -m bench.bench_soak --seconds 60 --rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.soak_stack import DECODE_TOKENS_PER_S, LONG_NODES, ROOT, SoakStack, rss_bytes
from bench.soak_traffic import Tally, send_steady
from kvgate.config.headroom import HeadroomSettings
from kvgate.headroom.view import HeadroomView

DEFAULT_SECONDS = 600.0
DEFAULT_RATE = 8.0
MiB = 1024 * 1024
# Imports and first allocations of a fresh process are not growth.
WARMUP_S = 5.0
# A long_held request generates this many leases long: it lives only if its reservation is renewed.
HELD_LEASES = 1.5


@dataclass(frozen=True, slots=True)
class Chaos:
    """When to kill what: an agent restart every `agent_every_s`, a worker kill every `worker_every_s`."""

    agent_every_s: float
    worker_every_s: float

    @staticmethod
    def for_duration(duration_s: float) -> Chaos:
        return Chaos(
            agent_every_s=min(max(duration_s / 4, 8.0), 45.0),
            worker_every_s=min(max(duration_s / 3, 10.0), 90.0),
        )


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
    agent_restarts: int
    worker_kills: int
    reserved_after_drain: dict[str, int]
    reserved_after_lease: dict[str, int]
    lease_s: float
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


async def _chaos(stack: SoakStack, chaos: Chaos, counts: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    next_agent, next_worker = chaos.agent_every_s, chaos.worker_every_s
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(min(next_agent, next_worker) - (time.monotonic() - t0))
        elapsed = time.monotonic() - t0
        if elapsed >= next_agent:
            # Always the same agent: the other one lives through the run, so its memory can be judged.
            await loop.run_in_executor(None, stack.restart_agent, len(LONG_NODES) - 1)
            counts["agent_restarts"] += 1
            next_agent += chaos.agent_every_s
        if elapsed >= next_worker:
            if len(stack.gate_workers()) == 2 and (pid := _busy_worker(stack)) is not None:
                stack.kill_gate_worker(pid)
                counts["worker_kills"] += 1
            next_worker += chaos.worker_every_s


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


def held_output_tokens(lease_s: float) -> int:
    """The output of a long_held request: HELD_LEASES leases of decoding on a soak node."""
    return int(HELD_LEASES * lease_s * DECODE_TOKENS_PER_S)


async def _soak(stack: SoakStack, duration_s: float, rate: float, seed: int) -> SoakReport:
    t0 = time.monotonic()
    series: dict[int, RssSeries] = {}
    counts = {"agent_restarts": 0, "worker_kills": 0}
    sampler = asyncio.create_task(_sample_rss(stack, series, max(1.0, duration_s / 300), t0))
    chaos = asyncio.create_task(_chaos(stack, Chaos.for_duration(duration_s), counts))
    try:
        tally = await send_steady(
            stack.url, rate, duration_s, seed, held_output_tokens=held_output_tokens(stack.lease_s)
        )
    finally:
        chaos.cancel()
        await asyncio.gather(chaos, return_exceptions=True)
    stack.check_alive()
    # Give the gate's releases (sent when Envoy ends each ext_proc stream) a moment to land.
    await asyncio.sleep(1.0)
    after_drain = await _reserved(stack.agent_addresses)
    after_lease = await _reserved_after_lease(stack.agent_addresses, stack.lease_s)
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    return _report(
        duration_s,
        rate,
        tally,
        counts=counts,
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


def _report(
    duration_s: float,
    rate: float,
    tally: Tally,
    *,
    counts: dict[str, int],
    after_drain: dict[str, int],
    after_lease: dict[str, int],
    lease_s: float,
    series: dict[int, RssSeries],
) -> SoakReport:
    outcomes: dict[str, dict[str, int]] = defaultdict(dict)
    for (kind, outcome), n in sorted(tally.outcomes.items()):
        outcomes[kind][outcome] = n
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
        agent_restarts=counts["agent_restarts"],
        worker_kills=counts["worker_kills"],
        reserved_after_drain=after_drain,
        reserved_after_lease=after_lease,
        lease_s=lease_s,
        rss=_rss_rows(series),
    )


def run_soak(
    duration_s: float, rate: float, work_dir: Path, lease_s: float = 15.0, seed: int = 7
) -> SoakReport:
    with SoakStack(work_dir / "logs", lease_s) as stack:
        # Every step is bounded on its own; this bounds their sum, so a stuck soak fails instead of hanging.
        bound_s = duration_s + lease_s + 120
        return asyncio.run(asyncio.wait_for(_soak(stack, duration_s, rate, seed), bound_s))


def print_report(report: SoakReport) -> None:
    print(f"soak: {report.duration_s:.0f} s at {report.rate:g} req/s, {report.sent} sent "
          f"({report.skipped} skipped: client backlog), {report.agent_restarts} agent restarts "
          f"(kill -9), {report.worker_kills} gate worker kills (kill -9)")  # fmt: skip
    print(f"  lost (no answer): {report.lost}   fail-open: {report.fail_open}   other errors: "
          f"{report.errors}   unexpected refusals: {report.unexpected_refusals}   "
          f"ok latency p50 {report.ok_p50_ms:.0f} ms, p99 {report.ok_p99_ms:.0f} ms")  # fmt: skip
    for kind, outcomes in report.outcomes.items():
        print(f"  {kind:<11} " + ", ".join(f"{outcome}: {n}" for outcome, n in outcomes.items()))
    print(f"  reserved tokens once traffic stopped: {report.reserved_after_drain} "
          f"(releases lost with killed workers); after the {report.lease_s:g} s lease: "
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
