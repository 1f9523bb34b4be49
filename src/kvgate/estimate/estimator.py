"""Turn a RequestShape into a TokenEstimate, counting exactly only when the class is in doubt.

The gate only needs to know which side of each threshold a request falls on. The fast estimate gives
a band [low, high] of prompt tokens; when no threshold falls inside the band the fast answer decides,
otherwise the exact tokenizer counts (off the event loop, in an executor the estimator owns) and
stops as soon as the class is certain. At most `max_pending` counts wait or run at once; past that
the estimator answers `Unavailable` (the gateway's own overload, which the gate refuses with a
retryable 503) rather than queue without bound.

Each complete exact count also measures the fast estimate on the traffic served, and a fast answer's
point estimate is corrected by what they showed, inside its band (kvgate.estimate.correction).

Without a tokenizer nothing can be counted, so a band that reaches across a threshold is settled on
its safe side (`decide.safe_total`): across a pool boundary the request goes to the larger pool (an
interactive engine would refuse it; the long pool costs only capacity), and it is refused as too long
only when its whole band lies above the limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Literal

from kvgate.estimate import decide
from kvgate.estimate.correction import LiveCorrection
from kvgate.estimate.exact import TokenizerFile
from kvgate.estimate.fast import FastEstimator, TextBand
from kvgate.request.shape import RequestShape

Method = Literal["fast", "exact"]


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
    # Exact counts that stopped early: the class is exact, prompt_tokens is partly estimated.
    complete: bool = True
    # No tokenizer, and the band reached across a threshold: prompt_tokens was moved to its safe side
    # from this estimate (None: not moved).
    unrounded_prompt_tokens: int | None = None

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def rounded(self) -> bool:
        return self.unrounded_prompt_tokens is not None

    @property
    def likely_prompt_tokens(self) -> int:
        """The likeliest prompt count. Routing and reserving take the safe side of a threshold; a
        tenant's fair-share charge takes this, or a tenant of prompts just under a threshold is charged
        the distance to it: 3,000-token prompts were charged 3,585 on the fairness benchmark."""
        return self.prompt_tokens if self.unrounded_prompt_tokens is None else self.unrounded_prompt_tokens


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The exact count a request needed cannot run now: the counter is full or broken."""

    message: str


class Estimator:
    """Estimates a request's tokens for one model (one tokenizer, one set of costs)."""

    def __init__(
        self,
        fast: FastEstimator,
        exact: TokenizerFile | None,
        costs: PromptCosts,
        executor: Executor | None = None,
        max_pending: int = 16,
    ) -> None:
        self._fast = fast
        self._exact = exact
        self._costs = costs
        self._executor = executor
        self._max_pending = max_pending
        self._pending = 0
        # What the exact counts say the fast estimate misses on this traffic (kvgate.estimate.correction).
        self.correction = LiveCorrection()

    @property
    def pending(self) -> int:
        """Exact counts waiting or running now (at most `max_pending`)."""
        return self._pending

    def close(self) -> None:
        """Stop the executor's workers and wait for them (a worker process is gone when this returns)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Estimator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        return self._fast.estimate_all(shape.texts)

    def _extra(self, shape: RequestShape) -> int:
        return self.fixed_prompt_tokens(shape) + self.output_tokens(shape)

    def needs_exact(self, shape: RequestShape, band: TextBand, thresholds: Sequence[int]) -> bool:
        if self._exact is None or not shape.texts:
            return False
        extra = self._extra(shape)
        return not decide.settled(band.low + extra, band.high + extra, thresholds)

    def _job(self, shape: RequestShape, thresholds: Sequence[int]) -> decide.CountJob:
        assert self._exact is not None
        return decide.CountJob(self._exact, self._fast, shape.texts, self._extra(shape), tuple(thresholds))

    def _result(
        self,
        shape: RequestShape,
        text_tokens: int,
        method: Method,
        complete: bool,
        unrounded_text_tokens: int | None = None,
    ) -> TokenEstimate:
        fixed = self.fixed_prompt_tokens(shape)
        return TokenEstimate(
            prompt_tokens=text_tokens + fixed,
            output_tokens=self.output_tokens(shape),
            method=method,
            complete=complete,
            unrounded_prompt_tokens=None if unrounded_text_tokens is None else unrounded_text_tokens + fixed,
        )

    def _fast_answer(self, shape: RequestShape, band: TextBand, thresholds: Sequence[int]) -> TokenEstimate:
        """The answer when no exact count runs: the estimate, settled on the safe side of any threshold
        its band reaches across when there is no tokenizer to count with."""
        if self._exact is not None or not shape.texts:
            return self._result(shape, self.correction.corrected(band), "fast", True)
        extra = self._extra(shape)
        estimate = band.tokens + extra
        total = decide.safe_total(estimate, band.low + extra, band.high + extra, thresholds)
        unrounded = band.tokens if total != estimate else None
        return self._result(shape, total - extra, "fast", True, unrounded)

    def _counted(self, shape: RequestShape, band: TextBand, counted: decide.Counted) -> TokenEstimate:
        if counted.complete:
            self.correction.observe(band.tokens, counted.tokens)
        return self._result(shape, counted.tokens, "exact", counted.complete)

    def fast_estimate(self, shape: RequestShape) -> TokenEstimate:
        """The fast estimate alone, whatever the thresholds."""
        return self._result(shape, self.fast_band(shape).tokens, "fast", True)

    def estimate_sync(self, shape: RequestShape, thresholds: Sequence[int]) -> TokenEstimate:
        """The gate's answer, computed in the calling thread (command line, benchmarks)."""
        band = self.fast_band(shape)
        if self.needs_exact(shape, band, thresholds):
            return self._counted(shape, band, decide.run(self._job(shape, thresholds)))
        return self._fast_answer(shape, band, thresholds)

    def count_sync(self, shape: RequestShape) -> TokenEstimate:
        """The full exact count, whatever the thresholds; the fast estimate without a tokenizer."""
        if self._exact is None:
            return self.fast_estimate(shape)
        return self._counted(shape, self.fast_band(shape), decide.run(self._job(shape, ())))

    async def estimate(self, shape: RequestShape, thresholds: Sequence[int]) -> TokenEstimate | Unavailable:
        band = self.fast_band(shape)
        if not self.needs_exact(shape, band, thresholds):
            return self._fast_answer(shape, band, thresholds)
        if self._pending >= self._max_pending:
            return Unavailable("The gateway is counting too many long prompts right now; retry shortly.")
        self._pending += 1
        try:
            loop = asyncio.get_running_loop()
            counted = await loop.run_in_executor(self._executor, decide.run, self._job(shape, thresholds))
        except BrokenProcessPool:
            return Unavailable("The gateway's token counter failed; retry shortly.")
        finally:
            self._pending -= 1
        return self._counted(shape, band, counted)
