"""Build ext_proc ProcessingResponses from decisions: routes as header mutations and metadata,
refusals (already HTTP, from `kvgate.policy.refusals`) as immediate responses.

Envoy types stay in the gate package: the policy hands over plain Route values and HttpAnswers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus

from kvgate.names import (
    DESTINATION_HEADER,
    ENDPOINT_HEADER,
    LB_NAMESPACE,
    META_ENDPOINT,
    META_POOL,
    META_PRIORITY,
    META_REASON,
    META_SESSION,
    META_TOKENS,
    POOL_HEADER,
    PRIORITY_HEADER,
    REASON_HEADER,
    ROUTING_HEADERS,
    SESSION_HEADER,
    TENANT_HEADER,
    TOKENS_HEADER,
)
from kvgate.policy.decision import Reason, Route
from kvgate.policy.refusals import HttpAnswer

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
_SKIP_BODY = ProcessingMode(request_body_mode=ProcessingMode.BodySendMode.NONE)


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


# What the gate sets itself: a client's header of the same name is overwritten, never removed.
_OURS = frozenset(ROUTING_HEADERS)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the request is from and the priority it was admitted with, forwarded upstream (the queue
    stores both): the tenant as Envoy set it after authentication, the priority after the route's
    cap (kvgate.policy.identity). `priority_header` is admission.priority_header."""

    tenant: str
    priority: str
    priority_header: str = PRIORITY_HEADER


@functools.lru_cache(maxsize=1024)
def _route_template(
    pool: str, reason: Reason, endpoint: str | None, namespace: str, after_body: bool
) -> bytes:
    """The answer for one route, less what changes per request (the token count, the metadata
    numbers), serialized once: pools, reasons and endpoints are few, and parsing this back costs a
    fraction of building the messages anew."""
    headers = [_header(POOL_HEADER, pool), _header(REASON_HEADER, reason.value)]
    if endpoint is not None:
        headers.append(_header(ENDPOINT_HEADER, endpoint))
    common = CommonResponse(header_mutation=HeaderMutation(set_headers=headers), clear_route_cache=True)
    response = (
        ProcessingResponse(request_body=BodyResponse(response=common))
        if after_body
        else ProcessingResponse(request_headers=HeadersResponse(response=common))
    )
    fields = response.dynamic_metadata.fields[namespace].struct_value.fields
    fields[META_POOL].string_value = pool
    fields[META_REASON].string_value = reason.value
    if endpoint is not None:
        fields[META_ENDPOINT].string_value = endpoint
    serialized: bytes = response.SerializeToString()
    return serialized


def _routed(
    route: Route,
    forged: Sequence[str],
    extra: dict[str, str | float],
    namespace: str,
    *,
    after_body: bool,
    identity: Identity,
) -> ProcessingResponse:
    response = ProcessingResponse.FromString(
        _route_template(route.pool, route.reason, route.endpoint, namespace, after_body)
    )
    common = response.request_body.response if after_body else response.request_headers.response
    tokens = common.header_mutation.set_headers.add(append_action=_OVERWRITE)
    tokens.header.key = TOKENS_HEADER
    tokens.header.raw_value = str(route.tokens).encode()
    for name, text in ((TENANT_HEADER, identity.tenant), (identity.priority_header, identity.priority)):
        forwarded = common.header_mutation.set_headers.add(append_action=_OVERWRITE)
        forwarded.header.key = name
        forwarded.header.raw_value = text.encode()
    if forged:
        # Envoy set the tenant and priority after authentication: forwarded above, not removed.
        kept = (TENANT_HEADER, identity.priority_header)
        common.header_mutation.remove_headers.extend(
            name for name in forged if name not in _OURS and name not in kept
        )
    fields = response.dynamic_metadata.fields[namespace].struct_value.fields
    fields[META_TOKENS].number_value = route.tokens
    # The one-round-trip set-up cannot change headers: Envoy copies this into x-kvgate-priority.
    fields[META_PRIORITY].string_value = identity.priority
    for key, value in extra.items():
        if isinstance(value, str):
            fields[key].string_value = value
        else:
            fields[key].number_value = value
    return response


def route_after_body(
    route: Route,
    forged: Sequence[str],
    extra: dict[str, str | float],
    namespace: str,
    *,
    identity: Identity,
    session: str | None = None,
) -> ProcessingResponse:
    """Answer the body message: set the routing headers and make Envoy pick the route again; with a
    `session` (a reserved request's reservation id), X-Session-ID, over whatever the client sent: the
    engine's KV events name the reservation by it, and a client's value could name another's."""
    response = _routed(route, forged, extra, namespace, after_body=True, identity=identity)
    if session is not None:
        _with_session(response, response.request_body.response, namespace, session)
    return response


