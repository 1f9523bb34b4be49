"""What the gate needs to know about one request, independent of the API it arrived through."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Api(enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    ANTHROPIC_MESSAGES = "anthropic_messages"


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The token-relevant content of one inference request.

    `texts` holds every piece of prompt text (message contents, tool schemas, instructions) already
    decoded from JSON, so an estimator never sees `\\uXXXX` escapes. `token_ids` counts prompt tokens
    the client sent as ids: those are exact. `output_budget` is max_tokens (or its synonyms) times `n`,
    or None when the client gave no budget and the model's default applies.
    """

    api: Api
    model: str | None
    texts: tuple[str, ...]
    token_ids: int = 0
    images: int = 0
    messages: int = 0
    output_budget: int | None = None
    n: int = 1
    stream: bool = False
