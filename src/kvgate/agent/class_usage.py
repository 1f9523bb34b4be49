"""What each class of traffic has cost a node, in all: KV token-seconds and prefill tokens, per class.

Pure. Two classes, told apart the only way an agent can: `long` is what reservations hold (every
long request reserves), `chat` is the rest of the engine's use (chat never reserves). So on a node
the gate keeps for long requests, chat's figures stay near zero, and on an interactive node that
lends, long's figures are what it lent. Summed over a pool's nodes they say how much KV and prefill
each class really used, which is what an operator sizes the roles from (docs/operations.md,
"Soft pools").

- KV token-seconds: the tokens each class held, integrated over time from one scrape to the next
  (the value seen at a scrape holds until the next). Long's are its reservations (what it took from
  admission, output budget included), chat's the engine's used tokens less those.
- Prefill tokens: long's are the uncached prompt of each grant (its prompt less the blocks the
  engine was expected to find cached); chat's are what the engine prefilled (its prompt-token
  counter, less its prefix-cache hits where it counts them) less long's, never going back. Where the
  engine publishes no prompt counter, chat's prefill is unknown (None), never zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClassFigures:
    """Totals since the agent started."""

    long_kv_token_seconds: float
    chat_kv_token_seconds: float | None
    long_prefill_tokens: int
    chat_prefill_tokens: int | None


class ClassUsage:
    def __init__(self) -> None:
        self._last: tuple[float, int, int | None] | None = None  # time, long tokens, chat tokens
        self._long_kv = 0.0
        self._chat_kv: float | None = None
        self._long_prefill = 0
        self._engine_prefill = 0  # what the engine prefilled since the agent started (restarts summed)
        self._engine_counter: int | None = None  # its last counter reading
        self._chat_prefill: int | None = None

    def observe(self, now: float, reserved_tokens: int, used_tokens: int | None) -> None:
        """One scrape: what reservations hold and what the engine says it uses (None: unknown)."""
        if self._last is not None:
            then, long_tokens, chat_tokens = self._last
            elapsed = max(0.0, now - then)
            self._long_kv += long_tokens * elapsed
            if chat_tokens is not None:
                self._chat_kv = (self._chat_kv or 0.0) + chat_tokens * elapsed
        chat = None if used_tokens is None else max(0, used_tokens - reserved_tokens)
        self._last = (now, reserved_tokens, chat)

    def observe_prefill(self, prompt_tokens_total: int | None, prefix_hits_total: int | None) -> None:
        """One scrape of the engine's counters: prompt tokens (and the prefix-cache hits among them)."""
        if prompt_tokens_total is None:
            return
        counter = prompt_tokens_total - (prefix_hits_total or 0)
        before, self._engine_counter = self._engine_counter, counter
        if before is None:
            return  # what the engine did before the agent started is nobody's here
        # A counter that went back is a restarted engine: it starts again from zero.
        self._engine_prefill += counter - before if counter >= before else counter
        chat = self._engine_prefill - self._long_prefill
        self._chat_prefill = max(self._chat_prefill or 0, chat)

    def granted(self, uncached_prompt_tokens: int) -> None:
        self._long_prefill += uncached_prompt_tokens

    def figures(self) -> ClassFigures:
        return ClassFigures(self._long_kv, self._chat_kv, self._long_prefill, self._chat_prefill)
