"""The routing CPU that Envoy and any Python ext_proc server cost at the Mooncake replay's pace.

Issue 28 asks the replay's routing CPU (Envoy + gate + agents + queue, per request) to stay within
2.5x the best peer's. This measures the part no gate logic can remove: the README's replay
(`mooncake_conversation_first_half` at 6x) sends about 18 requests a second, of bodies tens of KB
large, and at that pace each request pays its own wake-ups where bench/bench_gate.py's 400 req/s
shares them. Same stack as bench_gate (the shipped one-round-trip Envoy, bench/trivial_extproc.py,
`kvgate gate` without agents, fixed-answer upstreams), the same open-loop load at the replay's mean
rate with a body of the replay's mean size, variants interleaved:

- (b1) Envoy + the trivial server: grpc.aio on uvloop, json.loads, the pool set (the floor);
- (c1) + kvgate's gate, which estimates the body and answers (no agents: a long request's Reserve
  and Release are not in this figure; `python -m bench agent` measures those).

Envoy without an ext_proc server is not among them: the one-trip routes answer a body this large
503 without a decision (the replay's `baseline` run measures Envoy alone). First, with no traffic, the
CPU each idle process spends a second: what every Python gRPC process of the stack (the gate, each
agent, the queue) costs before any request. Prints CPU ms per request of Envoy and the ext_proc server.

Last, what one unary gRPC call costs a grpc.aio server at the same pace (a bare health server, one
Check at a time): the least each Reserve, Release or stream message costs the process that answers
it, in CPU and in wake-ups of its threads (gRPC's I/O threads, its completion-queue poller, the
event loop). On a VM every wake-up costs about 0.1-0.2 ms of CPU (docs/benchmarks.md, "What a wake-up
costs").
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from bench.bench_gate import (
    PATH,
    Tally,
    _warn_if_busy,
    cpu_seconds,
    gate_config_text,
    measure_base_rate,
    running_stack,
)
from bench.loadgen import http_request
from kvgate.demo.load import LazyBodies
from kvgate.demo.scenario import builtin_scenario, load_scenario
from kvgate.demo.trace import Window, compressed, plan_trace, read_trace, trace_file
from kvgate.localports import free_port

TRACE = "mooncake_conversation_first_half"
SPEED = 6.0
STEP_S = 30.0
WARM_S = 3.0
VARIANTS = ("b1", "c1")
IDLE_S = 20.0
# As the replay does: the gate's exact-count workers load their tokenizer after it listens.
SETTLE_S = 5.0
RPC_S = 15.0
RPC_WARM = 20
# Bodies sampled for the mean size: every SAMPLE_EVERY-th request of the plan.
SAMPLE_EVERY = 25


def replay_pace() -> tuple[float, bytes]:
    """The replay's mean request rate and a body of its mean size (the one nearest the mean)."""
    window = Window()
    scenario = compressed(load_scenario(builtin_scenario("trace")), SPEED)
    requests = read_trace(trace_file(TRACE), window)
    plan = plan_trace(requests, window, SPEED, scenario.node.interactive_max_model_len)
    rate = len(plan) / max(plan[-1].at_s, 1e-9)
    sample = list(LazyBodies(scenario, plan[::SAMPLE_EVERY]))
    mean = statistics.fmean(len(body) for body in sample)
    return rate, min(sample, key=lambda body: abs(len(body) - mean))


async def idle_ms_per_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU ms per second of each process over IDLE_S with no traffic, once started up."""
    await asyncio.sleep(SETTLE_S)
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    await asyncio.sleep(IDLE_S)
    return {name: (cpu_seconds(pid) - before[name]) * 1000 / IDLE_S for name, pid in pids.items()}


def wake_ups(pid: int) -> int:
    """Voluntary context switches of every thread of `pid`: how often its threads went to sleep and
    were woken."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        match = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.MULTILINE)
        total += int(match.group(1)) if match else 0
    return total


def serve_health(port: int) -> None:
    """A bare grpc.aio health server on uvloop, as the agent serves its own."""

    async def serve() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


async def one_call_cost(port: int, pid: int, rate: float) -> tuple[float, float]:
    """(server CPU ms, server wake-ups) per health Check, one at a time at `rate` for RPC_S."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        await stub.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True)
        for _ in range(RPC_WARM):
            await stub.Check(health_pb2.HealthCheckRequest())
        calls = round(rate * RPC_S)
        cpu, woken = cpu_seconds(pid), wake_ups(pid)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index in range(calls):
            await stub.Check(health_pb2.HealthCheckRequest())
            await asyncio.sleep(max(0.0, start + (index + 1) / rate - loop.time()))
        return (cpu_seconds(pid) - cpu) * 1000 / calls, (wake_ups(pid) - woken) / calls


def rpc_floor(rate: float) -> tuple[float, float]:
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve_health, args=(port,), daemon=True)
    server.start()
    try:
        return uvloop.run(one_call_cost(port, server.pid or 0, rate))
    finally:
        server.terminate()
        server.join(5)


def main() -> None:
    started = time.monotonic()
    rate, body = replay_pace()
    print(f"{TRACE} at {SPEED:g}x: {rate:.1f} requests/s; a body of the mean size, {len(body):,} bytes")
    _warn_if_busy()
    gate_config = gate_config_text(max_total_tokens=1_000_000)
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-bench-floor-") as tmp,
        running_stack(Path(tmp), gate_config) as (
            by_key,
            pids,
        ),
    ):
        variants = [by_key[key] for key in VARIANTS]
        servers = {"envoy": pids["envoy"], **{v.label: v.ext_proc_pid for v in variants if v.ext_proc_pid}}

        async def run() -> tuple[dict[str, float], dict[str, Tally]]:
            idle = await idle_ms_per_s(servers)
            payload = http_request(PATH, body)
            return idle, await measure_base_rate(
                variants, pids, payload, rate=rate, step_s=STEP_S, warm_s=WARM_S
            )

        idle, tallies = uvloop.run(run())
    print(f"idle, CPU ms a second ({IDLE_S:g} s, no traffic, after {SETTLE_S:g} s to settle):")
    for name, value in idle.items():
        print(f"  {name:34}{value:6.1f}  = {value / rate:.2f} ms a request at {rate:.1f} requests/s")
    print(
        f"{'CPU ms a request at the pace':34}{'completed':>10}{'p50 ms':>8}"
        f"{'Envoy':>8}{'ext_proc':>10}{'sum':>8}"
    )
    for key in VARIANTS:
        tally = tallies[key]
        envoy = tally.cpu_us_per_request("envoy") / 1000
        ext_proc = tally.cpu_us_per_request("ext_proc") / 1000
        row = f"{tally.completed:>10}{tally.ms(50):8.2f}{envoy:8.2f}{ext_proc:10.2f}{envoy + ext_proc:8.2f}"
        print(f"{by_key[key].label:34}{row}")
    rpc_ms, rpc_wake_ups = rpc_floor(rate)
    print(
        f"one unary gRPC call (health Check) at {rate:.1f} a second: {rpc_ms:.2f} ms of the grpc.aio "
        f"server's CPU, {rpc_wake_ups:.1f} wake-ups of its threads"
    )
    print(f"({time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end)")


if __name__ == "__main__":
    main()
