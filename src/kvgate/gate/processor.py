"""The ext_proc adapter: Envoy's ProcessingRequest stream in, ProcessingResponses out.

Two Envoy set-ups are understood, told apart by the first message of a stream:
- two round trips (`envoy/envoy.yaml`): request headers SEND, body BUFFERED. The stream sees the
  headers, then (for requests that have one) the whole body in one message; the answer's headers
  choose the route.
- one round trip (`envoy/envoy-one-trip.yaml`): headers SKIPPED, body BUFFERED, and the few headers
  the gate reads sent along with the body as `request_attributes` (CEL expressions such as
  `request.headers['content-type']`). Envoy has already passed the headers on, so the answer's
  header mutation is not applied: routes match the dynamic metadata instead, and Envoy copies it
  into the upstream headers. One gRPC message each way instead of two: 12-22% less CPU per
  request in the gate (`python -m bench gate`).
Everything between the messages and the answer is the Pipeline's business; this module only
translates, uses nothing of the gate past the Pipeline (the seam is one-way: kvgate.gate.pipeline), and
is the stream's one error boundary: an exception never reaches Envoy (which, failing
open, would send the request on un-admitted). A RequestError is the client's and gets its refusal
(400 invalid_request and kin); anything else is answered with the refusal table's internal_error row
(503, Retry-After), logged once with the request id and counted (kvgate_gate_internal_errors_total),
and the stream ends there, its reservation, if any, released.

A body whose answer takes long (a long request waiting for room) is held: the gate asks Envoy for more
time before Envoy's message_timeout runs out (kvgate.gate.holding).

A stream lives as long as the gate needs it: one whose request holds a reservation until Envoy ends it
with the HTTP request (that end releases the reservation); any other ends once the request is
answered (`_done_with`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeadersResponse,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from opentelemetry.util.types import AttributeValue

from kvgate.config import Config
from kvgate.errors import RequestError
from kvgate.gate import responses
from kvgate.gate.holding import holding
from kvgate.gate.pipeline import (
    Learns,
    Outcome,
    Pipeline,
    RequestHead,
    Reserved,
    headers_read,
    request_head,
)
from kvgate.names import HEADER_PREFIX, META_PREFIX_HIT_TOKENS, META_RESERVED_TOKENS
from kvgate.policy import Decision, Reason, Refusal, Route
from kvgate.policy.refusals import INTERNAL_ERROR, Refusals, refusal_for
from kvgate.policy.route import NO_ROUTE_POLICY, RoutePolicy
from kvgate.request import Api, Body
from kvgate.telemetry import DecisionSpans, GateMetrics

log = logging.getLogger(__name__)

_PASS_THROUGH = {
    "response_headers": ProcessingResponse(response_headers=HeadersResponse()),
    "response_body": ProcessingResponse(response_body=BodyResponse()),
    "request_trailers": ProcessingResponse(request_trailers=TrailersResponse()),
    "response_trailers": ProcessingResponse(response_trailers=TrailersResponse()),
}


class RequestStream:
    """Per-request state between the headers and the body message."""

    __slots__ = (
        "answered",
        "body",
        "buffered",
        "decided",
        "forged",
        "generated",
        "head",
        "learns",
        "reserved",
        "route",
    )

    def __init__(self) -> None:
        self.head: RequestHead | None = None
        self.decided: Decision | None = None
        # The request has its final answer (its route or refusal): the gate needs no more messages.
        self.answered = False
        self.forged: list[str] = []
        self.body = bytearray()
        self.reserved: Reserved | None = None
        # Envoy said (protocol_config, on its first message) that it buffers the whole body.
        self.buffered = False
        self.route = NO_ROUTE_POLICY
        # A request that named no output budget: its answer's usage teaches the pipeline (read by
        # the endpoint picker, which sees answers: kvgate.gate.picker).
        self.learns: Learns | None = None
        # The output tokens its answer's usage says it generated, 0 until read (only the endpoint
        # picker reads answers): its Release tells the agent.
        self.generated = 0


ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
# Request facts Envoy sends under their own attribute names rather than as request.headers[...].
_OWN_ATTRIBUTES = {":path": "request.path", ":method": "request.method", "x-request-id": "request.id"}


def header_value(header: HeaderValue) -> str:
    return header.raw_value.decode("latin-1") if header.raw_value else str(header.value)


def header_attribute(name: str) -> str:
    """The `request_attributes` entry (a CEL expression) that sends one request header's value."""
    return f"request.headers['{name.lower()}']"


@functools.cache
def _attribute(header: str) -> str:
    return _OWN_ATTRIBUTES.get(header) or header_attribute(header)


@functools.cache
def _headers_by_attribute(priority_header: str) -> tuple[tuple[str, str], ...]:
    """(header, attribute) for every header the gate reads."""
    return tuple((header, _attribute(header)) for header in headers_read(priority_header))


