"""The agent bounds its callers (issue 27, "the agent trusts every caller").

Over gRPC, against a real agent server: ids and holders of more than 256 bytes and subscriber names of
more than 128 are INVALID_ARGUMENT; a message past 64 KiB (a 3 MiB id) is RESOURCE_EXHAUSTED before it
is decoded; no lease outlives 900 s by default; one holder's reservations are capped
(--max-holder-tokens, holder_cap). In the ledger, the memory of early releases stays bounded in bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate._proto.headroom.v1 import headroom_pb2_grpc as pb_grpc
from kvgate.agent.cli import register, settings_from_args
from kvgate.agent.ledger import EARLY_RELEASES_KEPT, MAX_ID_BYTES, Budget, ReservationLedger
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.config import parse_config
from kvgate.errors import ConfigError
from kvgate.headroom.snapshot import ReserveReason

MiB = 1024 * 1024
LONG_ID = "x" * (3 * MiB)


@asynccontextmanager
async def agent_stub(**settings: Any) -> AsyncIterator[tuple[Agent, pb_grpc.AgentStub]]:
    values: dict[str, Any] = {"capacity_tokens": 100_000, "safety_ratio": 1.0} | settings
    agent = Agent(NodeSettings("n1", "127.0.0.1:8000", **values))
    port = await agent.start("127.0.0.1:0")
    # The client's own limits must not be what refuses: it sends and takes anything.
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    try:
        yield agent, pb_grpc.AgentStub(channel)  # type: ignore[no-untyped-call]
    finally:
        await channel.close()
        await agent.stop(grace_s=0.1)


async def status_of(call: Awaitable[object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    code: grpc.StatusCode = refused.value.code()
    return code


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def test_a_3_mib_id_is_refused_before_it_is_read() -> None:
    async def scenario() -> None:
        async with agent_stub() as (agent, stub):
            reserve = pb.ReserveRequest(request_id=LONG_ID, tokens=1_000, holder="g")
            assert await status_of(stub.Reserve(reserve, timeout=10)) is grpc.StatusCode.RESOURCE_EXHAUSTED
            for unanswered in (False, True):
                release = pb.ReleaseRequest(request_id=LONG_ID, holder="g", unanswered_reserve=unanswered)
                code = await status_of(stub.Release(release, timeout=10))
                assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert agent.state.ledger.reserved_tokens == 0
            assert not agent.state.ledger._released_early, "nothing of it is remembered"

    run(scenario)


def test_ids_holders_and_subscribers_past_their_bounds_are_invalid_arguments() -> None:
    too_long = "é" * (MAX_ID_BYTES // 2 + 1)  # 129 characters, 258 bytes
    fits = "i" * MAX_ID_BYTES

    async def scenario() -> None:
        async with agent_stub() as (agent, stub):
            for request_id, holder in ((too_long, "g"), ("r1", too_long)):
                reserve = pb.ReserveRequest(request_id=request_id, tokens=1_000, holder=holder)
                assert await status_of(stub.Reserve(reserve)) is grpc.StatusCode.INVALID_ARGUMENT
                release = pb.ReleaseRequest(request_id=request_id, holder=holder, unanswered_reserve=True)
                assert await status_of(stub.Release(release)) is grpc.StatusCode.INVALID_ARGUMENT
            granted = await stub.Reserve(pb.ReserveRequest(request_id=fits, tokens=1_000, holder=fits))
            assert granted.granted
            assert (await stub.Release(pb.ReleaseRequest(request_id=fits, holder=fits))).released
            stream = stub.Subscribe(pb.SubscribeRequest(subscriber="s" * 129))
            assert await status_of(stream.read()) is grpc.StatusCode.INVALID_ARGUMENT
            first = await stub.Subscribe(pb.SubscribeRequest(subscriber="s" * 128)).read()
            assert first.node == "n1"
            assert agent.state.ledger.reserved_tokens == 0

    run(scenario)


def test_a_reserve_past_the_holder_cap_is_refused() -> None:
    async def scenario() -> None:
        async with agent_stub(max_holder_tokens=30_000) as (agent, stub):

            async def reserve(request_id: str, holder: str) -> pb.ReserveResponse:
                request = pb.ReserveRequest(request_id=request_id, tokens=12_000, holder=holder)
                answer: pb.ReserveResponse = await stub.Reserve(request)
                return answer

            assert (await reserve("a1", "hog")).granted and (await reserve("a2", "hog")).granted
            capped = await reserve("a3", "hog")
            assert not capped.granted and capped.reason == ReserveReason.HOLDER_CAP
            assert capped.headroom_tokens == 76_000, "the node had room: the holder had its share"
            assert (await reserve("b1", "gate")).granted, "another holder still gets room"
            await stub.Release(pb.ReleaseRequest(request_id="a1", holder="hog"))
            assert (await reserve("a3", "hog")).granted, "a release makes room within the cap again"
            assert agent.state.ledger.held_by("hog") == 24_000

    run(scenario)


def test_no_lease_outlives_900_s_by_default() -> None:
    async def scenario() -> None:
        async with agent_stub() as (_, stub):
            hog = await stub.Reserve(pb.ReserveRequest(request_id="hog", tokens=1_000, lease_s=1e9))
            assert hog.granted and hog.lease_s == 900

    run(scenario)


def test_a_reserve_larger_than_64_kib_is_refused_and_the_gates_largest_is_taken() -> None:
    config = parse_config("placement: {max_blocks: 8000}\n")
    blocks = config.placement.max_blocks

    async def scenario() -> None:
        async with agent_stub() as (_, stub):
            largest = pb.ReserveRequest(
                request_id="r" * MAX_ID_BYTES, tokens=blocks * 4, holder="h" * MAX_ID_BYTES
            )
            largest.prefix_blocks.extend(range(2**63, 2**63 + blocks))
            largest.prefix_block_tokens = 4
            assert (await stub.Reserve(largest)).granted
            # The gate sends it as a message of its Ledger stream, a few bytes larger.
            ledger = stub.Ledger()
            largest.request_id = "s" * MAX_ID_BYTES
            await ledger.write(pb.LedgerCall(id=2**64 - 1, reserve=largest))
            answer = await ledger.read()
            assert answer.id == 2**64 - 1 and answer.reserve.granted
            ledger.cancel()
            larger = pb.ReserveRequest(request_id="big", tokens=9_000 * 4)
            larger.prefix_blocks.extend(range(9_000))
            larger.prefix_block_tokens = 4
            assert await status_of(stub.Reserve(larger)) is grpc.StatusCode.RESOURCE_EXHAUSTED
            # On a Ledger stream, a message past the bound ends the stream, not only its call.
            ledger = stub.Ledger()
            await ledger.write(pb.LedgerCall(id=3, reserve=larger))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await ledger.read()
            assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    run(scenario)
    with pytest.raises(ConfigError, match=r"placement\.max_blocks: must be <= 8000"):
        parse_config("placement: {max_blocks: 8001}\n")


def test_the_early_release_memory_is_bounded_in_bytes() -> None:
    ledger = ReservationLedger(lambda: 0.0, 60, 600)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(EARLY_RELEASES_KEPT * 2):
            request_id = f"{i:0{MAX_ID_BYTES}d}"
            ledger.release(request_id, "h" * (MAX_ID_BYTES - 10) + f"{i:010d}", unanswered_reserve=True)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(ledger._released_early) == EARLY_RELEASES_KEPT
    assert grown < 12 * MiB, grown
    with pytest.raises(ValueError, match="longer than 256 bytes"):
        ledger.release("x" * (MAX_ID_BYTES + 1), "g", unanswered_reserve=True)
    budget = Budget(10_000, 1.0, None, True)
    with pytest.raises(ValueError, match="holder is longer"):
        ledger.reserve("r", 1, 0, budget, "h" * (MAX_ID_BYTES + 1))


def test_the_agent_flags_default_to_the_bounds() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["agent", "--listen", "127.0.0.1:0", "--endpoint", "127.0.0.1:8000", "--capacity-tokens", "1"]
    defaults = settings_from_args(parser.parse_args(base))
    assert (defaults.max_lease_s, defaults.max_holder_tokens) == (900, 1 << 20)
    capped = settings_from_args(parser.parse_args([*base, "--max-holder-tokens", "50000"]))
    assert capped.max_holder_tokens == 50_000
    with pytest.raises(ConfigError, match="--max-holder-tokens must be > 0"):
        settings_from_args(parser.parse_args([*base, "--max-holder-tokens", "0"]))
