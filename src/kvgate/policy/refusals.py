"""The one table of refusals: for each Reason, the HTTP status, error code, error types, and when
the client may retry. Every refusal the gate answers (and the queue's) goes through `Refusals.answer`.

Client input that cannot be read is `invalid_request` (400); whatever else the gate or the queue did
not expect is `internal_error` (503, Retry-After 1 s), never a 500 or a broken stream.

The body takes the shape of the API the client called, so that each official SDK raises its own
typed exception with kvgate's message: OpenAI's error object (`{"error": {"message", "type",
"param", "code"}}`) for OpenAI paths, Anthropic's (`{"type": "error", "error": {"type", "message"}}`,
type names from https://docs.claude.com/en/api/errors) for `/v1/messages`. Both SDKs retry 429 and
5xx by themselves (honouring Retry-After) and raise at once on the rest.

A refusal the client may retry says when, three ways: `Retry-After` in whole seconds (rounded up, so
never too early), and the exact value in milliseconds as `x-kvgate-retry-after-ms` and as
`retry-after-ms`, the header both official SDKs read before Retry-After and wait exactly, without
jitter of their own, when it is at most 120 s (openai 3.57.0 `_base_client.py`,
`_parse_retry_after_header` and `_calculate_retry_timeout`; anthropic 2.14.0 `_base_client.py`, the
same). Whole seconds would put every client of a spread-out forecast back on the same second.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvgate.errors import BodyTooLargeError, InvalidRequestError, RequestError, UnsupportedEncodingError
from kvgate.names import REASON_HEADER, RETRY_AFTER_MS_HEADER, SDK_RETRY_AFTER_MS_HEADER, TOKENS_HEADER
from kvgate.policy.decision import Reason, Refusal
from kvgate.request.shape import Api


class RetryRule(enum.Enum):
    """When a refused client may come back (its Retry-After, unless the refusal knows better)."""

    NEVER = "never"  # the same request will be refused again: no Retry-After
    SOON = "soon"  # the gateway's own momentary overload: one second
    CAPACITY = "capacity"  # the pools are full: admission.retry_after_s, or the refusal's forecast
    QUOTA = "quota"  # the tenant's quota is spent: when its bucket holds the request again


@dataclass(frozen=True, slots=True)
class RefusalRule:
    status: int
    code: str
    openai_type: str
    anthropic_type: str
    retry: RetryRule


_N, _S, _C, _Q = RetryRule.NEVER, RetryRule.SOON, RetryRule.CAPACITY, RetryRule.QUOTA
_INVALID, _TOO_LARGE, _RATE, _OVERLOADED = (
    "invalid_request_error",
    "request_too_large",
    "rate_limit_error",
    "overloaded_error",
)

# fmt: off
RULES: Mapping[Reason, RefusalRule] = MappingProxyType({
    # 413 by default; refusals.too_long_status: 400 answers as OpenAI, vLLM and Anthropic do.
    Reason.TOO_LONG:             RefusalRule(413, "context_length_exceeded",      _INVALID, _TOO_LARGE, _N),
    Reason.BODY_TOO_LARGE:       RefusalRule(413, "request_too_large",            _INVALID, _TOO_LARGE, _N),
    Reason.INVALID:              RefusalRule(400, "invalid_request",              _INVALID, _INVALID, _N),
    Reason.UNSUPPORTED:          RefusalRule(415, "unsupported_request",          _INVALID, _INVALID, _N),
    Reason.UNSUPPORTED_ENCODING: RefusalRule(415, "unsupported_content_encoding", _INVALID, _INVALID, _N),
    Reason.UNKNOWN_PATH:         RefusalRule(404, "unknown_path", "not_found_error", "not_found_error", _N),
    Reason.OVERLOADED:           RefusalRule(503, "gateway_overloaded",    "server_error", _OVERLOADED, _S),
    Reason.SHED:                 RefusalRule(429, "pool_saturated",               _RATE, _RATE, _C),
    Reason.QUEUE_FULL:           RefusalRule(429, "no_capacity",                  _RATE, _RATE, _C),
    Reason.NO_CAPACITY:          RefusalRule(429, "no_capacity",                  _RATE, _RATE, _C),
    Reason.NO_HEALTHY_NODE:      RefusalRule(503, "no_healthy_node",       "server_error", _OVERLOADED, _C),
    # The tenant's quota is spent (Retry-After: when its bucket holds the request again), or its
    # reservations hold its most share of KV while others wait (Retry-After: the release forecast).
    Reason.TENANT_QUOTA:         RefusalRule(429, "tenant_quota_exceeded",        _RATE, _RATE, _Q),
    Reason.TENANT_SHARE:         RefusalRule(429, "tenant_share_exceeded",        _RATE, _RATE, _C),
    # What the gate or the queue did not expect (an exception: logged with the request id, counted);
    # never a stream error Envoy would fail open on, never a 500. Another try usually succeeds.
    Reason.INTERNAL_ERROR:       RefusalRule(503, "internal_error",        "server_error", "api_error", _S),
    # The queue's own. Held past queue.max_hold_s: the job is cancelled; the pools are full.
    Reason.HOLD_TIMEOUT:         RefusalRule(429, "queue_timeout",                _RATE, _RATE, _C),
    # Bigger than any node admits even idle (its status follows refusals.too_long_status too).
    Reason.EXCEEDS_NODE_CAPACITY: RefusalRule(413, "exceeds_node_capacity",       _INVALID, _TOO_LARGE, _N),
    Reason.STORE_UNAVAILABLE:    RefusalRule(503, "queue_unavailable",     "server_error", _OVERLOADED, _S),
    Reason.NOT_FOUND:            RefusalRule(404, "not_found",   "not_found_error", "not_found_error", _N),
    # A held request whose job was cancelled (DELETE /v1/kvgate/jobs/{id}, or its batch's cancel).
    Reason.JOB_CANCELLED:        RefusalRule(409, "job_cancelled",                _INVALID, _INVALID, _N),
    # The engine dropped the job on its last allowed attempt.
    Reason.ENGINE_FAILED:        RefusalRule(502, "engine_failed",         "server_error", "api_error", _S),
    # Envoy answers this one itself, from its route table, when the gate did not answer a request
    # whose body may be too long for the interactive pool (kvgate.envoyconfig.unanswered).
    Reason.GATE_UNAVAILABLE:     RefusalRule(503, "gate_unavailable",      "server_error", _OVERLOADED, _S),
    # Envoy answers this one itself too, when the node it routed to could not be reached before it
    # answered (kvgate.envoyconfig.upstream_failure).
    Reason.UPSTREAM_UNAVAILABLE: RefusalRule(503, "upstream_unavailable",  "server_error", _OVERLOADED, _S),
})
# fmt: on

_SOON_S = 1.0

_ERROR_REASONS: Mapping[type[RequestError], Reason] = MappingProxyType(
    {
        InvalidRequestError: Reason.INVALID,
        BodyTooLargeError: Reason.BODY_TOO_LARGE,
        UnsupportedEncodingError: Reason.UNSUPPORTED_ENCODING,
    }
)


def refusal_for(error: RequestError) -> Refusal:
    """The refusal of a request the gate could not interpret, by the error's class (400
    invalid_request for any other RequestError)."""
    reason = next((_ERROR_REASONS[kind] for kind in type(error).__mro__ if kind in _ERROR_REASONS), None)
    return Refusal(reason or Reason.INVALID, error.message)


# The answer to what the gate or the queue did not expect (an exception that is not the client's).
INTERNAL_ERROR = Refusal(Reason.INTERNAL_ERROR, "The gateway failed on this request; retry shortly.")


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """A refusal as HTTP: what any server (Envoy's ImmediateResponse, the queue's aiohttp) sends."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