def request_attributes(priority_header: str) -> tuple[str, ...]:
    """What Envoy must send with the body for the one-round-trip set-up: every header the gate
    reads. Absent headers are simply missing from what Envoy sends."""
    return tuple(attribute for _, attribute in _headers_by_attribute(priority_header))


def read_head(
    message: HttpHeaders, stream: RequestStream, priority_header: str, route: RoutePolicy = NO_ROUTE_POLICY
) -> RequestHead:
    """The RequestHead of a two-round-trip stream; only the headers the gate reads are decoded (a
    request carries twenty or more)."""
    headers = {header.key: header for header in message.headers.headers}
    stream.forged.extend(key for key in headers if key.startswith(HEADER_PREFIX))

    def read(key: str) -> str | None:
        header = headers.get(key)
        return header_value(header) if header is not None else None

    return request_head(read, not message.end_of_stream, priority_header, route)


def head_from_attributes(
    message: ProcessingRequest, priority_header: str, route: RoutePolicy = NO_ROUTE_POLICY
) -> RequestHead | None:
    """The RequestHead of a one-round-trip stream; None when Envoy sent no request path (its
    ext_proc filter lacks the `request_attributes` of `request_attributes()`)."""
    attributes = message.attributes.get(ATTRIBUTES_NAMESPACE)
    if attributes is None or "request.path" not in attributes.fields:
        return None
    fields = attributes.fields

    # Each attribute read once into a dict by its header's name, and only those the gate reads:
    # iterating the protobuf map wraps every entry in Python objects (16 µs for four entries; these
    # lookups 9 µs).
    values = {
        header: fields[attribute].string_value
        for header, attribute in _headers_by_attribute(priority_header)
        if attribute in fields
    }
    return request_head(values.get, True, priority_header, route)


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        pipeline: Pipeline,
        config: Config,
        telemetry: GateMetrics,
        spans: DecisionSpans | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._metrics = telemetry
        self._spans = spans or DecisionSpans()
        self._namespace = config.server.metadata_namespace
        self._priority_header = config.admission.priority_header.lower()
        # Refusals are answered here, in the API's shape (kvgate.policy.refusals), with this
        # deployment's settings.
        self._refusals = Refusals(config.refusals.too_long_status, config.admission.retry_after_s)
        self._holding = holding(config.admission)
        # Calls to the agents made for streams, still in flight: releases, an endpoint picker's first
        # tokens. A stopping gate waits for them (drain_agent_calls).
        self._agent_calls: set[asyncio.Future[None]] = set()

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        stream = self._new_stream()
        metadata = context.invocation_metadata() if context is not None else None
        try:
            async for message in requests:
                kind = message.WhichOneof("request")
                try:
                    if metadata:
                        # The route's policy (Envoy's per-route ext_proc metadata), read once per
                        # stream, at its first message: inside the error boundary.
                        stream.route, metadata = self._pipeline.route_policy(metadata), None
                    if self._holding is not None and kind == "request_body":
                        # Closed with the stream: a Reserve it is still making is given back then.
                        async with contextlib.aclosing(self._held(message, kind, stream)) as held:
                            async for response in held:
                                yield response
                        answers = []
                    else:
                        answers = await self._respond(message, kind, stream)
                except Exception as error:  # the stream's one error boundary (module docstring)
                    yield self._failed(error, message, kind, stream)
                    return
                for answer in answers:
                    yield answer
                if self._done_with(stream):
                    return
        finally:
            # Envoy ends the stream when the HTTP request ends (completed, reset or aborted by the
            # client): that is when the reserved KV capacity is free again.
            self._release(stream)

    def _done_with(self, stream: RequestStream) -> bool:
        """Whether the stream can end now: its request is answered and holds no reservation, so the
        gate needs nothing more from Envoy. Ending it here rather than when the HTTP request ends
        spares the gate the message of that end (two wake-ups of its threads; docs/benchmarks.md,
        "Ending a stream that holds nothing"). Envoy takes a server's close as the end of processing
        for the rest of the request and response, which goes on (envoyproxy/envoy
        source/extensions/filters/http/ext_proc/ext_proc.cc at 29401276, Filter::onGrpcClose:
        "Successful close. We can ignore the stream for the rest of our request and response
        processing"; the shipped Envoy does so in tests/test_e2e_gate.py)."""
        return stream.answered and stream.reserved is None

    def _new_stream(self) -> RequestStream:
        return RequestStream()

    async def _respond(
        self, message: ProcessingRequest, kind: str | None, stream: RequestStream
    ) -> list[ProcessingResponse]:
        """The answers to one message: none or one in this dialect."""
        response = await self._answer(message, kind, stream)
        return [] if response is None else [response]

    async def _held(
        self, message: ProcessingRequest, kind: str | None, stream: RequestStream
    ) -> AsyncGenerator[ProcessingResponse, None]:
        """The body's answer, which may wait for room: past the notice, Envoy is asked to keep
        waiting (kvgate.gate.holding), once, for the longest wait."""
        assert self._holding is not None
        answering = asyncio.ensure_future(self._answer(message, kind, stream))
        try:
            if not await _settles_within(answering, self._holding.notice_s):
                yield responses.hold(self._holding.extension_s(self._holding.notice_s))
            response = await answering
        except BaseException:
            self._abandon(answering, stream)
            raise
        if response is not None:
            yield response

    def _release(self, stream: RequestStream) -> None:
        """End the stream's reservation, if it holds one, once. A task, because this may run while the
        stream is being cancelled."""
        reserved, stream.reserved = stream.reserved, None
        if reserved is not None:
            self._call_agent(reserved.release(stream.generated))

    def _call_agent(self, call: Awaitable[None]) -> None:
        task = asyncio.ensure_future(call)
        self._agent_calls.add(task)
        task.add_done_callback(self._agent_calls.discard)

    def _abandon(self, answering: asyncio.Future[ProcessingResponse | None], stream: RequestStream) -> None:
        """The stream went away while its body's answer was still being made: stop making it (the
        admission gives back a Reserve it cancels), and end any reservation it still makes."""
        answering.cancel()
        answering.add_done_callback(lambda _: self._release(stream))

    async def _answer(
        self, message: ProcessingRequest, kind: str | None, stream: RequestStream
    ) -> ProcessingResponse | None:
        self._metrics.message(kind or "none")
        if message.HasField("protocol_config"):
            stream.buffered = message.protocol_config.request_body_mode == ProcessingMode.BUFFERED
        if kind == "request_headers":
            return self._on_headers(message.request_headers, stream)
        if kind == "request_body":
            return await self._on_body(message, stream)
        return _PASS_THROUGH.get(kind or "")

    def _failed(
        self, error: Exception, message: ProcessingRequest, kind: str | None, stream: RequestStream
    ) -> ProcessingResponse:
        """The answer to a message the gate raised on: the client's refusal for a RequestError,
        the internal_error row for anything else."""
        api = stream.head.api if stream.head is not None else None
        if isinstance(error, RequestError):
            refusal = refusal_for(error)
            self._record(refusal, "none", 0.0)
            return self._refuse(refusal, api)
        log.error(
            "request %s: the gate failed on its %s message and answered 503 internal_error",
            ascii(_request_id(message, stream)),
            kind,
            exc_info=error,
        )
        self._metrics.internal_error(kind or "none")
        return self._refuse(INTERNAL_ERROR, api)

    async def drain_agent_calls(self) -> None:
        """Wait for calls to the agents still in flight, so a stopping gate gives back what it reserved."""
        if self._agent_calls:
            await asyncio.gather(*self._agent_calls, return_exceptions=True)

    def _on_headers(self, message: HttpHeaders, stream: RequestStream) -> ProcessingResponse:
        stream.head = head = read_head(message, stream, self._priority_header, stream.route)
        decision = self._pipeline.on_headers(head)
        if decision is None:
            return responses.CONTINUE_HEADERS
        stream.answered = True
        self._record(decision, "none", 0.0)
        if isinstance(decision, Refusal):
            return self._refuse(decision, head.api)
        return responses.route_after_headers(
            decision, stream.forged, head.has_body, self._namespace, self._identity(head)
        )

    def _refuse(self, refusal: Refusal, api: Api | None) -> ProcessingResponse:
        """The refusal in the shape of the API the client called (kvgate.policy.refusals)."""
        return responses.refuse(self._refusals.answer(refusal, api), refusal.reason)

    def _record(self, decision: Decision, method: str, seconds: float) -> None:
        if isinstance(decision, Refusal):
            status = self._refusals.status(decision.reason)
            self._metrics.decision(str(status), decision.reason.value, method, decision.tokens, seconds)
        else:
            self._metrics.decision(decision.pool, decision.reason.value, method, decision.tokens, seconds)

    async def _on_body(self, request: ProcessingRequest, stream: RequestStream) -> ProcessingResponse:
        message = request.request_body
        if stream.head is None:
            head = head_from_attributes(request, self._priority_header, stream.route)
            if head is None:
                log.warning(
                    "a body came without headers or request attributes: set the ext_proc filter's "
                    "request_header_mode to SEND, or its request_attributes to %s",
                    list(request_attributes(self._priority_header)),
                )
                return responses.CONTINUE_BODY
            stream.head = head
            # One round trip: what two would decide on the headers message alone (paths and content
            # types the gate does not read) is decided now.
            stream.decided = self._pipeline.on_headers(head)
        if not message.end_of_stream and not stream.buffered:
            # A body in pieces (an Envoy that does not say it buffers) is collected until its last
            # one. A BUFFERED body comes whole in one message, without end_of_stream when trailers
            # follow (Envoy's request decompressor adds some).
            stream.body += message.body
            return responses.CONTINUE_BODY
        stream.answered = True
        if stream.decided is not None:
            self._record(stream.decided, "none", 0.0)
            return self._answer_body(stream.decided, stream.head, stream, {})
        return await self._decide_on_body(stream.head, stream, message.body)

    async def _decide_on_body(
        self, head: RequestHead, stream: RequestStream, last_piece: bytes
    ) -> ProcessingResponse:
        body: Body = last_piece
        if stream.body:
            # A body that came in pieces: the last one joins the others in their buffer, which is
            # read as it is (no copy of the whole to make bytes of it).
            stream.body += last_piece
            body = stream.body
        started_ns = time.time_ns()
        started = time.perf_counter()
        outcome = await self._pipeline.on_body(head, body)
        stream.reserved = reserved = outcome.reserved
        stream.learns = outcome.learns
        decision = outcome.decision
        method = outcome.estimate.method if outcome.estimate is not None else "none"
        self._record(decision, method, time.perf_counter() - started)
        if self._spans.enabled:
            self._spans.record(
                dict(head.trace_context),
                started_ns,
                time.time_ns(),
                _span_attributes(outcome, len(body), self._refusals.status),
            )
        extra: dict[str, str | float] = {}
        if outcome.estimate is not None:
            extra["method"] = outcome.estimate.method
            extra["prompt_tokens"] = outcome.estimate.prompt_tokens
        if outcome.shape is not None and outcome.shape.model:
            extra["model"] = outcome.shape.model
        session = None
        if reserved is not None:
            # What the node's agent charged, and what it expects the engine to find cached.
            extra[META_RESERVED_TOKENS] = reserved.charged_tokens
            extra[META_PREFIX_HIT_TOKENS] = reserved.cached_tokens
            session = reserved.session
        return self._answer_body(decision, head, stream, extra, session)

    def _answer_body(
        self,
        decision: Decision,
        head: RequestHead,
        stream: RequestStream,
        extra: dict[str, str | float],
        session: str | None = None,
    ) -> ProcessingResponse:
        if isinstance(decision, Refusal):
            return self._refuse(decision, head.api)
        return self._route(decision, head, stream, extra, session)

    def _route(
        self,
        route: Route,
        head: RequestHead,
        stream: RequestStream,
        extra: dict[str, str | float],
        session: str | None,
    ) -> ProcessingResponse:
        """The answer that sends the request on, once its body is in."""
        return responses.route_after_body(
            route, stream.forged, extra, self._namespace, identity=self._identity(head), session=session
        )

    def _identity(self, head: RequestHead) -> responses.Identity:
        return responses.Identity(head.tenant, self._pipeline.priority(head), self._priority_header)


