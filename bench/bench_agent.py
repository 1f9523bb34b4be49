"""Headroom agent: stream jitter, agent CPU, engine-to-view lag and Reserve round trip on loopback.

The agent runs as its own process (`kvgate agent --nvml fake --fake-gpus 8`) scraping a fake vLLM
/metrics served from this process; the gate side is a HeadroomView here. Baselines measured in the
same run: a bare asyncio timer's jitter, the CPU of an agent that samples nothing, the sampling
period itself (for lag), and a gRPC health Check on the same agent (for Reserve).
Targets (issue 4): jitter p99 <= 10 ms, agent CPU <= 2% of a core, lag p99 <= 150 ms, Reserve p99 <= 2 ms.

And what a request's Reserve, FirstToken and Release cost the agent and the caller in CPU, as messages
on one Ledger stream (what gates and queues send) against the same three as unary calls (what they
sent before), alternated on one agent. And what a gate's own Reserves and Releases cost when the agent
counts their answers as told to it (it reserves under the name it subscribes with) against when it does
not (another name: sent every change, as before this change): kvgate.agent.subscribers.

Also, in this process: what reading a big engine page costs (against one str.splitlines of it), and
what NvmlPoller.latest() costs while NVML answers and while a call hangs (the figures the tests once
held to wall-clock budgets of 2 ms and 10 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate._proto.headroom.v1 import headroom_pb2_grpc as pb_grpc
from kvgate.agent.sources.engines import read_engine_page
from kvgate.agent.sources.fake_engine import FakeEngineMetrics
from kvgate.agent.sources.fake_nvml import FakeNvml, make_gpus
from kvgate.agent.sources.nvml import NvmlPoller, NvmlSampler
from kvgate.config.headroom import HeadroomSettings
from kvgate.headroom.client import AgentClient
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

PERIOD_S = 0.1
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LAUNCH = (
    "import argparse, sys; from kvgate.agent.cli import register; p = argparse.ArgumentParser(); "
    "register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)


@contextmanager
def _agent(*flags: str, defaults: bool = False) -> Iterator[tuple[str, int]]:
    """An agent process; unless `defaults`, one that sends and scrapes every period, as the jitter and
    lag figures mean it (an agent sends on change and scrapes a quiet engine every 500 ms by default:
    docs/operations.md, "Agent stream")."""
    port = free_port()
    every_period = () if defaults else ("--heartbeat-ms", "0", "--idle-scrape-ms", "0")
    argv = [
        "agent",
        "--listen",
        f"127.0.0.1:{port}",
        "--endpoint",
        "127.0.0.1:8000",
        "--period-ms",
        "100",
        *every_period,
        "--metrics-listen",
        "off",
        *flags,
    ]
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *argv], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _timer_jitter(count: int) -> list[float]:
    loop = asyncio.get_running_loop()
    deadline = loop.time()
    stamps = []
    for _ in range(count):
        deadline += PERIOD_S
        await asyncio.sleep(max(0.0, deadline - loop.time()))
        stamps.append(time.monotonic())
    return [abs(b - a - PERIOD_S) for a, b in itertools.pairwise(stamps)]


async def _stream_jitter(address: str, count: int) -> list[float]:
    client = AgentClient(address, 0.05, 1.0)
    stream = client.subscribe("bench")
    stamps = []
    try:
        for _ in range(count):
            assert await stream.next() is not None
            stamps.append(time.monotonic())
    finally:
        stream.cancel()
        await client.close()
    return [abs(b - a - PERIOD_S) for a, b in itertools.pairwise(stamps[1:])]


async def _cpu_share(pid: int, address: str, seconds: float) -> float:
    client = AgentClient(address, 0.05, 1.0)
    stream = client.subscribe("bench")
    try:
        await stream.next()
        before, start = _cpu_s(pid), time.monotonic()
        end = start + seconds
        while time.monotonic() < end:
            await stream.next()
        return (_cpu_s(pid) - before) / (time.monotonic() - start)
    finally:
        stream.cancel()
        await client.close()


async def _view_lag(engine: FakeEngineMetrics, address: str, changes: int) -> list[float]:
    view = HeadroomView(HeadroomSettings(agents=(address,)))
    await view.start()
    lags = []
    try:
        while not view.snapshot()[0].connected:
            await view.wait_update(1.0)
        for i in range(changes):
            await asyncio.sleep(random.uniform(0.0, PERIOD_S))
            engine.kv_usage = (i % 9 + 1) / 10
            target = round(engine.kv_usage * engine.capacity_tokens)
            changed = time.monotonic()
            while (node := view.snapshot()[0].headroom) is None or node.used_tokens != target:
                await view.wait_update(1.0)
            lags.append(time.monotonic() - changed)
    finally:
        await view.stop()
    return lags


async def _round_trips(address: str, count: int) -> tuple[list[float], list[float]]:
    client = AgentClient(address, 0.05, 1.0)
    reserve, health = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for i in range(count):
                t0 = time.perf_counter()
                await client.reserve(f"bench-{i}", 1, 60, "bench", 1.0)
                t1 = time.perf_counter()
                await client.release(f"bench-{i}", "bench", 1.0)
                t2 = time.perf_counter()
                await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                health.append(time.perf_counter() - t2)
                reserve.append(t1 - t0)
        finally:
            await client.close()
    return reserve, health


LEDGER_REQUESTS = 1500
OWN_CALLS = 400
OWN_CALLS_PER_S = 20


async def _request_cpu(pid: int, address: str) -> dict[str, tuple[float, float]]:
    """Per request (Reserve, FirstToken, Release), CPU seconds of the agent and of this process, for
    each way of calling, alternated twice on one agent (the best of the two per way)."""
    client = AgentClient(address, 0.05, 1.0)
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.AgentStub(channel)  # type: ignore[no-untyped-call]

    async def streamed(i: int) -> None:
        await client.reserve(f"s{i}", 100, 60, "bench", 1.0, reports_first_token=True)
        await client.first_token(f"s{i}", "bench", 1.0)
        await client.release(f"s{i}", "bench", 1.0)

    async def unary(i: int) -> None:
        request = pb.ReserveRequest(request_id=f"u{i}", tokens=100, lease_s=60, holder="bench")
        request.reports_first_token = True
        await stub.Reserve(request, timeout=1.0)
        await stub.FirstToken(pb.FirstTokenRequest(request_id=f"u{i}", holder="bench"), timeout=1.0)
        await stub.Release(pb.ReleaseRequest(request_id=f"u{i}", holder="bench"), timeout=1.0)

    best: dict[str, tuple[float, float]] = {}
    try:
        for way, request in (("unary", unary), ("stream", streamed)) * 2:
            await request(-1)  # the stream is open, the channel connected
            agent0, own0 = _cpu_s(pid), time.process_time()
            for i in range(LEDGER_REQUESTS):
                await request(i)
            figures = (
                (_cpu_s(pid) - agent0) / LEDGER_REQUESTS,
                (time.process_time() - own0) / LEDGER_REQUESTS,
            )
            best[way] = min(best.get(way, figures), figures, key=sum)
    finally:
        await client.close()
        await channel.close()
    return best


async def _own_calls() -> dict[str, tuple[float, float, int]]:
    """An agent at its defaults (on change, 1 s heartbeat) and a gate's view that reserves 20 times a
    second and releases each grant 10 later, once under the name it subscribes with (the agent counts
    the answers' figures as told to it) and once under another (sent every change, as before): per
    Reserve and Release, the agent's CPU and this process's, and the messages the view got in all."""
    figures: dict[str, tuple[float, float, int]] = {}
    engine = FakeEngineMetrics(kv_usage=0.1)  # usage that does not move: the calls are the only change
    url = await engine.start()
    with _agent("--nvml", "off", "--engine-metrics", url, defaults=True) as (address, pid):
        for way, holder in (("another holder", "bench-other"), ("its own", None)) * 2:
            view = HeadroomView(HeadroomSettings(agents=(address,)), subscriber="bench", holder=holder)
            await view.start()
            try:
                figures[way] = min(
                    figures.get(way, (1.0, 1.0, 0)), await _paced_calls(view, pid), key=lambda f: f[0] + f[1]
                )
            finally:
                await view.stop()
    await engine.stop()
    return figures


async def _paced_calls(view: HeadroomView, pid: int) -> tuple[float, float, int]:
    while not view.snapshot()[0].connected:
        await view.wait_update(1.0)
    node = view.snapshot()[0].agent
    messages = 0

    async def count() -> None:
        nonlocal messages
        while True:
            messages += await view.wait_update(5.0)

    counting = asyncio.create_task(count())
    loop = asyncio.get_running_loop()
    agent0, own0, due = _cpu_s(pid), time.process_time(), loop.time()
    live: list[str] = []
    try:
        for i in range(OWN_CALLS):
            due += 1 / OWN_CALLS_PER_S
            await asyncio.sleep(max(0.0, due - loop.time()))
            assert (await view.reserve(node, f"o{i}", 2_000, output_tokens=100)).granted
            live.append(f"o{i}")
            if len(live) > 10:
                await view.release(node, live.pop(0))
        for request_id in live:
            await view.release(node, request_id)
    finally:
        counting.cancel()
    return (_cpu_s(pid) - agent0) / OWN_CALLS, (time.process_time() - own0) / OWN_CALLS, messages


async def _run() -> None:
    engine = FakeEngineMetrics()
    url = await engine.start()
    try:
        baseline_jitter = await _timer_jitter(31)
        with _agent("--nvml", "off", "--capacity-tokens", "40000") as (address, pid):
            idle_cpu = await _cpu_share(pid, address, 6.0)
            request_cpu = await _request_cpu(pid, address)
        with _agent("--nvml", "fake", "--fake-gpus", "8", "--engine-metrics", url) as (address, pid):
            jitter = await _stream_jitter(address, 62)
            cpu = await _cpu_share(pid, address, 6.0)
            lags = await _view_lag(engine, address, 40)
            reserve, health = await _round_trips(address, 1000)
        own_calls = await _own_calls()
    finally:
        await engine.stop()
    ms = 1000.0
    print("bench_agent (agent process: 8 fake GPUs + fake vLLM /metrics, period 100 ms)")
    print(
        f"  stream jitter p50/p99: {_pct(jitter, 0.5) * ms:.2f} / {_pct(jitter, 0.99) * ms:.2f} ms "
        f"(bare asyncio timer p99 {_pct(baseline_jitter, 0.99) * ms:.2f} ms; target <= 10 ms)"
    )
    print(
        f"  agent CPU: {cpu * 100:.2f}% of a core (agent sampling nothing: {idle_cpu * 100:.2f}%, "
        f"x{cpu / max(idle_cpu, 1e-9):.1f}; target <= 2%)"
    )
    print(
        f"  engine change -> view lag p50/p99: {_pct(lags, 0.5) * ms:.1f} / {_pct(lags, 0.99) * ms:.1f} ms "
        f"(= {_pct(lags, 0.99) / PERIOD_S:.2f} periods; target <= 150 ms)"
    )
    print(
        f"  Reserve round trip p50/p99: {_pct(reserve, 0.5) * ms:.3f} / {_pct(reserve, 0.99) * ms:.3f} ms "
        f"(bare gRPC health Check p50/p99 {_pct(health, 0.5) * ms:.3f} / {_pct(health, 0.99) * ms:.3f} ms, "
        f"p50 x{statistics.median(reserve) / statistics.median(health):.2f}; target p99 <= 2 ms)"
    )
    (agent_unary, own_unary), (agent_stream, own_stream) = request_cpu["unary"], request_cpu["stream"]
    print(
        f"  a request's Reserve + FirstToken + Release, CPU: agent {agent_stream * ms:.3f} ms on the Ledger "
        f"stream against {agent_unary * ms:.3f} ms unary (x{agent_stream / agent_unary:.2f}); caller "
        f"{own_stream * ms:.3f} against {own_unary * ms:.3f} ms (x{own_stream / own_unary:.2f}); "
        f"{LEDGER_REQUESTS} requests one at a time, best of two, agent ticking every period"
    )
    (agent_other, own_other, sent_other), (agent_own, own_own, sent_own) = (
        own_calls["another holder"],
        own_calls["its own"],
    )
    print(
        f"  a gate's own Reserve + Release, {OWN_CALLS_PER_S}/s at the agent's defaults, per pair: stream "
        f"messages to it {sent_own / OWN_CALLS:.2f} against {sent_other / OWN_CALLS:.2f} when it reserves "
        f"under another name; CPU agent {agent_own * ms:.3f} against {agent_other * ms:.3f} ms "
        f"(x{agent_own / agent_other:.2f}), caller {own_own * ms:.3f} against {own_other * ms:.3f} ms "
        f"(x{own_own / own_other:.2f}); {OWN_CALLS} pairs, best of two"
    )


def _call_times(call: Callable[[], object], count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


def _page_read() -> None:
    """A vLLM page padded with histogram buckets to over 100 KB, read as the agent reads it."""
    buckets = "".join(
        f'vllm:request_prompt_tokens_bucket{{engine="0",le="{2**i}.0",model_name="{MODEL}"}} {i}.0\n'
        for i in range(20)
    )
    page = buckets * 60 + FakeEngineMetrics(kv_usage=0.5).render()
    read_engine_page(page)
    reads = _call_times(lambda: read_engine_page(page), 200)
    splits = _call_times(page.splitlines, 200)
    ms = 1000.0
    read, split = _pct(reads, 0.5), _pct(splits, 0.5)
    print(
        f"  engine page read ({len(page) // 1024} KiB, {page.count(chr(10))} lines) p50/p99: "
        f"{read * ms:.3f} / {_pct(reads, 0.99) * ms:.3f} ms "
        f"(str.splitlines of it p50 {split * ms:.3f} ms, x{read / split:.0f}; "
        "the agent reads one page per period)"
    )


def _nvml_latest() -> None:
    """latest() while 8 fake GPUs answer every 10 ms, then while one NVML call hangs."""
    fake = FakeNvml(make_gpus(8), max_hang_s=60.0)
    poller = NvmlPoller(NvmlSampler(fake, time.monotonic), period_s=0.01, hung_after_s=2.0)
    try:
        assert poller.wait_first(30.0)
        answering = _call_times(poller.latest, 20_000)
        fake.hang()
        started = sum(fake.calls.values())
        deadline = time.monotonic() + 30
        while sum(fake.calls.values()) == started and time.monotonic() < deadline:
            time.sleep(0.01)
        hung = _call_times(poller.latest, 20_000)
    finally:
        fake.unhang()
        poller.close()
    nothing = _call_times(lambda: None, 20_000)
    us = 1e6
    print(
        f"  NvmlPoller.latest() p50/p99/max: {_pct(answering, 0.5) * us:.2f} / "
        f"{_pct(answering, 0.99) * us:.2f} / {max(answering) * us:.1f} us while NVML answers; "
        f"{_pct(hung, 0.5) * us:.2f} / "
        f"{_pct(hung, 0.99) * us:.2f} / {max(hung) * us:.1f} us while a call hangs "
        f"(a Python call doing nothing: p50 {_pct(nothing, 0.5) * us:.2f} us)"
    )


def main() -> None:
    print("bench_agent, in this process")
    _page_read()
    _nvml_latest()
    asyncio.run(_run())


if __name__ == "__main__":
    main()
