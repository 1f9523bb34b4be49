"""The agent's gRPC adapter: a sampling loop on a fixed cadence, the Agent service and gRPC health.

Every period the loop scrapes the engine's metrics when due (every period under pressure, else every
--idle-scrape-ms: kvgate.agent.cadence; bounded by the scraper's timeout, half the period), takes
NVML's latest reading (sampled on its own thread, see nvml.NvmlPoller) and the engine's KV-event
batches received since the last period (on their own thread, see kv_events.KvEventFeed), folds them
into the NodeState, and pushes the NodeHeadroom to every subscriber when something a gate uses
changed, or a heartbeat has passed (kvgate.agent.push; every period with --heartbeat-ms 0).
Ticks are scheduled on absolute deadlines so a slow sample delays one push, not all that follow.
Reserve and Release run on the same event loop as the ledger and never await between check and
charge: that is what makes this agent the single authority for its node. Each is a unary call or a
message on a caller's Ledger stream (what gates send: half the CPU a call), answered by the same code.

Who holds a reservation is decided here: with client certificates required (mTLS), the caller's
certificate identity, which no caller can claim for itself; otherwise the `holder` it sends. Callers
are bounded: ids and holders of at most 256 bytes (kvgate.agent.ledger), subscriber names of 128, and
request messages of 64 KiB, past which gRPC refuses them before they are decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate._proto.headroom.v1 import headroom_pb2_grpc as pb_grpc
from kvgate.agent.cadence import ScrapeCadence
from kvgate.agent.kv_events import Batch
from kvgate.agent.ledger import MAX_ID_BYTES
from kvgate.agent.metrics import AgentMetrics
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.sources.engines import EngineReading
from kvgate.agent.subscribers import Latest, Subscribers
from kvgate.errors import HeadroomError
from kvgate.headroom.credentials import add_port
from kvgate.headroom.snapshot import LedgerFigures, NodeHeadroom, NvmlReading, ReserveReason
from kvgate.headroom.wire import (
    HeadroomEncoder,
    chain_from_proto,
    charge_from_proto,
    release_to_proto,
    reserve_to_proto,
)
from kvgate.tls import ServerTls, describe

log = logging.getLogger(__name__)

SERVICE_NAME = "kvgate.headroom.v1.Agent"
# NVML init can take seconds on a big node; the first push waits for it this long at most.
NVML_FIRST_READING_S = 10.0
# The largest request message taken (grpc.max_receive_message_length; gRPC's default is 4 MiB): a
# Reserve is about 600 bytes plus 8 per prefix block, and the gate sends at most placement.max_blocks
# (8,000 at most: 64 KiB) of them. Larger ones get RESOURCE_EXHAUSTED before they are decoded.
MAX_MESSAGE_BYTES = 64 * 1024
MAX_SUBSCRIBER_BYTES = 128
_Request = TypeVar("_Request", bound=Message)
_Answer = TypeVar("_Answer", bound=Message)


class EngineSource(Protocol):
    """Bounds its own call (the scraper's timeout); failures, a timeout included, raise HeadroomError."""

    async def sample(self) -> EngineReading: ...
    async def close(self) -> None: ...


class KvEventSource(Protocol):
    """Never blocks: the batches received since the last call (received on its own thread)."""

    def start(self) -> None: ...
    def drain(self) -> list[Batch]: ...
    def close(self) -> None: ...


class NvmlSource(Protocol):
    """Never blocks: the latest reading, sampled elsewhere (NvmlPoller's thread)."""

    def latest(self) -> NvmlReading: ...
    def wait_first(self, timeout_s: float) -> bool: ...
    def close(self) -> None: ...


class Agent:
    def __init__(
        self,
        settings: NodeSettings,
        engine: EngineSource | None = None,
        nvml: NvmlSource | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        kv_events: KvEventSource | None = None,
    ) -> None:
        self.settings = settings
        self.state = NodeState(settings, clock, uses_engine=engine is not None, uses_nvml=nvml is not None)
        # Who follows the stream; a message is encoded once, whatever the number it goes to.
        self.stream = Subscribers(settings.period_s, settings.heartbeat_s)
        self._encoder = HeadroomEncoder()
        self._engine = engine
        self._nvml = nvml
        self._kv_events = kv_events
        self._wall_clock_ns = wall_clock_ns
        self._health = health_aio.HealthServicer()
        self._healthy: bool | None = None
        self._server: grpc.aio.Server | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._latest: NodeHeadroom | None = None
        self._latest_at = 0.0
        self._clock = clock
        self._cadence = ScrapeCadence(settings.period_s, settings.idle_scrape_s or settings.period_s)
        # Set by a Reserve or Release that may have changed what the stream shows: the next tick comes
        # early (see _run).
        self.changed = asyncio.Event()
        self.ticks = 0  # samples taken so far (the loop's pace, for tests and operators' debugging)
        self.metrics = AgentMetrics(
            lambda: self._latest,
            lambda: self.state.prefix_forgotten,
            self.state.class_usage.figures,
            settings.lending.prefill_tokens_per_s,
            ratio_steps=lambda: self.state.ratio.steps,
            holders=self.state.ledger.largest_holders,
            chat_reserve=self.state.lending.reserve_parts if self.state.lending is not None else None,
        )

    async def start(self, listen: str, tls: ServerTls | None = None) -> int:
        """Serve on `listen` (host:port, port 0 picks one) and start sampling; returns the bound port.

        Plaintext without `tls`. With `tls.client_ca`, only clients holding a certificate from that CA
        get past the handshake, so no unauthenticated gate can Reserve, Release or even Subscribe.
        """
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # gRPC's default shares the port with any other process that asks: a second agent would
            # grant from a ledger of its own (kvgate.listening).
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        authenticated = tls is not None and tls.client_ca is not None
        _add_agent_service(_AgentServicer(self, authenticated), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = add_port(server, listen, "--listen", tls, "agent TLS")
        await server.start()
        self._server = server
        if self._kv_events is not None:
            await asyncio.to_thread(self._kv_events.start)
        if self._nvml is not None and not await asyncio.to_thread(
            self._nvml.wait_first, NVML_FIRST_READING_S
        ):
            log.warning(
                "no NVML reading after %.0fs; the node reports unhealthy until one arrives",
                NVML_FIRST_READING_S,
            )
        await self.tick()
        self._loop_task = asyncio.create_task(self._run(), name="kvgate-agent-sampling")
        log.info(
            "agent %s serving on port %d (%s), engine endpoint %s",
            self.settings.node,
            port,
            describe(tls),
            self.settings.endpoint,
        )
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        await self._health.enter_graceful_shutdown()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self.stream.close()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._engine is not None:
            await self._engine.close()
        if self._nvml is not None:
            self._nvml.close()
        if self._kv_events is not None:
            await asyncio.to_thread(self._kv_events.close)

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def tick(self) -> NodeHeadroom:
        """Sample every source once (the engine when due), publish the result to subscribers when it is
        worth a message, and return it."""
        self.ticks += 1
        scrape = self._cadence.due(self._clock(), self._latest, self.state.waited_at)
        if self._engine is not None and scrape:
            await self._sample_engine()
        if self._nvml is not None:
            self.state.observe_nvml(self._nvml.latest())
        if self._kv_events is not None:
            self.state.observe_kv_events(self._kv_events.drain())
        for lapsed in self.state.expire():
            self.metrics.expired()
            # A lease that runs out means a gate never released: a lost end-of-request signal.
            log.warning(
                "reservation %s (%d tokens) of %r expired unreleased",
                lapsed.request_id,
                lapsed.tokens,
                lapsed.holder,
            )
        headroom = self.state.snapshot(self._wall_clock_ns())
        now = self._clock()
        self._latest, self._latest_at = headroom, now
        for cause in self.stream.offer(headroom, now, self._encoder.encode):
            self.metrics.sent(cause)
        if headroom.healthy != self._healthy:
            self._healthy = headroom.healthy
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if headroom.healthy
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await self._health.set(SERVICE_NAME, status)
            log.info(
                "node %s is %s %s",
                headroom.node,
                "healthy" if headroom.healthy else "unhealthy",
                headroom.reason,
            )
        return headroom

    def latest(self) -> Latest:
        """The last sample, its message and when it was taken: what a new subscriber gets at once."""
        if self._latest is None:
            return None
        return self._latest, self._encoder.encode(self._latest), self._latest_at

    def answered(self, holder: str, figures: LedgerFigures | None) -> None:
        """A Reserve or Release of `holder` was answered with `figures`: its own subscription knows them
        now, and the next tick comes early only when another subscriber has yet to hear of them."""
        if figures is None or self.stream.told(holder, figures, self._clock()):
            self.changed.set()

    async def _run(self) -> None:
        """Tick every period while the node is under pressure (kvgate.agent.cadence), every idle
        interval otherwise; a Reserve or Release that changed the ledger brings the next tick forward,
        no sooner than a period after the last, so its message goes out within a period. An idle agent
        used to build and weigh a message ten times a second for nothing (issue 28: 8 ms of CPU a
        second per agent, most of the fixed routing CPU of the Mooncake replay)."""
        loop = asyncio.get_running_loop()
        period = self.settings.period_s
        while True:
            last = loop.time()
            self.changed.clear()
            await self.tick()
            quiet_s = (
                self._cadence.tick_interval_s(self._clock(), self._latest, self.state.waited_at)
                if self.settings.heartbeat_s
                else period  # heartbeat 0: a message every period, as agents sent before
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=max(0.0, last + quiet_s - loop.time()))
            await asyncio.sleep(max(0.0, last + period - loop.time()))

    async def _sample_engine(self) -> None:
        """One scrape; the scraper's own timeout (half the period) bounds it."""
        assert self._engine is not None
        self._cadence.scraped(self._clock())
        self.metrics.scraped()
        try:
            reading = await self._engine.sample()
        except HeadroomError as exc:
            self.state.engine_failed(str(exc))
        else:
            self.state.observe_engine(reading)


class _AgentServicer(pb_grpc.AgentServicer):
    def __init__(self, agent: Agent, authenticated: bool) -> None:
        self._agent = agent
        # Client certificates are required: a caller's identity is its certificate's.
        self._authenticated = authenticated
        # A Ledger message's call, by its field name, to what answers it.
        self._ledger_calls: dict[str, Callable[[Any, str], Message]] = {
            "reserve": self._reserve,
            "release": self._release,
            "renew": self._renew,
            "first_token": self._first_token,
        }

    async def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if len(request.subscriber.encode()) > MAX_SUBSCRIBER_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"subscriber is longer than {MAX_SUBSCRIBER_BYTES} bytes"
            )
        log.info("subscriber %r (%s) connected", request.subscriber, context.peer())
        # Known as whom its calls are made as (see kvgate.agent.subscribers).
        holder = await self._identity(context) or request.subscriber
        async for message in self._agent.stream.listen(holder, self._agent.latest()):
            yield message

    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        holder = await self._holder(request.holder, context)
        return await _or_abort(context, self._reserve, request, holder)

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        holder = await self._holder(request.holder, context)
        return await _or_abort(context, self._release, request, holder)

    async def FirstToken(
        self, request: pb.FirstTokenRequest, context: grpc.aio.ServicerContext
    ) -> pb.FirstTokenResponse:
        holder = await self._holder(request.holder, context)
        return await _or_abort(context, self._first_token, request, holder)

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.RenewResponse:
        holder = await self._holder(request.holder, context)
        return await _or_abort(context, self._renew, request, holder)

    async def Ledger(
        self, calls: AsyncIterator[pb.LedgerCall], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LedgerAnswer]:
        """The four calls above as messages on one stream, answered in order (see the proto). Each is
        answered before the next is read, and none awaits between check and charge."""
        identity = await self._identity(context)
        async for call in calls:
            kind = call.WhichOneof("call")
            if kind is None:
                yield _refused(call.id, grpc.StatusCode.INVALID_ARGUMENT, "a LedgerCall names no call")
                continue
            request = getattr(call, kind)
            handle = self._ledger_calls[kind]
            try:
                answer = pb.LedgerAnswer(id=call.id, **{kind: handle(request, identity or request.holder)})
            except ValueError as exc:
                answer = _refused(call.id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            yield answer

    def _reserve(self, request: pb.ReserveRequest, holder: str) -> pb.ReserveResponse:
        outcome = self._agent.state.reserve(
            request.request_id,
            request.tokens,
            request.lease_s,
            holder,
            prefix=chain_from_proto(request),
            output_tokens=request.output_tokens,
            waiting_since_unix_ns=request.waiting_since_unix_ns,
            rank=request.rank,
            fair_service=request.fair_service,
            hold_slot=request.hold_slot,
            charge=charge_from_proto(request),
            reports_first_token=request.reports_first_token,
        )
        self._agent.metrics.reserve(outcome.granted, outcome.reason)
        self._agent.answered(holder, outcome.after)
        if outcome.reason == ReserveReason.GRANTED and request.prefix_blocks:
            self._agent.metrics.prefix_granted(outcome.cached_tokens, request.tokens - outcome.charged_tokens)
        log.debug(
            "reserve %s %d tokens (%d charged, %d cached) by %r (%s): %s",
            request.request_id,
            request.tokens,
            outcome.charged_tokens,
            outcome.cached_tokens,
            holder,
            request.holder,
            outcome.reason,
        )
        return reserve_to_proto(outcome)

    def _release(self, request: pb.ReleaseRequest, holder: str) -> pb.ReleaseResponse:
        outcome = self._agent.state.release(
            request.request_id,
            holder,
            unanswered_reserve=request.unanswered_reserve,
            generated_tokens=request.generated_tokens,
        )
        if outcome.released:
            self._agent.metrics.released(told_generated=request.generated_tokens > 0)
        self._agent.answered(holder, outcome.after)
        return release_to_proto(outcome)

    def _first_token(self, request: pb.FirstTokenRequest, holder: str) -> pb.FirstTokenResponse:
        known = self._agent.state.first_token(request.request_id, holder)
        self._agent.metrics.first_token(known)
        if known:
            self._agent.changed.set()
        return pb.FirstTokenResponse(known=known)

    def _renew(self, request: pb.RenewRequest, holder: str) -> pb.RenewResponse:
        lapsed, lease_s = self._agent.state.renew(request.request_ids, holder, request.lease_s)
        self._agent.metrics.renewed(len(request.request_ids) - len(lapsed), len(lapsed))
        if lapsed:
            # Not always a fault: a Release that overtook the renewal leaves its id here too.
            log.info(
                "renewal by %r: %d of %d reservations not held (lapsed, or released on the way)",
                holder,
                len(lapsed),
                len(request.request_ids),
            )
        return pb.RenewResponse(lapsed=lapsed, lease_s=lease_s)

    async def _holder(self, claimed: str, context: grpc.aio.ServicerContext) -> str:
        """Who the caller holds reservations as: its certificate's identity under mTLS (what it
        claims is then only logged), else what it claims (the ledger bounds its length)."""
        return await self._identity(context) or claimed

    async def _identity(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's certificate identity under mTLS; None without."""
        if not self._authenticated:
            return None
        identities = context.peer_identities()
        if not identities:
            # The handshake required a certificate, so this is not expected to happen.
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no client certificate identity")
            raise AssertionError("abort returns by raising")
        return _bounded(identities[0].decode("utf-8", "replace"))


async def _or_abort(
    context: grpc.aio.ServicerContext,
    handle: Callable[[_Request, str], _Answer],
    request: _Request,
    holder: str,
) -> _Answer:
    """`handle`'s answer; a request it refuses (ValueError) ends the unary call with INVALID_ARGUMENT."""
    try:
        return handle(request, holder)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("abort returns by raising") from exc


def _refused(call_id: int, code: grpc.StatusCode, message: str) -> pb.LedgerAnswer:
    return pb.LedgerAnswer(id=call_id, error=pb.CallError(code=code.name, message=message))


def _bounded(identity: str) -> str:
    """A certificate identity as a holder: as it is, or, past MAX_ID_BYTES (a long URI SAN), its
    SHA-256, which names the same certificate identity just as well."""
    if len(identity.encode()) <= MAX_ID_BYTES:
        return identity
    return "sha256:" + hashlib.sha256(identity.encode()).hexdigest()


def _add_agent_service(servicer: _AgentServicer, server: grpc.aio.Server) -> None:
    """What the generated add_AgentServicer_to_server does, except that Subscribe's messages go out as
    the bytes they already are (see Agent.stream)."""
    handlers = {
        "Subscribe": grpc.unary_stream_rpc_method_handler(
            servicer.Subscribe, request_deserializer=pb.SubscribeRequest.FromString
        ),
        "Reserve": grpc.unary_unary_rpc_method_handler(
            servicer.Reserve,
            request_deserializer=pb.ReserveRequest.FromString,
            response_serializer=pb.ReserveResponse.SerializeToString,
        ),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release,
            request_deserializer=pb.ReleaseRequest.FromString,
            response_serializer=pb.ReleaseResponse.SerializeToString,
        ),
        "FirstToken": grpc.unary_unary_rpc_method_handler(
            servicer.FirstToken,
            request_deserializer=pb.FirstTokenRequest.FromString,
            response_serializer=pb.FirstTokenResponse.SerializeToString,
        ),
        "Renew": grpc.unary_unary_rpc_method_handler(
            servicer.Renew,
            request_deserializer=pb.RenewRequest.FromString,
            response_serializer=pb.RenewResponse.SerializeToString,
        ),
        "Ledger": grpc.stream_stream_rpc_method_handler(
            servicer.Ledger,
            request_deserializer=pb.LedgerCall.FromString,
            response_serializer=pb.LedgerAnswer.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
