"""The ext_proc adapter: Envoy's ProcessingRequest stream in, ProcessingResponses out.

Envoy is configured with request headers SEND and request body BUFFERED, so each stream sees the
headers, then (for requests that have one) the whole body in one message. Everything between those
two messages and the answer is the Pipeline's business; this module only translates.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeadersResponse,
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from opentelemetry.util.types import AttributeValue

from kvgate.gate import responses
from kvgate.gate.admission import Ticket
from kvgate.gate.pipeline import Outcome, Pipeline, RequestHead
from kvgate.policy import Decision, Refusal
from kvgate.telemetry import DecisionSpans, GateMetrics

log = logging.getLogger(__name__)

_PASS_THROUGH = {
    "response_headers": ProcessingResponse(response_headers=HeadersResponse()),
    "response_body": ProcessingResponse(response_body=BodyResponse()),
    "request_trailers": ProcessingResponse(request_trailers=TrailersResponse()),
    "response_trailers": ProcessingResponse(response_trailers=TrailersResponse()),
}


class _Stream:
    """Per-request state between the headers and the body message."""

    __slots__ = ("body", "forged", "head", "ticket")

    def __init__(self) -> None:
        self.head: RequestHead | None = None
        self.forged: list[str] = []
        self.body = bytearray()
        self.ticket: Ticket | None = None


_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})


def _value(header: HeaderValue) -> str:
    return header.raw_value.decode("latin-1") if header.raw_value else str(header.value)


def read_head(message: HttpHeaders, stream: _Stream, priority_header: str) -> RequestHead:
    """The headers the gate reads; only those are decoded (a request carries twenty or more)."""
    wanted: dict[str, str | None] = {
        ":path": "",
        ":method": "",
        "content-type": None,
        "content-encoding": None,
        "x-request-id": "",
    }
    priority = None
    trace_context: list[tuple[str, str]] = []
    for header in message.headers.headers:
        key = header.key
        if key in wanted:
            wanted[key] = _value(header)
        elif key in _TRACE_HEADERS:
            trace_context.append((key, _value(header)))
        if key == priority_header:
            priority = _value(header).strip().lower()
        if key.startswith(responses.HEADER_PREFIX):
            stream.forged.append(key)
    path, method, content_type, content_encoding, request_id = wanted.values()
    return RequestHead(
        path or "",
        method or "",
        content_type,
        content_encoding,
        has_body=not message.end_of_stream,
        priority=priority,
        request_id=request_id or uuid.uuid4().hex,
        trace_context=tuple(trace_context),
    )


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        pipeline: Pipeline,
        priority_header: str,
        telemetry: GateMetrics,
        spans: DecisionSpans | None = None,
        metadata_namespace: str = responses.METADATA_NAMESPACE,
    ) -> None:
        self._pipeline = pipeline
        self._metrics = telemetry
        self._spans = spans or DecisionSpans()
        self._namespace = metadata_namespace
        self._priority_header = priority_header.lower()
        self._releases: set[asyncio.Task[None]] = set()

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        stream = _Stream()
        try:
            async for message in requests:
                kind = message.WhichOneof("request")
                self._metrics.message(kind)
                if kind == "request_headers":
                    yield self._on_headers(message.request_headers, stream)
                elif kind == "request_body":
                    yield await self._on_body(message.request_body, stream)
                elif kind in _PASS_THROUGH:
                    yield _PASS_THROUGH[kind]
        finally:
            # Envoy ends the stream when the HTTP request ends (completed, reset or aborted by the
            # client): that is when the reserved KV capacity is free again. A task, because this may
            # run while the stream is being cancelled.
            if stream.ticket is not None:
                task = asyncio.create_task(self._pipeline.release(stream.ticket))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

    async def drain_releases(self) -> None:
        """Wait for releases still in flight, so a stopping gate gives back what it reserved."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    def _on_headers(self, message: HttpHeaders, stream: _Stream) -> ProcessingResponse:
        stream.head = head = read_head(message, stream, self._priority_header)
        decision = self._pipeline.on_headers(head)
        if decision is None:
            return responses.CONTINUE_HEADERS
        self._record(decision, "none", 0.0)
        if isinstance(decision, Refusal):
            return responses.refuse(decision)
        return responses.route_after_headers(decision, stream.forged, head.has_body, self._namespace)

    def _record(self, decision: Decision, method: str, seconds: float) -> None:
        if isinstance(decision, Refusal):
            self._metrics.decision(
                str(decision.status), decision.reason.value, method, decision.tokens, seconds
            )
        else:
            self._metrics.decision(decision.pool, decision.reason.value, method, decision.tokens, seconds)

    async def _on_body(self, message: HttpBody, stream: _Stream) -> ProcessingResponse:
        if stream.head is None:
            log.warning("body without headers: is the ext_proc filter's request_header_mode SEND?")
            return responses.CONTINUE_BODY
        if not message.end_of_stream:
            # Only BUFFERED mode is supported; a chunked body is collected until its last piece.
            stream.body += message.body
            return responses.CONTINUE_BODY
        body = bytes(stream.body) + message.body if stream.body else message.body
        started_ns = time.time_ns()
        started = time.perf_counter()
        outcome = await self._pipeline.on_body(stream.head, body)
        stream.ticket = outcome.ticket
        decision = outcome.decision
        method = outcome.estimate.method if outcome.estimate is not None else "none"
        self._record(decision, method, time.perf_counter() - started)
        if self._spans.enabled:
            self._spans.record(
                dict(stream.head.trace_context),
                started_ns,
                time.time_ns(),
                _span_attributes(outcome, len(body)),
            )
        if isinstance(decision, Refusal):
            return responses.refuse(decision)
        extra: dict[str, str | float] = {}
        if outcome.estimate is not None:
            extra["method"] = outcome.estimate.method
            extra["prompt_tokens"] = outcome.estimate.prompt_tokens
        if outcome.shape is not None and outcome.shape.model:
            extra["model"] = outcome.shape.model
        return responses.route_after_body(decision, stream.forged, extra, self._namespace)


def _span_attributes(outcome: Outcome, body_bytes: int) -> dict[str, AttributeValue]:
    decision = outcome.decision
    attributes: dict[str, AttributeValue] = {
        "kvgate.reason": decision.reason.value,
        "kvgate.tokens": decision.tokens,
        "http.request.body.size": body_bytes,
    }
    if isinstance(decision, Refusal):
        attributes["http.response.status_code"] = decision.status
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
