"""The agent's gRPC server on 127.0.0.1: atomic grants under concurrency, streaming, health, failures."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import PATIENCE_S

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.server import SERVICE_NAME, Agent
from kvgate.agent.sources.fake_engine import FakeEngineMetrics
from kvgate.agent.sources.fake_nvml import FakeNvml, make_gpus
from kvgate.agent.sources.nvml import NvmlPoller, NvmlSampler
from kvgate.agent.sources.scrape import EngineScraper
from kvgate.errors import HeadroomError
from kvgate.headroom import wire
from kvgate.headroom.client import AgentClient
from kvgate.headroom.snapshot import GpuReading, NodeHeadroom, ReserveReason
from kvgate.headroom.wire import HeadroomEncoder, headroom_from_proto


@asynccontextmanager
async def running_agent(
    settings: NodeSettings, engine: FakeEngineMetrics | None = None, nvml: FakeNvml | None = None
) -> AsyncIterator[tuple[Agent, str]]:
    scraper = EngineScraper(await engine.start(), settings.period_s / 2) if engine else None
    boxed = NvmlPoller(NvmlSampler(nvml, time.monotonic), settings.period_s) if nvml else None
    agent = Agent(settings, scraper, boxed)
    port = await agent.start("127.0.0.1:0")
    try:
        yield agent, f"127.0.0.1:{port}"
    finally:
        await agent.stop(grace_s=0.1)
        if engine:
            await engine.stop()


# An engine that answers this late: only the scraper's timeout keeps the stream going.
SLOW_ENGINE_S = 3.0


def client(address: str) -> AgentClient:
    return AgentClient(address, reconnect_initial_s=0.05, reconnect_max_s=0.5)


async def first_message(
    address: str, accept: Callable[[NodeHeadroom], bool], timeout_s: float = PATIENCE_S
) -> NodeHeadroom:
    """The first streamed message that satisfies `accept`."""
    c = client(address)
    stream = c.subscribe("test")
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await stream.next()
                assert message is not None
                if accept(message):
                    return message
    finally:
        stream.cancel()
        await c.close()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def test_two_clients_reserving_at_once_cannot_over_admit() -> None:
    async def scenario() -> None:
        async with running_agent(NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=40_000)) as (
            agent,
            address,
        ):
            a, b = client(address), client(address)
            try:
                calls = [
                    c.reserve(f"{name}-{i}", 1_000, 60, name, timeout_s=5.0)
                    for i in range(40)
                    for name, c in (("a", a), ("b", b))
                ]
                outcomes = await asyncio.gather(*calls)
            finally:
                await a.close()
                await b.close()
            granted = [o for o in outcomes if o.granted]
            assert len(granted) == 36  # 40,000 x 0.9
            assert {o.reason for o in outcomes if not o.granted} == {"insufficient_headroom"}
            assert min(o.headroom_tokens for o in outcomes) == 0
            assert agent.state.ledger.reserved_tokens == 36_000

    run(scenario)


def test_five_12k_requests_on_a_40k_node_admit_three_and_drain_to_zero() -> None:
    async def scenario() -> None:
        async with running_agent(NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=40_000)) as (
            agent,
            address,
        ):
            c = client(address)
            try:
                outcomes = await asyncio.gather(*(c.reserve(f"r{i}", 12_000, 60, "g", 5.0) for i in range(5)))
                assert sum(o.granted for o in outcomes) == 3
                for i, outcome in enumerate(outcomes):
                    if outcome.granted:
                        assert (await c.release(f"r{i}", "g", 5.0)).released
                again = await c.release("r0", "g", 5.0)
                assert not again.released and again.reserved_tokens == 0 and again.headroom_tokens == 36_000
            finally:
                await c.close()
            assert agent.state.ledger.count == 0

    run(scenario)


def test_a_release_for_an_unanswered_reserve_refuses_that_reserve_when_it_arrives_late() -> None:
    async def scenario() -> None:
        settings = NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=40_000)
        async with running_agent(settings) as (_, address):
            c = client(address)
            try:
                assert not (await c.release("late", "g", 5.0, unanswered=True)).released
                late = await c.reserve("late", 12_000, 60, "g", 5.0)
                assert not late.granted and late.reason == ReserveReason.RELEASED_FIRST
                assert late.reserved_tokens == 0
            finally:
                await c.close()

    run(scenario)


@pytest.mark.slow
def test_two_processes_reserving_at_once_cannot_over_admit() -> None:
    worker = textwrap.dedent(
        """
        import asyncio, sys
        from kvgate.headroom.client import AgentClient

        async def main():
            c = AgentClient(sys.argv[1], 0.05, 0.5)
            calls = [c.reserve(f"{sys.argv[2]}-{i}", 2_000, 60, "p", 5.0) for i in range(30)]
            outcomes = await asyncio.gather(*calls)
            await c.close()
            print(sum(o.granted for o in outcomes))

        asyncio.run(main())
        """
    )

    async def scenario() -> None:
        async with running_agent(NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=40_000)) as (
            agent,
            address,
        ):
            procs = [
                await asyncio.create_subprocess_exec(
                    sys.executable, "-c", worker, address, name, stdout=subprocess.PIPE
                )
                for name in ("p1", "p2")
            ]
            outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 30)
            assert all(p.returncode == 0 for p in procs)
            assert sum(int(out) for out, _ in outputs) == 18  # 36,000 / 2,000
            assert agent.state.ledger.reserved_tokens == 36_000

    run(scenario)


def test_stream_pushes_with_increasing_seq_and_names_its_period() -> None:
    """How evenly the pushes come, period after period, is `python -m bench agent`'s figure (stream
    jitter); here, each message is newer than the one before and says the period it is pushed at."""

    async def scenario() -> None:
        settings = NodeSettings("n1", "127.0.0.1:8000", period_s=0.02, capacity_tokens=1000)
        async with running_agent(settings) as (_, address):
            c = client(address)
            stream = c.subscribe("test")
            received: list[NodeHeadroom] = []
            try:
                async with asyncio.timeout(PATIENCE_S):
                    for _ in range(11):
                        message = await stream.next()
                        assert message is not None
                        received.append(message)
            finally:
                stream.cancel()
                await c.close()
            seqs = [m.seq for m in received]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            stamps = [m.sample_time_unix_ns for m in received]
            assert stamps == sorted(stamps)
            last = received[-1]
            assert (last.node, last.endpoint, last.period_ms, last.headroom_tokens) == (
                "n1",
                "127.0.0.1:8000",
                20,
                900,
            )

    run(scenario)


def test_snapshots_are_encoded_once_and_the_gpu_list_only_when_it_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoded: list[GpuReading] = []
    gpu_to_proto = wire._gpu_to_proto

    def counting(gpu: GpuReading) -> pb.GpuInfo:
        encoded.append(gpu)
        return gpu_to_proto(gpu)

    monkeypatch.setattr(wire, "_gpu_to_proto", counting)
    state = NodeState(NodeSettings("n1", "e:1", capacity_tokens=1000), time.monotonic, False, True)
    state.observe_nvml(NvmlSampler(FakeNvml(make_gpus(2)), time.monotonic).read())
    first = state.snapshot(1)
    encoder = HeadroomEncoder()

    def decoded(h: NodeHeadroom) -> NodeHeadroom:
        return headroom_from_proto(pb.NodeHeadroom.FromString(encoder.encode(h)))

    assert decoded(first) == first and len(encoded) == 2
    later = state.snapshot(2)  # the same NVML reading: its GPU list is not encoded again
    assert later.gpus is first.gpus and decoded(later) == later and len(encoded) == 2
    one_gpu = dataclasses.replace(later, gpus=later.gpus[:1])
    assert decoded(one_gpu) == one_gpu and len(encoded) == 3
    no_gpus = dataclasses.replace(later, gpus=())
    assert decoded(no_gpus) == no_gpus


def test_every_rpc_of_the_agent_service_is_served() -> None:
    async def scenario() -> None:
        service = pb.DESCRIPTOR.services_by_name["Agent"]
        async with (
            running_agent(NodeSettings("n1", "e:1", capacity_tokens=1000)) as (_, address),
            grpc.aio.insecure_channel(address) as channel,
        ):
            for method in service.methods:
                reply_type = GetMessageClass(method.output_type)
                open_call = channel.unary_stream if method.server_streaming else channel.unary_unary
                call = open_call(
                    f"/{service.full_name}/{method.name}",
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=reply_type.FromString,
                )(GetMessageClass(method.input_type)(), timeout=10.0)
                try:
                    reply = await (call.read() if method.server_streaming else call)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() != grpc.StatusCode.UNIMPLEMENTED, method.name
                else:
                    assert isinstance(reply, reply_type), method.name
                finally:
                    call.cancel()

    run(scenario)


def test_engine_usage_flows_into_the_stream_and_reservations() -> None:
    async def scenario() -> None:
        engine = FakeEngineMetrics(num_gpu_blocks=2500, block_size=16)
        nvml = FakeNvml(make_gpus(2))
        async with running_agent(NodeSettings("n1", "e:1"), engine, nvml) as (agent, address):
            engine.kv_usage = 0.5
            message = await first_message(address, lambda m: m.used_tokens == 20_000 and m.healthy)
            assert message.headroom_tokens == 16_000 and len(message.gpus) == 2
            outcome = agent.state.reserve("r", 17_000, 0)
            assert not outcome.granted and outcome.reason == "insufficient_headroom"

    run(scenario)


def test_the_stream_says_what_engine_was_read_and_how() -> None:
    async def scenario() -> None:
        engine = FakeEngineMetrics(flavor="sglang", kv_usage=0.25)
        async with running_agent(NodeSettings("n1", "e:1"), engine) as (_, address):
            message = await first_message(address, lambda m: m.used_tokens == 10_000)
        assert (message.engine_kind, message.engines, message.usage_source.value) == (
            "sglang",
            ("one scheduler",),
            "engine",
        )
        assert message.capacity_rule == "sglang:max_total_num_tokens 40000"
        # A fresh sample's age: a few periods at most here, unless the machine is very busy.
        assert message.engine_sample_age_ms is not None and 0 <= message.engine_sample_age_ms < 10_000

    run(scenario)


def test_an_unrecognised_page_is_named_and_manual_capacity_runs_it_reservation_only() -> None:
    async def scenario() -> None:
        engine = FakeEngineMetrics(body="# TYPE tgi_queue_size gauge\ntgi_queue_size 2\n")
        settings = NodeSettings("n1", "e:1", capacity_tokens=40_000, unreserved_request_tokens=1000)
        async with running_agent(settings, engine) as (agent, address):
            message = await first_message(address, lambda m: m.engine_kind == "tgi" and m.healthy)
            assert (message.used_tokens, message.unreserved_tokens) == (2_000, 2_000)
            assert message.reason.startswith("reservation-only: tgi publishes no KV-cache figures")
            assert agent.state.reserve("r", 34_000, 0).granted and not agent.state.reserve("s", 1, 0).granted
            engine.body = "# TYPE other gauge\nother_metric 1\n"
            unknown = await first_message(address, lambda m: m.engine_kind == "unknown" and m.healthy)
            assert unknown.reason.startswith(
                "reservation-only: unrecognised engine page (first metric names: other_metric)"
            )

    run(scenario)


def test_garbage_metrics_make_the_node_unhealthy_once_its_figures_are_stale() -> None:
    async def scenario() -> None:
        engine = FakeEngineMetrics()
        # Scrapes time out after half a period: 100 ms, which a busy machine's loop still meets.
        settings = NodeSettings("n1", "e:1", period_s=0.2, engine_stale_after_s=1.0)
        async with running_agent(settings, engine) as (_, address):
            await first_message(address, lambda m: m.healthy)
            engine.body = "<html>oops</html>"
            sick = await first_message(address, lambda m: not m.healthy and "Prometheus" in m.reason)
            assert sick.reason == (
                "engine_metrics_stale: engine metrics: not a Prometheus text page "
                "(17 chars, first line '<html>oops</html>')"
            )
            assert sick.capacity_tokens == 0 and sick.used_tokens is None
            engine.body = None
            assert (await first_message(address, lambda m: m.healthy)).capacity_tokens == 40_000

    run(scenario)


def test_a_slow_engine_does_not_delay_the_stream() -> None:
    """Each scrape times out after half a period. A stream that waited for the engine instead would
    take SLOW_ENGINE_S per message, 18 s for the six read here; the stream gets them in its periods."""

    async def scenario() -> None:
        engine = FakeEngineMetrics(delay_s=SLOW_ENGINE_S)
        settings = NodeSettings("n1", "e:1", period_s=0.05, engine_stale_after_s=0.2)
        async with running_agent(settings, engine) as (_, address):
            c = client(address)
            stream = c.subscribe("test")
            try:
                async with asyncio.timeout(SLOW_ENGINE_S * 6 / 2):
                    messages = [await stream.next() for _ in range(6)]
            finally:
                stream.cancel()
                await c.close()
            assert all(m is not None for m in messages)
            sick = await first_message(address, lambda m: not m.healthy)
            assert "no answer within" in sick.reason

    run(scenario)


def test_lost_gpu_shows_in_the_stream_and_refuses_reservations() -> None:
    async def scenario() -> None:
        nvml = FakeNvml(make_gpus(2))
        settings = NodeSettings("n1", "e:1", period_s=0.05, capacity_tokens=40_000)
        async with running_agent(settings, nvml=nvml) as (agent, address):
            await first_message(address, lambda m: m.healthy)  # NVML's first reading is in
            nvml.gpus[0].lost = True
            sick = await first_message(address, lambda m: not m.healthy)
            assert sick.reason.startswith("gpu_lost")
            assert not agent.state.reserve("r", 1, 0).granted

    run(scenario)


def test_health_service_follows_the_node() -> None:
    async def scenario() -> None:
        nvml = FakeNvml(make_gpus(1))
        settings = NodeSettings("n1", "e:1", period_s=0.05, capacity_tokens=1000)
        async with (
            running_agent(settings, nvml=nvml) as (_, address),
            grpc.aio.insecure_channel(address) as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)

            async def status() -> int:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
                return int(reply.status)

            async with asyncio.timeout(PATIENCE_S):  # once NVML's first reading is in
                while await status() != health_pb2.HealthCheckResponse.SERVING:
                    await asyncio.sleep(0.02)
            nvml.gpus[0].lost = True
            async with asyncio.timeout(PATIENCE_S):
                while await status() != health_pb2.HealthCheckResponse.NOT_SERVING:
                    await asyncio.sleep(0.02)
            overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert overall.status == health_pb2.HealthCheckResponse.SERVING

    run(scenario)


def test_bad_reserve_arguments_are_rejected_by_the_agent() -> None:
    async def scenario() -> None:
        async with running_agent(NodeSettings("n1", "e:1", capacity_tokens=1000)) as (_, address):
            c = client(address)
            try:
                with pytest.raises(HeadroomError, match="INVALID_ARGUMENT"):
                    await c.reserve("r", 0, 0, "g", 1.0)
                with pytest.raises(HeadroomError, match="INVALID_ARGUMENT"):
                    await c.reserve("", 5, 0, "g", 1.0)
            finally:
                await c.close()

    run(scenario)


def test_stop_ends_subscriber_streams_cleanly() -> None:
    async def scenario() -> None:
        agent = Agent(NodeSettings("n1", "e:1", period_s=0.05, capacity_tokens=1000))
        port = await agent.start("127.0.0.1:0")
        c = client(f"127.0.0.1:{port}")
        stream = c.subscribe("test")
        try:
            assert await asyncio.wait_for(stream.next(), PATIENCE_S) is not None
            await agent.stop(grace_s=0.5)
            async with asyncio.timeout(PATIENCE_S):
                while (await stream.next()) is not None:
                    pass
        finally:
            stream.cancel()
            await c.close()

    run(scenario)


def test_an_idle_agent_waits_its_idle_interval_and_a_reserve_or_release_brings_its_message_forward() -> None:
    # An idle interval of a minute: a message for the grant or the release that came before it can
    # only be the Reserve or Release waking the loop (kvgate.agent.server.Agent._run).
    quiet = NodeSettings(
        "n1",
        "127.0.0.1:8000",
        capacity_tokens=100_000,
        period_s=0.05,
        heartbeat_s=60.0,
        idle_scrape_s=60.0,
        engine_stale_after_s=61.0,
    )

    async def scenario() -> None:
        async with running_agent(quiet) as (agent, address):
            c = client(address)
            stream = c.subscribe("test")
            try:
                assert (await stream.next()) is not None  # the first message
                ticks = agent.ticks
                await asyncio.sleep(0.5)  # ten periods of an idle node
                assert agent.ticks == ticks, "no tick before the idle interval"
                granted = await c.reserve("r1", 10_000, 60.0, "gate", PATIENCE_S)
                assert granted.granted
                async with asyncio.timeout(PATIENCE_S):
                    while (message := await stream.next()) is not None and message.reserved_tokens != 10_000:
                        pass
                assert (await c.release("r1", "gate", PATIENCE_S)).released
                async with asyncio.timeout(PATIENCE_S):
                    while (message := await stream.next()) is not None and message.reserved_tokens != 0:
                        pass
            finally:
                stream.cancel()
                await c.close()

    run(scenario)
