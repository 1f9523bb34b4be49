"""The gate's gRPC adapter to one agent: a Subscribe stream, Reserve and Release.

gRPC failures become HeadroomError here; nothing above this module sees grpc's exceptions.
The channel's own reconnect backoff is kept short so that the view's jittered backoff, not
gRPC's default of up to two minutes, decides how soon a restarted agent is found again.
"""

from __future__ import annotations

import grpc

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate._proto.headroom.v1 import headroom_pb2_grpc as pb_grpc
from kvgate.errors import AgentCallError
from kvgate.headroom.credentials import ChannelSecurity, open_channel
from kvgate.headroom.snapshot import NO_PREFIXES, NodeHeadroom, PrefixChain, ReleaseOutcome, ReserveOutcome
from kvgate.headroom.wire import headroom_from_proto, release_from_proto, reserve_from_proto, reserve_request


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

    async def renew(self, grace_s: float) -> None:
        """Reconnect with the security's current credentials (rotated files).

        Calls made from now on use the new channel; calls in flight on the old one get `grace_s` to end
        before it closes. Streams are the caller's to reopen: the old channel's close cancels them.
        """
        old = self._channel
        self._channel = open_channel(self.address, self._options, self._security)
        self._stub = pb_grpc.AgentStub(self._channel)  # type: ignore[no-untyped-call]
        await old.close(grace_s)

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
        hold_slot: bool = False,
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
            hold_slot=hold_slot,
        )
        try:
            response: pb.ReserveResponse = await self._stub.Reserve(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(self.address, "Reserve", exc) from exc
        return reserve_from_proto(response)

    async def release(
        self, request_id: str, holder: str, timeout_s: float, *, unanswered: bool = False
    ) -> ReleaseOutcome:
        """End `holder`'s reservation `request_id`: the holder that reserved it, or it stays."""
        request = pb.ReleaseRequest(request_id=request_id, holder=holder, unanswered_reserve=unanswered)
        try:
            response: pb.ReleaseResponse = await self._stub.Release(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(self.address, "Release", exc) from exc
        return release_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()


def _error(address: str, method: str, exc: grpc.aio.AioRpcError) -> AgentCallError:
    return AgentCallError(f"agent {address}: {method} failed: {exc.code().name}: {exc.details()}")
