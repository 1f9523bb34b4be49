"""Every error the queue answers itself, as the gate answers its own: through the one refusal table
(`kvgate.policy.refusals`), with the queue's Retry-After (queue.retry_after_s), so a client cannot
tell which of the two refused. The queue-only reasons (hold_timeout, exceeds_node_capacity, …) are
rows of that table too.
"""

from __future__ import annotations

from kvgate.config import Config
from kvgate.policy.decision import Reason, Refusal
from kvgate.policy.refusals import HttpAnswer, RefusalRule, Refusals
from kvgate.request.shape import Api


class QueueRefusals:
    def __init__(self, config: Config) -> None:
        self._table = Refusals(config.refusals.too_long_status, config.queue.retry_after_s)

    def gate(self, refusal: Refusal, api: Api | None = None) -> HttpAnswer:
        """A refusal of the gate's kinds, through its table."""
        return self._table.answer(refusal, api)

    def queue_full(self, why: str, tokens: int, api: Api | None = None) -> HttpAnswer:
        return self.gate(Refusal(Reason.QUEUE_FULL, f"The queue is full: {why}. Retry later.", tokens), api)

    def queue(self, reason: Reason, message: str, api: Api | None = None) -> HttpAnswer:
        return self._table.answer(Refusal(reason, message), api)

    def rule(self, reason: Reason) -> RefusalRule:
        return self._table.rule(reason)

    def code(self, reason: Reason) -> str:
        """The error code a gate refusal carries (a batch line's error in its error file)."""
        return self._table.rule(reason).code

    def invalid(self, message: str) -> HttpAnswer:
        return self.gate(Refusal(Reason.INVALID, message))

    def not_found(self, what: str) -> HttpAnswer:
        return self.queue(Reason.NOT_FOUND, f"No {what}.")

    def store_unavailable(self) -> HttpAnswer:
        return self.queue(Reason.STORE_UNAVAILABLE, "The queue's store cannot be reached; retry shortly.")

    def hold_timeout(self, hold_s: float, api: Api | None) -> HttpAnswer:
        return self.queue(
            Reason.HOLD_TIMEOUT,
            f"No node had room for this request within {hold_s:g} s; it was cancelled. Retry later, or "
            "send it with `Prefer: respond-async` to get a job to poll.",
            api,
        )