def _with_session(response: ProcessingResponse, common: CommonResponse, namespace: str, session: str) -> None:
    response.dynamic_metadata.fields[namespace].struct_value.fields[META_SESSION].string_value = session
    common.header_mutation.set_headers.append(_header(SESSION_HEADER, session))


def picked(
    route: Route,
    forged: Sequence[str],
    extra: dict[str, str | float],
    namespace: str,
    *,
    identity: Identity,
    session: str | None,
    body_bytes: int,
) -> ProcessingResponse:
    """An endpoint picker's answer to the request headers, sent once the whole body is in (the
    Endpoint Picker Protocol, kvgate.gate.picker): the gate's own headers and metadata, and the
    engine(s) in `route.endpoint` both as x-gateway-destination-endpoint and as `envoy.lb` metadata,
    which Envoy's override_host load balancer reads. Content-Length is the body's as the gate passes it
    on (inflated, where Envoy's decompressor inflated it), as the reference picker sets it
    (gateway-api-inference-extension v1.5.0 pkg/epp/handlers/request.go)."""
    assert route.endpoint is not None, "a picker's route names its engine"
    response = _routed(route, forged, extra, namespace, after_body=False, identity=identity)
    common = response.request_headers.response
    common.header_mutation.set_headers.append(_header(DESTINATION_HEADER, route.endpoint))
    if body_bytes:
        common.header_mutation.set_headers.append(_header("content-length", str(body_bytes)))
    response.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER
    ].string_value = route.endpoint
    if session is not None:
        _with_session(response, common, namespace, session)
    return response


# The most body one streamed answer carries: "Certain envoy implementations set a max limit of 64Kb per
# streamed chunk" (gateway-api-inference-extension v1.5.0 pkg/common/envoy/chunking.go, BodyByteLimit).
STREAMED_CHUNK_BYTES = 62_000


def streamed_request_body(body: bytes | bytearray, *, end_of_stream: bool) -> list[ProcessingResponse]:
    """The request body handed back to Envoy in FULL_DUPLEX_STREAMED mode, in chunks of at most
    STREAMED_CHUNK_BYTES; `end_of_stream` on the last unless trailers follow. An empty body is one
    empty chunk: Envoy waits for one."""
    view = memoryview(body)
    starts = range(0, max(1, len(view)), STREAMED_CHUNK_BYTES)
    last = starts[-1]
    return [
        ProcessingResponse(
            request_body=BodyResponse(
                response=_streamed(bytes(view[at : at + STREAMED_CHUNK_BYTES]), end_of_stream and at == last)
            )
        )
        for at in starts
    ]


def streamed_response_body(chunk: bytes, *, end_of_stream: bool) -> ProcessingResponse:
    """One response body chunk handed back as it came (FULL_DUPLEX_STREAMED responses)."""
    return ProcessingResponse(response_body=BodyResponse(response=_streamed(chunk, end_of_stream)))


def _streamed(body: bytes, end_of_stream: bool) -> CommonResponse:
    streamed = StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    return CommonResponse(body_mutation=BodyMutation(streamed_response=streamed))


def route_after_headers(
    route: Route, forged: Sequence[str], skip_body: bool, namespace: str, identity: Identity
) -> ProcessingResponse:
    """Answer the headers message of a request that needs no body inspection."""
    response = _routed(route, forged, {}, namespace, after_body=False, identity=identity)
    if skip_body:
        response.mode_override.CopyFrom(_SKIP_BODY)
    return response


CONTINUE_HEADERS = ProcessingResponse(request_headers=HeadersResponse())
CONTINUE_BODY = ProcessingResponse(request_body=BodyResponse())


def hold(seconds: float) -> ProcessingResponse:
    """Ask Envoy to wait `seconds` more for the answer to the message it is waiting on.

    A ProcessingResponse that carries only `override_message_timeout`: Envoy restarts that message's
    timer with this value and ignores every other field; it honours one such message per message it
    waits on, and only between 1 ms and its max_message_timeout (else it counts
    override_message_timeout_ignored and keeps the first timer). envoyproxy/envoy
    source/extensions/filters/http/ext_proc/ext_proc.cc, Filter::onReceiveMessage and
    Filter::onNewTimeout; processor_states.cc, ProcessorState::restartMessageTimer (Envoy 1.40)."""
    response = ProcessingResponse()
    response.override_message_timeout.FromMilliseconds(max(1, round(seconds * 1000)))
    return response


def refuse(answer: HttpAnswer, reason: Reason) -> ProcessingResponse:
    immediate = ImmediateResponse(
        status=HttpStatus(code=answer.status),
        headers=HeaderMutation(set_headers=[_header(key, value) for key, value in answer.headers]),
        body=answer.body,
        details=f"kvgate_{reason.value}",
    )
    return ProcessingResponse(immediate_response=immediate)
