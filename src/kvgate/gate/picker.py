"""The Endpoint Picker Protocol: kvgate as the endpoint picker of an InferencePool (`server.protocol:
endpoint-picker`).

A gateway that implements the Gateway API Inference Extension (Istio, Envoy Gateway, kgateway, GKE
Gateway...) asks its pool's picker, over ext_proc, which engine serves each request. The wire contract
(gateway-api-inference-extension docs/proposals/004-endpoint-picker-protocol/README.md @84436a96),
and what the reference picker does with it (v1.5.0, pkg/epp/handlers/server.go and request.go):
- Every message comes FULL_DUPLEX_STREAMED: the request headers, the body in chunks, any trailers,
  then the same for the response. The picker answers the request headers only once the whole body is
  in (Envoy holds the request meanwhile; this mode has no message timeout), then hands the body back
  as streamed chunks: headers, body, trailers, in that order (the reference picker's "the order of
  response sent back MUST be: Header->Body->Trailer").
- The answer names the engine in the `x-gateway-destination-endpoint` header and in the `envoy.lb`
  dynamic metadata, both `ip:port` or a fallback list `ip:port,ip:port`; Envoy's override_host load
  balancer sends the request there (envoy/envoy-inferencepool.yaml). What the gate decides is the same
  as in its own dialect (kvgate.gate.pipeline): a long request is named the engine its reservation
  holds, any other the least busy interactive engines (kvgate.policy.endpoints), and refusals are the
  same API-shaped answers, 503 when the gateway's subset hint leaves no engine eligible.
- On the response the gateway reports the engine that served (`envoy.lb` /
  `x-gateway-destination-endpoint-served`). It differs from the one named when that engine failed and
  Envoy's override_host balancer went on to the next host, or to its fallback policy once the named
  ones were used up (envoy source/extensions/load_balancing_policies/override_host/load_balancer.cc
  @043486c7, getEndpoint / chooseHostInternal). The reservation moves to the engine that serves:
  reserved on its agent, given back where it was (kvgate.gate.admission.Admission.move); where no agent
  follows that engine or it has no room, it is only given back, since it would hold KV idle.
- The response body is handed back chunk by chunk as it comes. Its first bytes are the engine's first
  token (a stream's first event; a whole answer otherwise): the time since the gate's answer is
  recorded per pool, and the agent holding the request's reservation is told (FirstToken), which
  projects the reservation's end from then instead of from an estimated prefill (kvgate.agent.footprint).

The error boundary is the dialect adapter's (kvgate.gate.processor): an exception becomes the
refusal table's answer, never a request let through unpicked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from google.protobuf.struct_pb2 import Value

from kvgate.config import Config
from kvgate.gate import responses
from kvgate.gate.pipeline import Pipeline, RequestHead
from kvgate.gate.processor import ExternalProcessor, RequestStream, header_value, read_head
from kvgate.names import LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE
from kvgate.policy import Reason, Refusal, Route
from kvgate.policy.endpoints import Subset
from kvgate.request.usage import output_tokens
from kvgate.telemetry import DecisionSpans, GateMetrics

log = logging.getLogger(__name__)

_FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
# A JSON answer is kept whole to read its usage, up to this; a stream keeps its last chunks only: the
# usage is its last event (OpenAI's before `data: [DONE]`, Anthropic's message_delta before
# message_stop), and Envoy hands the body on in chunks of whatever the engine wrote at once.
ANSWER_BYTES = 1024 * 1024
TAIL_CHUNKS = 4
_CONTINUE_RESPONSE_HEADERS = ProcessingResponse(response_headers=HeadersResponse())
_CONTINUE_RESPONSE_BODY = ProcessingResponse(response_body=BodyResponse())
_CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse())


class PickerStream(RequestStream):
    """One request's state: what the dialect's stream holds, and where the picker stands."""

    __slots__ = (
        "answer",
        "answer_streamed",
        "answered",
        "awaits_first_token",
        "endpoint",
        "pool",
        "reads_answer",
        "routed_at",
        "streams_request",
        "streams_response",
        "tail",
    )

    def __init__(self) -> None:
        super().__init__()
        self.answered = False  # the request headers and body have been answered
        self.endpoint: str | None = None  # the engine the reservation is held on, if any
        self.pool = ""  # the pool of the engine picked
        self.routed_at = 0.0  # when the gate answered with an engine (monotonic)
        self.awaits_first_token = False  # a 200 whose first body bytes have not come yet
        # A 200 to a request that holds a reservation or named no output budget: its usage is read.
        self.reads_answer = False
        self.streams_request = True
        self.streams_response = True
        # What is kept of the answer to read its usage from: all of a JSON answer, the last chunks of
        # a stream.
        self.answer = bytearray()
        self.answer_streamed = False
        self.tail: deque[bytes] = deque(maxlen=TAIL_CHUNKS)


def subset_hint(message: ProcessingRequest) -> Subset:
    """The gateway's subset hint, None when it sent none. The protocol writes it as a list; a flat
    `ip:port,ip:port` string is read too, as Envoy's header-to-metadata rules write one
    (gateway-api-inference-extension pkg/lwepp/handlers/request.go @84436a96)."""
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value: Value = hint.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return frozenset(v.string_value.strip() for v in value.list_value.values if v.string_value.strip())
    if kind == "string_value":
        return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())
    return frozenset()


def served_endpoint(message: ProcessingRequest) -> str | None:
    """The engine the gateway says served the response, None when it does not say."""
    lb = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is None or SERVED_KEY not in lb.fields:
        return None
    return lb.fields[SERVED_KEY].string_value or None


class EndpointPicker(ExternalProcessor):
    def __init__(
        self, pipeline: Pipeline, config: Config, telemetry: GateMetrics, spans: DecisionSpans | None = None
    ) -> None:
        super().__init__(pipeline, config, telemetry, spans)
        # The gateway streams the body: the picker, not Envoy's buffer, bounds what it holds.
        self._max_body_bytes = config.request.max_body_bytes
        # FULL_DUPLEX_STREAMED has no message timeout: nothing to ask Envoy to wait longer for.
        self._holding = None

    def _new_stream(self) -> PickerStream:
        return PickerStream()

    def _done_with(self, stream: RequestStream) -> bool:
        # The picker hands the body back and reads the answer (its first token, its usage): every
        # stream runs to the end of the response.
        return False

    async def _respond(
        self, message: ProcessingRequest, kind: str | None, stream: RequestStream
    ) -> list[ProcessingResponse]:
        assert isinstance(stream, PickerStream), "made by _new_stream"
        return await self._on_message(message, kind, stream)

    async def _on_message(
        self, message: ProcessingRequest, kind: str | None, stream: PickerStream
    ) -> list[ProcessingResponse]:
        self._metrics.message(kind or "none")
        if message.HasField("protocol_config"):
            modes = message.protocol_config
            stream.streams_request = modes.request_body_mode == _FULL_DUPLEX
            stream.streams_response = modes.response_body_mode == _FULL_DUPLEX
        if kind == "request_headers":
            return self._on_request_headers(message, stream)
        if kind == "request_body":
            body = message.request_body
            stream.body += body.body
            if len(stream.body) > self._max_body_bytes:
                return [self._refuse_oversized(stream)]
            return await self._answer_request(stream, trailers=False) if body.end_of_stream else []
        if kind == "request_trailers":
            if stream.answered:
                return [_CONTINUE_REQUEST_TRAILERS]
            return await self._answer_request(stream, trailers=True)
        if kind == "response_headers":
            await self._check_served(message, stream)
            self._read_answer_head(message, stream)
            return [_CONTINUE_RESPONSE_HEADERS]
        if kind == "response_body":
            chunk = message.response_body
            if stream.awaits_first_token and chunk.body:
                self._first_token(stream)
            if stream.reads_answer:
                self._read_answer(chunk.body, chunk.end_of_stream, stream)
            if not stream.streams_response:
                return [_CONTINUE_RESPONSE_BODY]
            return [responses.streamed_response_body(chunk.body, end_of_stream=chunk.end_of_stream)]
        if kind == "response_trailers":
            return [_CONTINUE_RESPONSE_TRAILERS]
        return []

    def _on_request_headers(
        self, message: ProcessingRequest, stream: PickerStream
    ) -> list[ProcessingResponse]:
        head = read_head(message.request_headers, stream, self._priority_header, stream.route)
        stream.head = head = dataclasses.replace(head, subset=subset_hint(message))
        if not stream.streams_request:
            # Envoy waits for the headers answer before it sends a buffered body: a picker that
            # waits for the body first would hang every request.
            raise PickerModeError("the ext_proc filter's request_body_mode must be FULL_DUPLEX_STREAMED")
        stream.decided = self._pipeline.on_headers(head)
        if head.has_body:
            return []
        decision = stream.decided
        assert decision is not None, "a request without a body is decided on its headers"
        self._record(decision, "none", 0.0)
        stream.answered = True
        return [self._answer_body(decision, head, stream, {})]

    async def _answer_request(self, stream: PickerStream, *, trailers: bool) -> list[ProcessingResponse]:
        """The request's answer once its body is whole: the headers answer (the engine, or a
        refusal), then its body handed back (and the trailers' answer, where they follow)."""
        head = stream.head
        assert head is not None, "request headers come first in FULL_DUPLEX_STREAMED"
        if stream.decided is not None:
            self._record(stream.decided, "none", 0.0)
            answer = self._answer_body(stream.decided, head, stream, {})
        else:
            answer = await self._decide_on_body(head, stream, b"")
        stream.answered = True
        if answer.HasField("immediate_response"):
            return [answer]
        body = responses.streamed_request_body(stream.body, end_of_stream=not trailers)
        stream.body = bytearray()
        return [answer, *body, *([_CONTINUE_REQUEST_TRAILERS] if trailers else [])]

    def _route(
        self,
        route: Route,
        head: RequestHead,
        stream: RequestStream,
        extra: dict[str, str | float],
        session: str | None,
    ) -> ProcessingResponse:
        if isinstance(stream, PickerStream):
            stream.pool, stream.routed_at = route.pool, time.monotonic()
            if stream.reserved is not None:
                stream.endpoint = route.endpoint
        return responses.picked(
            route,
            stream.forged,
            extra,
            self._namespace,
            identity=self._identity(head),
            session=session,
            body_bytes=len(stream.body),
        )

    def _refuse_oversized(self, stream: PickerStream) -> ProcessingResponse:
        limit = self._max_body_bytes
        refusal = Refusal(Reason.BODY_TOO_LARGE, f"The request body exceeds {limit} bytes.")
        self._record(refusal, "none", 0.0)
        stream.answered = True
        stream.body = bytearray()
        return self._refuse(refusal, stream.head.api if stream.head is not None else None)

    def _read_answer_head(self, message: ProcessingRequest, stream: PickerStream) -> None:
        """Only a 200's usage says what a request generated; a stream keeps its usage in its tail. It
        is read for a request that named no output budget (the pipeline learns lengths from it) and
        for one that holds a reservation (its Release tells the agent, which learns its node's)."""
        headers = {h.key: h for h in message.response_headers.headers.headers}
        status = headers.get(":status")
        if status is None or header_value(status) != "200":
            stream.learns = None
            return
        stream.awaits_first_token = stream.routed_at > 0
        stream.reads_answer = stream.learns is not None or stream.reserved is not None
        if not stream.reads_answer:
            return
        content_type = headers.get("content-type")
        stream.answer_streamed = content_type is not None and header_value(content_type).startswith(
            "text/event-stream"
        )

    def _read_answer(self, chunk: bytes, end_of_stream: bool, stream: PickerStream) -> None:
        """Keep what the usage is read from; at the answer's end, teach the pipeline its length and
        keep it for the reservation's Release."""
        if stream.answer_streamed:
            stream.tail.append(chunk)  # a deque's append: this runs for every token's event
        else:
            stream.answer += chunk
            if len(stream.answer) > ANSWER_BYTES:
                stream.reads_answer, stream.learns, stream.answer = False, None, bytearray()
                return
        if not end_of_stream:
            return
        learns, stream.learns, stream.reads_answer = stream.learns, None, False
        answer = b"".join(stream.tail) if stream.answer_streamed else bytes(stream.answer)
        tokens = output_tokens(answer, streamed=stream.answer_streamed)
        stream.answer = bytearray()
        if tokens is None:
            return
        stream.generated = tokens
        if learns is not None:
            self._pipeline.observe_output(learns, tokens)

    def _first_token(self, stream: PickerStream) -> None:
        stream.awaits_first_token = False
        self._metrics.first_token(time.monotonic() - stream.routed_at, stream.pool)
        reserved = stream.reserved
        if reserved is None:
            return
        telling = asyncio.ensure_future(reserved.first_token())
        self._call_agent(telling)

        async def release_once_told(generated_tokens: int) -> None:
            # A short answer ends while its FirstToken is in flight: released after it, the agent
            # does not take a first token for a reservation it has already ended.
            await asyncio.wait([telling])
            await reserved.release(generated_tokens)

        stream.reserved = dataclasses.replace(reserved, release=release_once_told)

    async def _check_served(self, message: ProcessingRequest, stream: PickerStream) -> None:
        """A reservation held on an engine that did not serve the request moves to the one that did."""
        served = served_endpoint(message)
        reserved = stream.reserved
        if served is None or reserved is None or served == stream.endpoint:
            return
        # Taken off the stream while it moves: a stream that ends meanwhile releases nothing twice.
        stream.reserved = None
        stream.reserved = await reserved.move(served)
        log.info(
            "request %s: served by %s, not %s where its reservation was: %s",
            ascii(stream.head.request_id if stream.head is not None else "(unknown)"),
            served,
            stream.endpoint,
            "moved there" if stream.reserved is not None else "released",
        )
        stream.endpoint = served


class PickerModeError(Exception):
    """Envoy's ext_proc filter is not set up as an endpoint picker needs it."""
