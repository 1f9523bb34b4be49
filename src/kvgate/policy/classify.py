"""The token classes and the one rule that assigns them. Used by the gate and by `kvgate estimate`."""

from __future__ import annotations

import enum

from kvgate.config import ModelConfig
from kvgate.policy.decision import Decision, Reason, Refusal, Route


class TokenClass(enum.StrEnum):
    INTERACTIVE = "interactive"
    LONG = "long"
    TOO_LONG = "too_long"


def thresholds(model: ModelConfig) -> tuple[int, int]:
    """The totals at which a request changes class: the estimator counts exactly only near these."""
    return (model.interactive_max_tokens, model.max_total_tokens)


def classify(total_tokens: int, model: ModelConfig) -> TokenClass:
    if total_tokens > model.max_total_tokens:
        return TokenClass.TOO_LONG
    if total_tokens <= model.interactive_max_tokens:
        return TokenClass.INTERACTIVE
    return TokenClass.LONG


def decide(prompt_tokens: int, output_tokens: int, model: ModelConfig) -> Decision:
    """Route by total = prompt + output budget; a total over the model's limit is refused."""
    total = prompt_tokens + output_tokens
    token_class = classify(total, model)
    if token_class is TokenClass.INTERACTIVE:
        return Route(model.pools.interactive, Reason.SHORT, total)
    if token_class is TokenClass.LONG:
        return Route(model.pools.long, Reason.LONG, total)
    return Refusal(
        Reason.TOO_LONG,
        (
            f"This request needs {total} tokens ({prompt_tokens} in the prompt plus {output_tokens} "
            f"of output budget), more than this gateway's limit of {model.max_total_tokens} tokens. "
            "Shorten the prompt or lower max_tokens."
        ),
        total,
    )
