"""Reserve, Release, Renew and FirstToken on one Ledger stream (kvgate.headroom.ledger_stream): answers
matched by id, one refused call among others, a stream that breaks or goes silent, an agent that has
no Ledger method."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from waiting import until_async

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate._proto.headroom.v1 import headroom_pb2_grpc as pb_grpc
from kvgate.agent.ledger import MAX_ID_BYTES
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.errors import AgentCallError
from kvgate.headroom import client as client_module
from kvgate.headroom.client import AgentClient
from kvgate.headroom.ledger_stream import LedgerStream


def client(address: str) -> AgentClient:
    return AgentClient(address, reconnect_initial_s=0.05, reconnect_max_s=0.2)


class _LedgerOnly(pb_grpc.AgentServicer):  # type: ignore[misc]
    """An agent with only the Ledger method (the unary calls are UNIMPLEMENTED), which answers the
    calls it has read once `batch` of them arrived, last first; or none while `silent`."""

    def __init__(self, batch: int = 1, silent: bool = False) -> None:
        self.batch = batch
        self.silent = silent
        self.streams = 0
        self.calls: list[pb.LedgerCall] = []

    async def Ledger(
        self, calls: AsyncIterator[pb.LedgerCall], context: Any
    ) -> AsyncIterator[pb.LedgerAnswer]:
        self.streams += 1
        held: list[pb.LedgerCall] = []
        async for call in calls:
            self.calls.append(call)
            if self.silent:
                continue
            held.append(call)
            if len(held) < self.batch:
                continue
            for answered in reversed(held):
                granted = answered.reserve.tokens <= 1_000
                yield pb.LedgerAnswer(id=answered.id, reserve=pb.ReserveResponse(granted=granted))
            held.clear()


class _UnaryOnly(pb_grpc.AgentServicer):  # type: ignore[misc]
    """An agent older than the Ledger method."""

    def __init__(self) -> None:
        self.reserves = 0

    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        self.reserves += 1
        return pb.ReserveResponse(granted=True, headroom_tokens=7)


async def serve(servicer: Any, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_AgentServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


@asynccontextmanager
async def calling(servicer: Any) -> AsyncIterator[AgentClient]:
    """A client of `servicer`, served on 127.0.0.1."""
    server, port = await serve(servicer)
    c = client(f"127.0.0.1:{port}")
    try:
        yield c
    finally:
        await c.close()
        await server.stop(0)


def run(scenario: Callable[[], Any]) -> None:
    asyncio.run(scenario())


def test_answers_that_come_back_in_another_order_reach_their_own_calls() -> None:
    async def scenario() -> None:
        servicer = _LedgerOnly(batch=4)
        async with calling(servicer) as c:
            sizes = [500, 5_000, 900, 2_000]
            outcomes = await asyncio.gather(
                *(c.reserve(f"r{i}", tokens, 60, "g", timeout_s=10) for i, tokens in enumerate(sizes))
            )
        assert [o.granted for o in outcomes] == [True, False, True, False]
        assert servicer.streams == 1, "every call on the one stream"
        assert len({call.id for call in servicer.calls}) == 4

    run(scenario)


def test_a_refused_call_fails_alone_and_the_stream_goes_on() -> None:
    async def scenario() -> None:
        agent = Agent(NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=40_000))
        port = await agent.start("127.0.0.1:0")
        c = client(f"127.0.0.1:{port}")
        try:
            assert (await c.reserve("first", 1_000, 60, "g", timeout_s=10)).granted
            with pytest.raises(AgentCallError, match=r"Reserve failed: INVALID_ARGUMENT: .*request_id"):
                await c.reserve("r" * (MAX_ID_BYTES + 1), 1_000, 60, "g", timeout_s=10)
            with pytest.raises(AgentCallError, match="Release failed: INVALID_ARGUMENT"):
                await c.release("first", "h" * (MAX_ID_BYTES + 1), timeout_s=10)
            assert (await c.reserve("second", 1_000, 60, "g", timeout_s=10)).granted
            assert (await c.release("first", "g", timeout_s=10)).released
            assert await c.renew_leases(["second", "gone"], "g", 60, timeout_s=10) == {"gone"}
            assert agent.state.ledger.reserved_tokens == 1_000
        finally:
            await c.close()
            await agent.stop(grace_s=0)

    run(scenario)


def test_a_call_left_unanswered_times_out_and_the_next_one_is_answered() -> None:
    async def scenario() -> None:
        servicer = _LedgerOnly(silent=True)
        async with calling(servicer) as c:
            with pytest.raises(AgentCallError, match="Reserve failed: DEADLINE_EXCEEDED"):
                await c.reserve("r1", 500, 60, "g", timeout_s=0.2)
            servicer.silent = False
            assert (await c.reserve("r2", 500, 60, "g", timeout_s=10)).granted
        assert servicer.streams == 1

    run(scenario)


def test_calls_in_flight_when_the_agent_goes_fail_and_the_next_call_reaches_its_successor() -> None:
    async def scenario() -> None:
        silent = _LedgerOnly(silent=True)
        server, port = await serve(silent)
        c = client(f"127.0.0.1:{port}")
        try:
            in_flight = asyncio.ensure_future(c.reserve("r1", 500, 60, "g", timeout_s=30))
            await until_async(lambda: silent.calls, "the call reached the agent")
            await server.stop(0)
            with pytest.raises(
                AgentCallError, match=r"agent 127\.0\.0\.1:\d+: Reserve failed: (UNAVAILABLE|CANCELLED)"
            ):
                await in_flight
            answering = _LedgerOnly()
            successor, _ = await serve(answering, port)
            try:
                assert (await c.reserve("r2", 500, 60, "g", timeout_s=10)).granted
                assert answering.streams == 1
            finally:
                await successor.stop(0)
        finally:
            await c.close()

    run(scenario)


def test_an_agent_without_the_ledger_method_is_called_unary() -> None:
    async def scenario() -> None:
        servicer = _UnaryOnly()
        async with calling(servicer) as c:
            for i in range(3):
                outcome = await c.reserve(f"r{i}", 500, 60, "g", timeout_s=10)
                assert outcome.granted and outcome.headroom_tokens == 7
        assert servicer.reserves == 3

    run(scenario)


class _UpgradedLater(_UnaryOnly):
    """An agent whose first Ledger stream is refused as an older agent's would be, and later ones answered."""

    def __init__(self) -> None:
        super().__init__()
        self.streams = 0

    async def Ledger(
        self, calls: AsyncIterator[pb.LedgerCall], context: Any
    ) -> AsyncIterator[pb.LedgerAnswer]:
        self.streams += 1
        if self.streams == 1:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        async for call in calls:
            yield pb.LedgerAnswer(id=call.id, reserve=pb.ReserveResponse(granted=True, headroom_tokens=9))


