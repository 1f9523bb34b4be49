"""Turn a RequestShape into a TokenEstimate, counting exactly only when the class is in doubt.

The gate only needs to know which side of each threshold a request falls on. The fast estimate gives
a band [low, high] of prompt tokens; when no threshold falls inside the band the fast answer decides,
otherwise the exact tokenizer counts (off the event loop) and decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Literal, Protocol

from kvgate.request.shape import RequestShape

Method = Literal["fast", "exact"]


@dataclass(frozen=True, slots=True)
class TextBand:
    """An estimate of one text's tokens with bounds the true count is expected to lie within."""

    tokens: int
    low: int
    high: int


class FastEstimator(Protocol):
    def estimate(self, text: str) -> TextBand: ...


class ExactCounter(Protocol):
    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class PromptCosts:
    """Tokens a request costs beyond its text, from the model's configuration."""

    image_tokens: int = 1024
    message_overhead_tokens: int = 4
    default_output_tokens: int = 1024


@dataclass(frozen=True, slots=True)
class TokenEstimate:
    prompt_tokens: int
    output_tokens: int
    method: Method

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.output_tokens


class Estimator:
    """Estimates a request's tokens for one model (one tokenizer, one set of costs)."""

    def __init__(
        self,
        fast: FastEstimator,
        exact: ExactCounter | None,
        costs: PromptCosts,
        executor: Executor | None = None,
    ) -> None:
        self._fast = fast
        self._exact = exact
        self._costs = costs
        self._executor = executor

    def output_tokens(self, shape: RequestShape) -> int:
        if shape.output_budget is not None:
            return shape.output_budget
        return self._costs.default_output_tokens * shape.n

    def fixed_prompt_tokens(self, shape: RequestShape) -> int:
        return (
            shape.token_ids
            + shape.images * self._costs.image_tokens
            + shape.messages * self._costs.message_overhead_tokens
        )

    def fast_band(self, shape: RequestShape) -> TextBand:
        tokens = low = high = 0
        for text in shape.texts:
            band = self._fast.estimate(text)
            tokens += band.tokens
            low += band.low
            high += band.high
        return TextBand(tokens, low, high)

    def needs_exact(self, shape: RequestShape, band: TextBand, thresholds: Sequence[int]) -> bool:
        if self._exact is None or not shape.texts:
            return False
        extra = self.fixed_prompt_tokens(shape) + self.output_tokens(shape)
        return any(band.low + extra <= limit < band.high + extra for limit in thresholds)

    def _count_exact(self, texts: tuple[str, ...]) -> int:
        assert self._exact is not None
        return sum(self._exact.count(text) for text in texts)

    def _result(self, shape: RequestShape, text_tokens: int, method: Method) -> TokenEstimate:
        return TokenEstimate(
            prompt_tokens=text_tokens + self.fixed_prompt_tokens(shape),
            output_tokens=self.output_tokens(shape),
            method=method,
        )

    def estimate_sync(self, shape: RequestShape, thresholds: Sequence[int]) -> TokenEstimate:
        band = self.fast_band(shape)
        if self.needs_exact(shape, band, thresholds):
            return self._result(shape, self._count_exact(shape.texts), "exact")
        return self._result(shape, band.tokens, "fast")

    async def estimate(self, shape: RequestShape, thresholds: Sequence[int]) -> TokenEstimate:
        band = self.fast_band(shape)
        if not self.needs_exact(shape, band, thresholds):
            return self._result(shape, band.tokens, "fast")
        loop = asyncio.get_running_loop()
        counted = await loop.run_in_executor(self._executor, self._count_exact, shape.texts)
        return self._result(shape, counted, "exact")