class Refusals:
    """The table with this deployment's settings applied: the status of a too-long request, and the
    Retry-After of a full pool."""

    def __init__(self, too_long_status: int = 413, capacity_retry_after_s: float = 2.0) -> None:
        rules = dict(RULES)
        if too_long_status != 413:
            for reason in (Reason.TOO_LONG, Reason.EXCEEDS_NODE_CAPACITY):
                rules[reason] = RefusalRule(too_long_status, rules[reason].code, _INVALID, _INVALID, _N)
        self._rules = rules
        self._capacity_retry_after_s = capacity_retry_after_s

    def rule(self, reason: Reason) -> RefusalRule:
        return self._rules[reason]

    def status(self, reason: Reason) -> int:
        return self._rules[reason].status

    def retry_after_s(self, refusal: Refusal) -> float | None:
        """None when the client should not retry the same request."""
        retry = self._rules[refusal.reason].retry
        if retry is RetryRule.NEVER:
            return None
        if refusal.retry_after_s is not None:
            return refusal.retry_after_s
        return _SOON_S if retry is RetryRule.SOON else self._capacity_retry_after_s

    def answer(self, refusal: Refusal, api: Api | None) -> HttpAnswer:
        rule = self._rules[refusal.reason]
        headers = [("content-type", "application/json"), (REASON_HEADER, refusal.reason.value)]
        if refusal.tokens:
            headers.append((TOKENS_HEADER, str(refusal.tokens)))
        wait = self.retry_after_s(refusal)
        if wait is not None:
            # Retry-After takes whole seconds; rounding up never invites a client back too early.
            headers.append(("retry-after", str(max(1, math.ceil(wait)))))
            milliseconds = str(max(1, round(wait * 1000)))
            headers += [(RETRY_AFTER_MS_HEADER, milliseconds), (SDK_RETRY_AFTER_MS_HEADER, milliseconds)]
        return HttpAnswer(rule.status, tuple(headers), error_body(rule, refusal.message, api))


def error_body(rule: RefusalRule, message: str, api: Api | None) -> bytes:
    if api is Api.ANTHROPIC_MESSAGES:
        return json.dumps(
            {"type": "error", "error": {"type": rule.anthropic_type, "message": message}}
        ).encode()
    error = {"message": message, "type": rule.openai_type, "param": None, "code": rule.code}
    return json.dumps({"error": error}).encode()


def table_markdown() -> str:
    """The table as docs/operations.md prints it (a test keeps the two the same)."""
    lines = [
        "| reason | status | code | OpenAI type | Anthropic type | Retry-After |",
        "|---|---|---|---|---|---|",
    ]
    retry = {
        _N: "none (do not retry as is)",
        _S: f"{_SOON_S:g} s",
        _C: "forecast from the agents (`admission.retry_after`), else `admission.retry_after_s`",
        _Q: "when the tenant's quota holds the request again (`fairness.tenants.NAME.quota`)",
    }
    for reason, rule in RULES.items():
        lines.append(
            f"| `{reason.value}` | {rule.status} | `{rule.code}` | `{rule.openai_type}` | "
            f"`{rule.anthropic_type}` | {retry[rule.retry]} |"
        )
    return "\n".join(lines)
