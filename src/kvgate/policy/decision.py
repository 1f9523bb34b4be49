"""What the gate decided for one request: a route to a pool, or a refusal with a clear reason.

A full pool is not an exception: it is a Refusal returned like any other decision. A Refusal holds
only why and what to tell the client; its status, error code, error type and Retry-After come from
the one table in `kvgate.policy.refusals`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(enum.StrEnum):
    """Why a request went where it went. A bounded set: these are metric label values too."""

    SHORT = "short"
    LONG = "long"
    ASYNC = "async"
    UNPARSED = "unparsed"
    NO_BODY = "no_body"
    # Refusals (see kvgate.policy.refusals for what each becomes in HTTP).
    TOO_LONG = "too_long"
    BODY_TOO_LARGE = "body_too_large"
    INVALID = "invalid_request"
    UNSUPPORTED = "unsupported"
    UNSUPPORTED_ENCODING = "unsupported_encoding"
    UNKNOWN_PATH = "unknown_path"
    OVERLOADED = "overloaded"
    SHED = "shed"
    QUEUE_FULL = "queue_full"
    NO_CAPACITY = "no_capacity"
    NO_HEALTHY_NODE = "no_healthy_node"
    # A tenant's own caps (fairness: quota, max_kv_share; kvgate.policy.tenant_limits).
    TENANT_QUOTA = "tenant_quota"
    TENANT_SHARE = "tenant_share"
    # The gate or the queue failed on the request in a way it did not expect (a bug, not the client).
    INTERNAL_ERROR = "internal_error"
    # Refusals only the async queue (`kvgate queue`) makes.
    HOLD_TIMEOUT = "hold_timeout"
    EXCEEDS_NODE_CAPACITY = "exceeds_node_capacity"
    STORE_UNAVAILABLE = "store_unavailable"
    NOT_FOUND = "not_found"
    JOB_CANCELLED = "job_cancelled"
    ENGINE_FAILED = "engine_failed"
    # Envoy's own, without the gate: the gate did not answer a request too big to fail open to the
    # interactive pool (kvgate.envoyconfig.unanswered).
    GATE_UNAVAILABLE = "gate_unavailable"
    # Envoy's own, in place of its plain-text 503: the node a request was routed to refused the
    # connection or reset it before answering (kvgate.envoyconfig.upstream_failure).
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    reason: Reason
    tokens: int = 0
    # Set when the request is pinned to one node's engine (long requests with headroom).
    endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: Reason
    message: str
    tokens: int = 0
    # When the client may come back, where the refusal knows better than its reason's rule.
    retry_after_s: float | None = None


Decision = Route | Refusal