@pytest.mark.parametrize(("retry_s", "headroom"), [(0.0, 9), (3600.0, 7)])
def test_the_stream_is_tried_again_once_the_retry_time_has_passed(
    monkeypatch: pytest.MonkeyPatch, retry_s: float, headroom: int
) -> None:
    monkeypatch.setattr(client_module, "LEDGER_RETRY_S", retry_s)

    async def scenario() -> None:
        servicer = _UpgradedLater()
        async with calling(servicer) as c:
            assert (await c.reserve("r1", 500, 60, "g", timeout_s=10)).headroom_tokens == 7, "unary"
            assert (await c.reserve("r2", 500, 60, "g", timeout_s=10)).headroom_tokens == headroom

    run(scenario)


class _FailingCall:
    """A Ledger call whose connection fails while a call is being written: its reader sees the
    failure first and ends the stream, then the write fails too."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    @staticmethod
    def _failure() -> grpc.aio.AioRpcError:
        metadata = grpc.aio.Metadata()
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, metadata, metadata, "Socket closed")

    async def read(self) -> pb.LedgerAnswer:
        raise self._failure()

    async def write(self, call: pb.LedgerCall) -> None:
        await self.cancelled.wait()
        raise self._failure()

    def cancel(self) -> None:
        self.cancelled.set()


def test_a_call_whose_write_fails_after_its_stream_ended_leaves_no_failure_unretrieved() -> None:
    """Seen at the end of a fresh clone's .ci/run: "Future exception was never retrieved", the stream's end
    failing the answer of a call that had itself failed on its write."""

    async def scenario() -> list[dict[str, Any]]:
        reported: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
        stream = LedgerStream("agent:9100", _FailingCall)
        failed = False
        try:
            await stream.call("Reserve", pb.LedgerCall(), 5.0)
        except AgentCallError as error:
            failed = "UNAVAILABLE" in str(error)
        assert failed
        await stream.close()
        gc.collect()
        return reported

    assert asyncio.run(scenario()) == []
