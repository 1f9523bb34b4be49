"""What a body's size costs through the gate: Envoy alone vs Envoy + gate, 2 KB to 16 MB.

One Envoy (the stack of bench/bench_gate.py) serves chat requests of each size one at a time, in
turn through four listeners: (a) Envoy alone, no ext_proc; (e) Envoy holding the whole body in its
buffer filter and sending it on, which any ext_proc server that reads bodies makes it do; (b1) the
trivial grpc.aio ext_proc (json.loads and a pool), one round trip; (c1) the kvgate gate, one round
trip. The gate's model allows 100 million tokens, so every size is routed (to the long pool) rather
than refused. The bodies are bench_gate's chat: a system prompt and one user message of English.

Printed per size: p50 and p99 of each, what (c1) adds over (a) at p50 and p99, that p50 per MB,
and the in-process cost of the same message through the gate's and the trivial server's Process
(CPU time, no gRPC, best of several), beside json.loads of the body alone. The table is also
written into docs/benchmarks.md between its `bench body` markers. Goals (issue 23): p50 added over
(a) <= 0.6 ms at 220 KB, <= 2 ms at 1 MB, <= 32 ms at 16 MB.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import uvloop
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from bench.bench_gate import (
    GC_LOG,
    PATH,
    ROOT,
    Servicer,
    chat_body,
    check_routing,
    envoy_messages,
    gate_config_text,
    running_stack,
)
from bench.gc_watch import summary as gc_summary
from bench.loadgen import Connection, http_request, percentile
from bench.trivial_extproc import TrivialProcessor
from kvgate.harness.processes import find_envoy

KB, MB = 1024, 1024 * 1024
# Size -> requests per variant: enough for a p99 at the small sizes, a few seconds at the large.
SIZES = {2 * KB: 300, 220 * KB: 150, 1 * MB: 80, 4 * MB: 40, 16 * MB: 20}
VARIANTS = ("a", "e", "b1", "c1")
WARM_UP = 3
MAX_TOTAL_TOKENS = 100_000_000
GOALS_MS = {220 * KB: 0.6, 1 * MB: 2.0, 16 * MB: 32.0}
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench body: begin -->", "<!-- bench body: end -->"


@dataclass(frozen=True, slots=True)
class SizeResult:
    size: int
    latencies: dict[str, list[float]]  # variant -> seconds
    inproc: dict[str, float]  # gate, trivial, json -> CPU seconds per request

    def ms(self, key: str, q: float) -> float:
        return percentile(self.latencies[key], q) * 1000

    def added(self, key: str, q: float) -> float:
        return self.ms(key, q) - self.ms("a", q)


def size_label(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


async def _measure(ports: dict[str, int], size: int, count: int) -> dict[str, list[float]]:
    """`count` rounds of one request per variant in turn, each waiting for its answer."""
    payload = http_request(PATH, chat_body(size))
    connections = {key: await Connection.open("127.0.0.1", port) for key, port in ports.items()}
    try:
        for _ in range(WARM_UP):
            for connection in connections.values():
                await connection.exchange(payload)
        latencies: dict[str, list[float]] = {key: [] for key in connections}
        for _ in range(count):
            for key, connection in connections.items():
                latencies[key].append(await connection.exchange(payload))
        return latencies
    finally:
        for connection in connections.values():
            connection.close()


def inprocess_costs(sizes: list[int]) -> dict[int, dict[str, float]]:
    """CPU seconds per request, per size: the gate's and the trivial servicer's Process on the
    one-trip message (parse the message, Process, serialize the answer; no gRPC), and json.loads of
    the body alone. Best of several, in a child process (the gate's metrics set process-wide state)."""
    from kvgate.config import parse_config
    from kvgate.gate.pipeline import Pipeline, estimator_factory
    from kvgate.gate.processor import ExternalProcessor
    from kvgate.telemetry import DecisionSpans, GateMetrics

    async def per_request(servicer: Servicer, raw: bytes, runs: int) -> float:
        async def stream() -> AsyncIterator[ProcessingRequest]:
            yield ProcessingRequest.FromString(raw)

        best = math.inf
        for _ in range(runs):
            started = time.process_time()
            async for response in servicer.Process(stream(), None):
                response.SerializeToString()
            best = min(best, time.process_time() - started)
        return best

    async def measure() -> dict[int, dict[str, float]]:
        config = parse_config(gate_config_text(MAX_TOTAL_TOKENS))
        pipeline = Pipeline(config, estimator_factory())
        gate = ExternalProcessor(pipeline, config, GateMetrics(), DecisionSpans())
        costs = {}
        try:
            for size in sizes:
                body = chat_body(size)
                raw = envoy_messages(body, 1)[0]
                runs = max(5, min(200, 200 * MB // (size * 20)))
                loads = math.inf
                for _ in range(runs):
                    started = time.process_time()
                    json.loads(body)
                    loads = min(loads, time.process_time() - started)
                costs[size] = {
                    "gate": await per_request(gate, raw, runs),
                    "trivial": await per_request(TrivialProcessor(), raw, runs),
                    "json": loads,
                }
        finally:
            pipeline.close()
        return costs

    return uvloop.run(measure())


def table(results: list[SizeResult]) -> list[str]:
    """The per-size table, as Markdown rows."""
    rows = [
        "| body | (a) Envoy alone p50 / p99 ms | + gate (c1): p50 / p99 added | p50 added per MB "
        "| (e) + buffer, no ext_proc: p50 added | (b1) + trivial: p50 added "
        "| in process: gate / trivial / json.loads ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        cpu = result.inproc
        rows.append(
            f"| {size_label(result.size)} | {result.ms('a', 50):.2f} / {result.ms('a', 99):.2f} "
            f"| {result.added('c1', 50):+.2f} / {result.added('c1', 99):+.2f} "
            f"| {result.added('c1', 50) / (result.size / MB):.2f} "
            f"| {result.added('e', 50):+.2f} | {result.added('b1', 50):+.2f} "
            f"| {cpu['gate'] * 1000:.3f} / {cpu['trivial'] * 1000:.3f} / {cpu['json'] * 1000:.3f} |"
        )
    return rows


def verdicts(results: list[SizeResult]) -> list[str]:
    lines = []
    for result in results:
        goal = GOALS_MS.get(result.size)
        if goal is not None:
            added = result.added("c1", 50)
            verdict = "met" if added <= goal else "MISSED"
            lines.append(
                f"{size_label(result.size)}: the gate adds {added:+.2f} ms p50 (goal <= +{goal}): {verdict}"
            )
    return lines


def write_docs(block: list[str]) -> bool:
    """Put `block` between the markers in docs/benchmarks.md; False when the markers are missing."""
    if not DOCS.exists():
        return False
    text = DOCS.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return False
    DOCS.write_text(text[: start + len(BEGIN)] + "\n" + "\n".join(block) + "\n" + text[end:])
    return True


def main() -> None:
    started = time.monotonic()
    load = os.getloadavg()
    version = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, check=True).stdout
    release = version.split("version:")[-1].split("/")[1] if "/" in version else "?"
    print(f"Envoy {release}, chat bodies one at a time, {os.cpu_count()} cores, load average {load[0]:.2f}")
    sizes = list(SIZES)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        inproc = pool.submit(inprocess_costs, sizes).result()
    results = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        with running_stack(Path(tmp), gate_config_text(MAX_TOTAL_TOKENS)) as (by_key, _pids):
            for key in VARIANTS:
                check_routing(by_key[key], chat_body())
            ports = {key: by_key[key].port for key in VARIANTS}
            for size, count in SIZES.items():
                latencies = uvloop.run(_measure(ports, size, count))
                results.append(SizeResult(size, latencies, inproc[size]))
                load_now = os.getloadavg()[0]
                print(f"  {size_label(size)}: {count} requests per variant, load average {load_now:.2f}")
        print(f"  the gate's garbage collections while serving (CPU): {gc_summary(Path(tmp) / GC_LOG)}")
    rows = table(results)
    print("\n".join(rows))
    lines = verdicts(results)
    print("\n".join(lines))
    end_load = os.getloadavg()[0]
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    block = [
        f"`python -m bench body` on {date.today().isoformat()}, commit {commit or '?'}, Envoy {release}, "
        f"{os.cpu_count()} cores, load average {load[0]:.2f} before and {end_load:.2f} after the run:",
        "",
        *rows,
        "",
        *(f"- {line}" for line in lines),
    ]
    where = (
        "written to docs/benchmarks.md"
        if write_docs(block)
        else "docs/benchmarks.md has no bench body markers"
    )
    print(f"({where}; {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
