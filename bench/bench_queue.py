"""The async tier: a burst of long jobs through `kvgate queue` onto simulated nodes.

NODES simulated nodes (`kvgate sim`, KV cache of NODE_TOKENS each) behind their agents; the queue
runs in this process (real HeadroomView, real HTTP to the engines, SQLite store) and the burst of
JOBS long jobs arrives at once as deferred requests. Each job holds about JOB_TOKENS of KV, so two
fit a node (admissible: 0.9 x capacity). Printed:
- KV never past capacity: each node's peak KV demand (the simulator's own count) over its capacity,
  against a baseline in the same run where the same burst goes straight to the nodes, round-robin;
- busy while jobs wait: the share of samples (every 20 ms, while some job waits) in which a node
  runs a job, and in which it runs as many as fit (target >= 90%);
- dispatch latency after capacity frees: from the end of a job's engine answer to the next waiting
  job's engine call on that node (target p99 <= 200 ms; the agent samples every 100 ms).
About 30 s. `python -m bench queue`.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from kvgate.config import parse_config
from kvgate.harness.client import chat
from kvgate.harness.processes import ProcessGroup, sim_command
from kvgate.harness.stack import agent_process, started
from kvgate.localports import free_port
from kvgate.queue.engines import EngineAnswer, HttpEngines
from kvgate.queue.jobs import JobRequest
from kvgate.queue.service import QueueService

NODES = 4
NODE_TOKENS = 20_000
JOBS = 32
PROMPT_BYTES = 32_000  # the simulator counts ceil(bytes / 4): 8,000 prompt tokens
OUTPUT_TOKENS = 120  # at 60 tokens/s: two seconds of decode
JOB_TOKENS = PROMPT_BYTES // 4 + OUTPUT_TOKENS
FIT_PER_NODE = int(NODE_TOKENS * 0.9) // JOB_TOKENS
SAMPLE_S = 0.02


@dataclass
class Timeline:
    """What the engines were asked and when, seen from the queue's side of the HTTP calls."""

    submitted: int = 0
    dispatched: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    # Per endpoint: engine answers that ended while jobs waited, not yet followed by a dispatch.
    freed: dict[str, deque[float]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    def waiting(self) -> int:
        return self.submitted - self.dispatched


class TimedEngines:
    """The queue's real engine client, with each call's start and end written down."""

    def __init__(self, engines: HttpEngines, timeline: Timeline) -> None:
        self._engines = engines
        self._timeline = timeline

    @asynccontextmanager
    async def send(
        self, endpoint: str, request: JobRequest, headers: Mapping[str, str]
    ) -> AsyncIterator[EngineAnswer]:
        line = self._timeline
        now = time.monotonic()
        line.dispatched += 1
        freed = line.freed.setdefault(endpoint, deque())
        if freed:
            line.latencies.append(now - freed.popleft())
        line.in_flight[endpoint] = line.in_flight.get(endpoint, 0) + 1
        try:
            async with self._engines.send(endpoint, request, headers) as answer:
                yield answer
        finally:
            line.in_flight[endpoint] -= 1
            if line.waiting() > 0:
                freed.append(time.monotonic())


async def _sim_page(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        for family in ("kvgate_sim_peak_kv_tokens", "kvgate_sim_kv_capacity_tokens", "vllm:num_preemptions"):
            if line.startswith(family + "{") or line.startswith(family + "_total{"):
                found[family] = found.get(family, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def _start_nodes(group: ProcessGroup, prefix: str) -> list[int]:
    ports = []
    for i in range(NODES):
        port = free_port()
        argv = sim_command(
            *("--listen", f"127.0.0.1:{port}", "--kv-capacity-tokens", str(NODE_TOKENS)),
            *("--max-model-len", "16384", "--model-name", "bench", "--decode-tokens-per-s", "60"),
        )
        started(group.start(f"{prefix}-node-{i}", argv, port=port), port)
        ports.append(port)
    return ports


async def _peaks(ports: list[int]) -> list[tuple[float, float, float]]:
    async with aiohttp.ClientSession() as session:
        pages = [await _sim_page(session, port) for port in ports]
    return [
        (
            p["kvgate_sim_peak_kv_tokens"],
            p["kvgate_sim_kv_capacity_tokens"],
            p.get("vllm:num_preemptions", 0.0),
        )
        for p in pages
    ]


def _body(job: int) -> bytes:
    """A distinct prompt per job: the simulated engines cache prefixes, as vLLM does, and identical
    prompts would share their KV blocks."""
    prompt = f"job {job:06d} " + "x" * (PROMPT_BYTES - 11)
    return chat(prompt, max_tokens=OUTPUT_TOKENS).replace(b"test-model", b"bench")


async def baseline(ports: list[int]) -> tuple[list[tuple[float, float, float]], float]:
    """The burst straight to the nodes, round-robin, all at once."""
    started_at = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one(i: int) -> None:
            url = f"http://127.0.0.1:{ports[i % NODES]}/v1/chat/completions"
            async with session.post(url, data=_body(i), headers={"content-type": "application/json"}) as r:
                await r.read()

        await asyncio.gather(*(one(i) for i in range(JOBS)))
    return await _peaks(ports), time.monotonic() - started_at


def _agents(group: ProcessGroup, ports: list[int]) -> list[str]:
    agents = []
    for i, port in enumerate(ports):
        endpoint = f"127.0.0.1:{port}"
        flags = ["--engine-metrics", f"http://{endpoint}/metrics"]
        agent = agent_process(group.log_dir, f"agent-{i}", free_port(), endpoint, flags)
        group.services[f"agent-{i}"] = agent
        agents.append(f"127.0.0.1:{agent.port}")
    return agents


@dataclass
class Samples:
    """Every SAMPLE_S while some job waits: nodes running a job, job slots filled, KV in use."""

    busy: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)
    kv: list[float] = field(default_factory=list)

    async def take(
        self, service: QueueService, timeline: Timeline, ports: list[int], stop: asyncio.Event
    ) -> None:
        while not stop.is_set():
            await asyncio.sleep(SAMPLE_S)
            if timeline.dispatched == 0 or timeline.waiting() <= 0:
                continue
            running = [timeline.in_flight.get(f"127.0.0.1:{p}", 0) for p in ports]
            self.busy.append(sum(1 for n in running if n) / NODES)
            self.full.append(sum(min(n, FIT_PER_NODE) for n in running) / (NODES * FIT_PER_NODE))
            views = [n.headroom for n in service.nodes() if n.headroom]
            admissible = sum(v.admissible_tokens for v in views)
            self.kv.append(sum(v.used_tokens or 0 for v in views) / admissible)


async def _burst(port: int, timeline: Timeline) -> list[str]:
    """Submit the burst as deferred jobs, wait for every one to end; their final statuses."""
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        headers = {"prefer": "respond-async", "x-kvgate-tokens": str(JOB_TOKENS)}

        async def submit(job: int) -> str:
            async with session.post(f"{url}/v1/chat/completions", data=_body(job), headers=headers) as r:
                assert r.status == 202, await r.text()
                timeline.submitted += 1
                job_id: str = (await r.json())["id"]
                return job_id

        ids = await asyncio.gather(*(submit(job) for job in range(JOBS)))
        while True:
            statuses = []
            for job_id in ids:
                async with session.get(f"{url}/v1/kvgate/jobs/{job_id}") as r:
                    statuses.append((await r.json())["status"])
            if all(s in ("succeeded", "failed") for s in statuses):
                return statuses
            await asyncio.sleep(0.5)


@dataclass(frozen=True)
class QueueRun:
    peaks: list[tuple[float, float, float]]
    elapsed_s: float
    succeeded: int
    samples: Samples
    latencies: list[float]


async def through_queue(group: ProcessGroup, ports: list[int], store: Path) -> QueueRun:
    config = parse_config(f"headroom: {{agents: [{', '.join(_agents(group, ports))}]}}\n")
    timeline = Timeline()
    engines = TimedEngines(HttpEngines(600), timeline)
    service = QueueService(config, f"sqlite:///{store}", "bench", engines=engines)
    await service.start()
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    samples = Samples()
    stop = asyncio.Event()
    try:
        while not all(n.headroom and n.healthy for n in service.nodes()):
            await asyncio.sleep(0.1)
        sampler = asyncio.create_task(samples.take(service, timeline, ports, stop))
        started_at = time.monotonic()
        statuses = await _burst(port, timeline)
        elapsed = time.monotonic() - started_at
        stop.set()
        await sampler
    finally:
        await service.stop()
        await runner.cleanup()
    return QueueRun(
        await _peaks(ports), elapsed, statuses.count("succeeded"), samples, sorted(timeline.latencies)
    )


def _ms(values: list[float], q: float) -> str:
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1000:.0f} ms"


def _peak_line(label: str, peaks: list[tuple[float, float, float]]) -> str:
    worst = max(peak / capacity for peak, capacity, _ in peaks)
    preemptions = int(sum(p for _, _, p in peaks))
    return f"{label:<10} peak KV demand / capacity, worst node {worst:.2f}; preemptions {preemptions}"


async def _run() -> None:
    load = os.getloadavg()
    print(
        f"{NODES} nodes x {NODE_TOKENS} KV tokens; {JOBS} jobs of ~{JOB_TOKENS} tokens, {FIT_PER_NODE} a node"
    )
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp)) as group:
        base_ports = _start_nodes(group, "base")
        base_peaks, base_s = await baseline(base_ports)
        queue_ports = _start_nodes(group, "queue")
        result = await through_queue(group, queue_ports, Path(tmp) / "queue.db")
    samples, latencies = result.samples, result.latencies
    print(_peak_line("baseline", base_peaks) + f"; {base_s:.1f} s for the burst")
    print(
        _peak_line("queue", result.peaks) + f"; {result.elapsed_s:.1f} s, {result.succeeded}/{JOBS} succeeded"
    )
    print(
        f"while jobs waited: a node running >= 1 job {statistics.fmean(samples.busy):.1%}, "
        f"job slots filled {statistics.fmean(samples.full):.1%}, "
        f"KV in use (agents' view) {statistics.fmean(samples.kv):.1%} of admissible"
    )
    if latencies:
        print(
            f"dispatch after capacity frees ({len(latencies)} dispatches): p50 {_ms(latencies, 0.5)}, "
            f"p99 {_ms(latencies, 0.99)}, max {_ms(latencies, 1.0)}"
        )
    print(f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f} (1 min)")


def main() -> None:
    asyncio.run(_run())


if __name__ == "__main__":
    main()
