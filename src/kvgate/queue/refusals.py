"""Every error the queue answers itself, as the gate answers its own: the one place they are built.

Refusals the gate also makes (413 too long, 400 invalid, 429 queue full, ...) go through the gate's
table, `kvgate.policy.refusals`, with this deployment's settings. The few only the queue makes are
rows of the same shape below (same RefusalRule, same body in the shape of the API called, reason in
`x-kvgate-reason`, Retry-After by the same rules), so a client cannot tell which of the two refused.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from types import MappingProxyType

from kvgate.config import Config
from kvgate.names import REASON_HEADER
from kvgate.policy.decision import Reason, Refusal
from kvgate.policy.refusals import HttpAnswer, RefusalRule, Refusals, RetryRule, error_body
from kvgate.request.shape import Api


class QueueReason(enum.StrEnum):
    HOLD_TIMEOUT = "hold_timeout"
    EXCEEDS_NODE_CAPACITY = "exceeds_node_capacity"
    STORE_UNAVAILABLE = "store_unavailable"
    NOT_FOUND = "not_found"
    JOB_CANCELLED = "job_cancelled"
    ENGINE_FAILED = "engine_failed"


_N, _S, _C = RetryRule.NEVER, RetryRule.SOON, RetryRule.CAPACITY
_RATE = "rate_limit_error"

# fmt: off
QUEUE_RULES: Mapping[QueueReason, RefusalRule] = MappingProxyType({
    # Held past queue.max_hold_s: the job is cancelled; the pools are full, so come back later.
    QueueReason.HOLD_TIMEOUT:          RefusalRule(429, "queue_timeout", _RATE, _RATE, _C),
    # Bigger than any node admits even when idle (its status follows refusals.too_long_status).
    QueueReason.EXCEEDS_NODE_CAPACITY: RefusalRule(
        413, "exceeds_node_capacity", "invalid_request_error", "request_too_large", _N),
    QueueReason.STORE_UNAVAILABLE:     RefusalRule(
        503, "queue_unavailable", "server_error", "overloaded_error", _S),
    QueueReason.NOT_FOUND:             RefusalRule(
        404, "not_found", "not_found_error", "not_found_error", _N),
    # A held request whose job was cancelled by DELETE /v1/kvgate/jobs/{id} (or its batch's cancel).
    QueueReason.JOB_CANCELLED:         RefusalRule(
        409, "job_cancelled", "invalid_request_error", "invalid_request_error", _N),
    # The engine dropped the job on its last allowed attempt (or mid-answer to a held client).
    QueueReason.ENGINE_FAILED:         RefusalRule(502, "engine_failed", "server_error", "api_error", _S),
})
# fmt: on

_SOON_S = 1


class QueueRefusals:
    def __init__(self, config: Config) -> None:
        self._retry_after_s = config.queue.retry_after_s
        self._table = Refusals(config.refusals.too_long_status, config.queue.retry_after_s)
        rules = dict(QUEUE_RULES)
        too_long = self._table.status(Reason.TOO_LONG)
        big = rules[QueueReason.EXCEEDS_NODE_CAPACITY]
        rules[QueueReason.EXCEEDS_NODE_CAPACITY] = RefusalRule(
            too_long, big.code, big.openai_type, big.anthropic_type, big.retry
        )
        self._rules = rules

    def gate(self, refusal: Refusal, api: Api | None = None) -> HttpAnswer:
        """A refusal of the gate's kinds, through its table."""
        return self._table.answer(refusal, api)

    def queue_full(self, why: str, tokens: int, api: Api | None = None) -> HttpAnswer:
        return self.gate(Refusal(Reason.QUEUE_FULL, f"The queue is full: {why}. Retry later.", tokens), api)

    def queue(self, reason: QueueReason, message: str, api: Api | None = None) -> HttpAnswer:
        rule = self._rules[reason]
        headers = [("content-type", "application/json"), (REASON_HEADER, reason.value)]
        if rule.retry is not RetryRule.NEVER:
            wait = _SOON_S if rule.retry is RetryRule.SOON else self._retry_after_s
            headers.append(("retry-after", str(max(1, math.ceil(wait)))))
        return HttpAnswer(rule.status, tuple(headers), error_body(rule, message, api))

    def code(self, reason: Reason) -> str:
        """The error code a gate refusal carries (a batch line's error in its error file)."""
        return self._table.rule(reason).code

    def invalid(self, message: str) -> HttpAnswer:
        return self.gate(Refusal(Reason.INVALID, message))

    def not_found(self, what: str) -> HttpAnswer:
        return self.queue(QueueReason.NOT_FOUND, f"No {what}.")

    def store_unavailable(self) -> HttpAnswer:
        return self.queue(
            QueueReason.STORE_UNAVAILABLE, "The queue's store cannot be reached; retry shortly."
        )

    def hold_timeout(self, hold_s: float, api: Api | None) -> HttpAnswer:
        return self.queue(
            QueueReason.HOLD_TIMEOUT,
            f"No node had room for this request within {hold_s:g} s; it was cancelled. Retry later, or "
            "send it with `Prefer: respond-async` to get a job to poll.",
            api,
        )
