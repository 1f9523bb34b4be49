"""The gate's gRPC adapter to one agent: a Subscribe stream, Reserve, FirstToken, Release and Renew.

Reserve, FirstToken, Release and Renew go as messages on one Ledger stream (kvgate.headroom.ledger_stream),
at about half the CPU of a unary call on each side; to an agent without the Ledger method (older than
this gate, in a rolling upgrade) as unary calls, and the stream is tried again after
`LEDGER_RETRY_S`. gRPC failures become HeadroomError here; nothing above this module sees grpc's
exceptions.
The channel's own reconnect backoff is kept short so that the view's jittered backoff, not
gRPC's default of up to two minutes, decides how soon a restarted agent is found again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import grpc

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate._proto.headroom.v1 import headroom_pb2_grpc as pb_grpc
from kvgate.errors import AgentCallError
from kvgate.headroom.credentials import ChannelSecurity, open_channel
from kvgate.headroom.ledger_stream import LedgerStream, LedgerUnavailable
from kvgate.headroom.snapshot import (
    NO_PREFIXES,
    NodeHeadroom,
    PrefixChain,
    ReleaseOutcome,
    ReserveOutcome,
    TenantCharge,
)
from kvgate.headroom.wire import headroom_from_proto, release_from_proto, reserve_from_proto, reserve_request

# Ids per Renew call: 200 ids at the 256-byte limit of an id are about 52 KiB, inside the agent's 64 KiB
# request bound (a gate's own ids are about 50 bytes, so a call is about 10 KiB).
RENEW_BATCH = 200
# After an agent answered that it has no Ledger method, its calls are unary this long before the
# stream is tried again (it may have been upgraded meanwhile).
LEDGER_RETRY_S = 60.0


class HeadroomStream:
    def __init__(self, address: str, call: grpc.aio.UnaryStreamCall) -> None:
        self._address = address
        self._call = call
        self._prefix = NO_PREFIXES  # the last summary: its block set is reused while it is unchanged

    async def next(self) -> NodeHeadroom | None:
        """The next message; None when the agent ended the stream (it is shutting down)."""
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _error(self._address, "Subscribe", exc) from exc
        if message is grpc.aio.EOF:
            return None
        headroom = headroom_from_proto(message, self._prefix)
        self._prefix = headroom.prefix
        return headroom

    def cancel(self) -> None:
        self._call.cancel()


class AgentClient:
    def __init__(
        self,
        address: str,
        reconnect_initial_s: float,
        reconnect_max_s: float,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.address = address
        self._options = [
            ("grpc.initial_reconnect_backoff_ms", max(1, int(reconnect_initial_s * 1000))),
            ("grpc.min_reconnect_backoff_ms", max(1, int(reconnect_initial_s * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, int(reconnect_max_s * 1000))),
        ]
        self._security = security
        self._channel = open_channel(address, self._options, security)
        self._stub = pb_grpc.AgentStub(self._channel)  # type: ignore[no-untyped-call]
        self._ledger = LedgerStream(address, self._stub.Ledger)
        self._unary_until = -math.inf  # monotonic time until which the agent is called unary

    async def renew(self, grace_s: float) -> None:
        """Reconnect with the security's current credentials (rotated files).

        Calls made from now on use the new channel; calls in flight on the old one get `grace_s` to end
        before it closes. Streams are the caller's to reopen: the old channel's close cancels them.
        """
        old, old_ledger = self._channel, self._ledger
        self._channel = open_channel(self.address, self._options, self._security)
        self._stub = pb_grpc.AgentStub(self._channel)  # type: ignore[no-untyped-call]
        self._ledger = LedgerStream(self.address, self._stub.Ledger)
        await old.close(grace_s)
        await old_ledger.close()

    def subscribe(self, subscriber: str) -> HeadroomStream:
        return HeadroomStream(self.address, self._stub.Subscribe(pb.SubscribeRequest(subscriber=subscriber)))

    async def reserve(
        self,
        request_id: str,
        tokens: int,
        lease_s: float,
        holder: str,
        timeout_s: float,
        *,
        prefix: PrefixChain | None = None,
        output_tokens: int = 0,
        waiting_since_unix_ns: int = 0,
        rank: int = 0,
        fair_service: float = 0.0,
        hold_slot: bool = False,
        charge: TenantCharge | None = None,
        reports_first_token: bool = False,
    ) -> ReserveOutcome:
        request = reserve_request(
            request_id,
            tokens,
            lease_s,
            holder,
            prefix,
            output_tokens=output_tokens,
            waiting_since_unix_ns=waiting_since_unix_ns,
            rank=rank,
            fair_service=fair_service,
            hold_slot=hold_slot,
            charge=charge,
            reports_first_token=reports_first_token,
        )
        answer = await self._call("Reserve", pb.LedgerCall(reserve=request), timeout_s)
        return reserve_from_proto(answer.reserve)

    async def first_token(self, request_id: str, holder: str, timeout_s: float) -> bool:
        """Tell the agent the engine started answering `holder`'s request `request_id`: whether a
        reservation of that holder's took it."""
        request = pb.FirstTokenRequest(request_id=request_id, holder=holder)
        answer = await self._call("FirstToken", pb.LedgerCall(first_token=request), timeout_s)
        return answer.first_token.known

    async def release(
        self,
        request_id: str,
        holder: str,
        timeout_s: float,
        *,
        unanswered: bool = False,
        generated_tokens: int = 0,
    ) -> ReleaseOutcome:
        """End `holder`'s reservation `request_id`: the holder that reserved it, or it stays."""
        request = pb.ReleaseRequest(
            request_id=request_id,
            holder=holder,
            unanswered_reserve=unanswered,
            generated_tokens=generated_tokens,
        )
        answer = await self._call("Release", pb.LedgerCall(release=request), timeout_s)
        return release_from_proto(answer.release)

    async def renew_leases(
        self, request_ids: Sequence[str], holder: str, lease_s: float, timeout_s: float
    ) -> frozenset[str]:
        """Extend `holder`'s leases of `request_ids` on this agent: the ids it no longer holds (lapsed).
        One call per RENEW_BATCH ids: the agent takes requests of at most 64 KiB."""
        lapsed: set[str] = set()
        for start in range(0, len(request_ids), RENEW_BATCH):
            request = pb.RenewRequest(
                request_ids=request_ids[start : start + RENEW_BATCH], lease_s=lease_s, holder=holder
            )
            answer = await self._call("Renew", pb.LedgerCall(renew=request), timeout_s)
            lapsed.update(answer.renew.lapsed)
        return frozenset(lapsed)

    async def close(self) -> None:
        await self._ledger.close()
        await self._channel.close()

    async def _call(self, method: str, call: pb.LedgerCall, timeout_s: float) -> pb.LedgerAnswer:
        """`call` on the Ledger stream, or as the unary `method` to an agent without one."""
        if time.monotonic() >= self._unary_until:
            try:
                return await self._ledger.call(method, call, timeout_s)
            except LedgerUnavailable:
                self._unary_until = time.monotonic() + LEDGER_RETRY_S
        field = call.WhichOneof("call")
        unary: Callable[..., grpc.aio.UnaryUnaryCall] = getattr(self._stub, method)
        try:
            response = await unary(getattr(call, field), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(self.address, method, exc) from exc
        answer = pb.LedgerAnswer()
        getattr(answer, field).CopyFrom(response)
        return answer


def _error(address: str, method: str, exc: grpc.aio.AioRpcError) -> AgentCallError:
    return AgentCallError(f"agent {address}: {method} failed: {exc.code().name}: {exc.details()}")
