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
        self._prompt_counter: int | None = None  # the engine's prompt-token counter, last read
        self._hits_counter: int | None = None  # its prefix-cache hit counter, last read
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
        # Each counter on its own: an engine may count a hit before the prefill it belongs to ends, so
        # their difference can step back without any restart.
        prompted = _advance(self._prompt_counter, prompt_tokens_total)
        hit = _advance(self._hits_counter, prefix_hits_total) if prefix_hits_total is not None else 0
        self._prompt_counter, self._hits_counter = prompt_tokens_total, prefix_hits_total
        if prompted is None:
            return  # what the engine did before the agent started is nobody's here
        self._engine_prefill += prompted - (hit or 0)
        chat = self._engine_prefill - self._long_prefill
        self._chat_prefill = max(self._chat_prefill or 0, chat)

    def granted(self, uncached_prompt_tokens: int) -> None:
        self._long_prefill += uncached_prompt_tokens

    def figures(self) -> ClassFigures:
        return ClassFigures(self._long_kv, self._chat_kv, self._long_prefill, self._chat_prefill)


def _advance(before: int | None, now: int) -> int | None:
    """What a counter added since `before` (None: no earlier reading); a counter that went back is a
    restarted engine, counting again from zero."""
    if before is None:
        return None
    return now - before if now >= before else now