async def _settles_within(answering: asyncio.Future[ProcessingResponse | None], seconds: float) -> bool:
    """Whether `answering` is done within `seconds` (it goes on either way)."""
    done, _ = await asyncio.wait((answering,), timeout=seconds)
    return bool(done)


def _request_id(message: ProcessingRequest, stream: RequestStream) -> str:
    """The request's id for the log, even when the gate failed before reading its head."""
    if stream.head is not None:
        return stream.head.request_id
    for header in message.request_headers.headers.headers:
        if header.key == "x-request-id":
            return header_value(header)
    if ATTRIBUTES_NAMESPACE in message.attributes:
        found = message.attributes[ATTRIBUTES_NAMESPACE].fields.get(_OWN_ATTRIBUTES["x-request-id"])
        if found is not None:
            return str(found.string_value)
    return "(unknown)"


def _span_attributes(
    outcome: Outcome, body_bytes: int, status_of: Callable[[Reason], int]
) -> dict[str, AttributeValue]:
    decision = outcome.decision
    attributes: dict[str, AttributeValue] = {
        "kvgate.reason": decision.reason.value,
        "kvgate.tokens": decision.tokens,
        "http.request.body.size": body_bytes,
    }
    if isinstance(decision, Refusal):
        attributes["http.response.status_code"] = status_of(decision.reason)
    else:
        attributes["kvgate.pool"] = decision.pool
        if decision.endpoint is not None:
            attributes["kvgate.endpoint"] = decision.endpoint
    if outcome.estimate is not None:
        attributes["kvgate.estimate.method"] = outcome.estimate.method
        attributes["gen_ai.usage.input_tokens"] = outcome.estimate.prompt_tokens
        attributes["gen_ai.request.max_tokens"] = outcome.estimate.output_tokens
    if outcome.shape is not None and outcome.shape.model:
        attributes["gen_ai.request.model"] = outcome.shape.model
    return attributes
