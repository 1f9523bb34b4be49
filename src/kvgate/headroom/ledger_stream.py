"""Reserve, Release, Renew and FirstToken to one agent as messages on one long-lived Ledger stream.

The three calls of a long request (Reserve, FirstToken, Release) cost the agent about 1.7 ms of CPU
and the caller 1.1 ms as unary calls, and 0.75 and 0.8 ms as messages on an open stream
(`python -m bench agent`; docs/operations.md, "Reserve and Release on one stream").

Each call is a `LedgerCall` with an id of this stream's; the agent answers calls in the order sent,
each with its id, so a reader task hands every answer to the call waiting for it. What a unary call
would do, a call here does too:
- a call gets no answer within its timeout: `AgentCallError` with DEADLINE_EXCEEDED (the answer, if it
  comes later, is dropped);
- the stream breaks (the agent died, was stopped, the connection dropped): every call in flight on it
  fails with `AgentCallError`, and the next call opens a new stream;
- the agent refused one call (a `CallError`): that call fails with its code, and the stream goes on.
An agent older than the Ledger method answers UNIMPLEMENTED: `LedgerUnavailable`, and the caller
uses the unary calls (kvgate.headroom.client).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable

import grpc

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.errors import AgentCallError

ENDED = "UNAVAILABLE: stream ended"


class LedgerUnavailable(Exception):
    """The agent has no Ledger method (it predates it): use the unary calls."""


class _StreamEnded(Exception):
    """The stream a call was on ended: its status, as "CODE: details"."""


class LedgerStream:
    def __init__(self, address: str, open_stream: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        """`open_stream`: a new Ledger call on the agent's channel."""
        self._address = address
        self._open_stream = open_stream
        self._open: _Open | None = None
        self._ids = itertools.count(1)

    async def call(self, method: str, call: pb.LedgerCall, timeout_s: float) -> pb.LedgerAnswer:
        """`call` (its id is set here) answered; AgentCallError naming `method` when it is not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        stream = self._open
        if stream is None or stream.ended:
            stream = self._open = _Open(self._open_stream())
        call.id = next(self._ids)
        answer: asyncio.Future[pb.LedgerAnswer] = loop.create_future()
        stream.waiting[call.id] = answer
        written = False
        try:
            async with asyncio.timeout_at(deadline):
                async with stream.writing:
                    await stream.call.write(call)
                written = True
                result = await answer
        except TimeoutError:
            if not written:
                # Cut off halfway through a write (the agent stopped reading): gRPC may still be
                # sending it, and a second write on this call would fail. The next call opens a new one.
                stream.end(_StreamEnded("DEADLINE_EXCEEDED: a write took longer than its call's timeout"))
            raise self._failed(method, f"DEADLINE_EXCEEDED: no answer within {timeout_s}s") from None
        except grpc.aio.AioRpcError as exc:
            failure = _status(exc)
            stream.end(failure)
            if isinstance(failure, LedgerUnavailable):
                raise failure from exc
            raise self._failed(method, str(failure)) from exc
        except asyncio.InvalidStateError:
            # The stream ended before this write; its reader fails what was in flight.
            stream.end(_StreamEnded(ENDED))
            raise self._failed(method, ENDED) from None
        except _StreamEnded as ended:
            raise self._failed(method, str(ended)) from None
        finally:
            stream.waiting.pop(call.id, None)
            if answer.done() and not answer.cancelled():
                # The stream's end may have failed this answer while the call failed on another path
                # (its write): the same failure, raised above. Seen, or asyncio logs it when collected.
                answer.exception()
        if result.WhichOneof("answer") == "error":
            raise self._failed(method, f"{result.error.code}: {result.error.message}")
        return result

    async def close(self) -> None:
        """End the stream; calls in flight fail."""
        stream, self._open = self._open, None
        if stream is not None:
            await stream.close()

    def _failed(self, method: str, why: str) -> AgentCallError:
        return AgentCallError(f"agent {self._address}: {method} failed: {why}")


class _Open:
    """One Ledger call and the calls in flight on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.waiting: dict[int, asyncio.Future[pb.LedgerAnswer]] = {}
        # gRPC takes one message at a time on a call: a second write while one is being sent fails.
        self.writing = asyncio.Lock()
        self.ended = False
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def close(self) -> None:
        self.end(_StreamEnded("CANCELLED: closed"))
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _read(self) -> None:
        try:
            while True:
                answer = await self.call.read()
                if answer is grpc.aio.EOF:
                    self.end(_StreamEnded(ENDED))
                    return
                waiting = self.waiting.get(answer.id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        except grpc.aio.AioRpcError as exc:
            self.end(_status(exc))

    def end(self, failure: _StreamEnded | LedgerUnavailable) -> None:
        """Take no more calls, and fail those in flight with `failure`. (A call cancelled here ends its
        reader with CancelledError, not a status: hence the failing here.)"""
        self.ended = True
        self.call.cancel()
        for waiting in self.waiting.values():
            if not waiting.done():
                waiting.set_exception(failure)


def _status(exc: grpc.aio.AioRpcError) -> _StreamEnded | LedgerUnavailable:
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return LedgerUnavailable()
    return _StreamEnded(f"{exc.code().name}: {exc.details()}")
