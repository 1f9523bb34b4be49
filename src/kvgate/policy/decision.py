"""What the gate decided for one request: a route to a pool, or a refusal with a clear reason.

A full pool is not an exception: it is a Refusal returned like any other decision. Every Refusal
becomes one ImmediateResponse in `kvgate.gate.responses`, the single place that maps refusals to HTTP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(enum.StrEnum):
    """Why a request went where it went. A bounded set: these are metric label values too."""

    SHORT = "short"
    LONG = "long"
    TOO_LONG = "too_long"
    UNPARSED = "unparsed"
    NO_BODY = "no_body"
    INVALID = "invalid_request"
    UNSUPPORTED = "unsupported"
    OVERLOADED = "overloaded"
    ASYNC = "async"
    SHED = "shed"
    QUEUE_FULL = "queue_full"
    NO_CAPACITY = "no_capacity"
    NO_HEALTHY_NODE = "no_healthy_node"


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    reason: Reason
    tokens: int = 0
    # Set when the request is pinned to one node's engine (long requests with headroom).
    endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    code: str
    reason: Reason
    message: str
    tokens: int = 0
    retry_after_s: int | None = None
    error_type: str = "invalid_request_error"


Decision = Route | Refusal
