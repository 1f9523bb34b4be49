"""Build ext_proc ProcessingResponses from decisions. The one place a Refusal becomes HTTP.

Envoy types stay in the gate package: the policy hands over plain Route / Refusal values.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from kvgate.policy.decision import Refusal, Route

POOL_HEADER = "x-kvgate-pool"
TOKENS_HEADER = "x-kvgate-tokens"
REASON_HEADER = "x-kvgate-reason"
ENDPOINT_HEADER = "x-kvgate-endpoint"
HEADER_PREFIX = "x-kvgate-"
METADATA_NAMESPACE = "kvgate"

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
_SKIP_BODY = ProcessingMode(request_body_mode=ProcessingMode.BodySendMode.NONE)


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _route_mutation(route: Route, forged: Iterable[str]) -> HeaderMutation:
    headers = [
        _header(POOL_HEADER, route.pool),
        _header(TOKENS_HEADER, str(route.tokens)),
        _header(REASON_HEADER, route.reason.value),
    ]
    if route.endpoint is not None:
        headers.append(_header(ENDPOINT_HEADER, route.endpoint))
    ours = {option.header.key for option in headers}
    return HeaderMutation(set_headers=headers, remove_headers=[name for name in forged if name not in ours])


def _metadata(route: Route, extra: dict[str, str | float], namespace: str) -> Struct:
    metadata = Struct()
    fields: dict[str, str | float] = {
        "pool": route.pool,
        "tokens": route.tokens,
        "reason": route.reason.value,
    }
    if route.endpoint is not None:
        fields["endpoint"] = route.endpoint
    fields.update(extra)
    metadata.update({namespace: fields})
    return metadata


def route_after_body(
    route: Route, forged: Iterable[str], extra: dict[str, str | float], namespace: str
) -> ProcessingResponse:
    """Answer the body message: set the routing headers and make Envoy pick the route again."""
    common = CommonResponse(header_mutation=_route_mutation(route, forged), clear_route_cache=True)
    return ProcessingResponse(
        request_body=BodyResponse(response=common), dynamic_metadata=_metadata(route, extra, namespace)
    )


def route_after_headers(
    route: Route, forged: Iterable[str], skip_body: bool, namespace: str
) -> ProcessingResponse:
    """Answer the headers message of a request that needs no body inspection."""
    common = CommonResponse(header_mutation=_route_mutation(route, forged), clear_route_cache=True)
    response = ProcessingResponse(
        request_headers=HeadersResponse(response=common), dynamic_metadata=_metadata(route, {}, namespace)
    )
    if skip_body:
        response.mode_override.CopyFrom(_SKIP_BODY)
    return response


CONTINUE_HEADERS = ProcessingResponse(request_headers=HeadersResponse())
CONTINUE_BODY = ProcessingResponse(request_body=BodyResponse())

# Statuses a client may retry after a while: they carry Retry-After.
_RETRYABLE = frozenset({429, 503})

# OpenAI-style error `type` per status, for clients that switch on it.
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def refusal_body(refusal: Refusal) -> bytes:
    error = {
        "message": refusal.message,
        "type": _ERROR_TYPES.get(refusal.status, refusal.error_type),
        "param": None,
        "code": refusal.code,
    }
    return json.dumps({"error": error}).encode()


def refuse(refusal: Refusal) -> ProcessingResponse:
    headers = [
        _header("content-type", "application/json"),
        _header(REASON_HEADER, refusal.reason.value),
    ]
    if refusal.tokens:
        headers.append(_header(TOKENS_HEADER, str(refusal.tokens)))
    if refusal.status in _RETRYABLE:
        headers.append(_header("retry-after", str(refusal.retry_after_s or 1)))
    immediate = ImmediateResponse(
        status=HttpStatus(code=refusal.status),
        headers=HeaderMutation(set_headers=headers),
        body=refusal_body(refusal),
        details=f"kvgate_{refusal.reason.value}",
    )
    return ProcessingResponse(immediate_response=immediate)
