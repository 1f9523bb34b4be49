"""Exact counts run in a worker process with a bounded queue, and never stall the event loop."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from corpus.cases import text

from kvgate.estimate import PromptCosts, build_estimator, calibration
from kvgate.estimate.estimator import Estimator, TokenEstimate, Unavailable
from kvgate.estimate.exact import TokenizerFile
from kvgate.estimate.fast import FastEstimator
from kvgate.request.shape import Api, RequestShape

LIMITS = (4096, 16384)


def near_threshold_shape(budget: int) -> RequestShape:
    # ~15k tokens of prose plus the budget: close enough to 16384 that only an exact count decides.
    return RequestShape(Api.CHAT, None, (text("english")[:56000],), messages=1, output_budget=budget)


async def _max_gap_while(coroutine: asyncio.Future[object] | asyncio.Task[object]) -> float:
    worst = 0.0
    last = time.perf_counter()
    while not coroutine.done():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst = max(worst, now - last - 0.001)
        last = now
    return worst


@pytest.mark.slow
def test_exact_counts_run_off_the_event_loop(sp_model_path: Path) -> None:
    estimator = build_estimator(sp_model_path, PromptCosts())

    # About 230k tokens, with a limit right at its exact total so that all of it must be counted.
    huge = RequestShape(Api.CHAT, None, (text("english") * 5,), messages=1, output_budget=1000)
    total = estimator.count_sync(huge).total

    async def main() -> None:
        warm = await estimator.estimate(near_threshold_shape(1000), LIMITS)
        assert warm.method == "exact"
        task = asyncio.ensure_future(estimator.estimate(huge, (total - 1,)))
        gap = await _max_gap_while(task)
        result = await task
        assert result.method == "exact"
        assert result.total > total - 1
        # Generous on a shared 2-core machine: the same count on the loop would stall it for ~1 s.
        assert gap < 0.05

    try:
        asyncio.run(main())
    finally:
        estimator.close()


def test_the_count_queue_is_bounded(sp_model_path: Path) -> None:
    tokenizer = TokenizerFile.open(sp_model_path)
    fast = FastEstimator(calibration.for_tokenizer(tokenizer))
    limited = Estimator(fast, tokenizer, PromptCosts(), ThreadPoolExecutor(1), max_pending=1)

    async def main() -> None:
        first = asyncio.ensure_future(limited.estimate(near_threshold_shape(1000), LIMITS))
        await asyncio.sleep(0)
        refused = await limited.estimate(near_threshold_shape(1000), LIMITS)
        assert isinstance(refused, Unavailable) and "too many long prompts" in refused.message
        assert (await first).method == "exact"
        assert (await limited.estimate(near_threshold_shape(1000), LIMITS)).method == "exact"

    try:
        asyncio.run(main())
    finally:
        limited.close()


@pytest.mark.slow
def test_a_killed_worker_is_replaced(sp_model_path: Path) -> None:
    estimator = build_estimator(sp_model_path, PromptCosts())

    async def main() -> None:
        assert (await estimator.estimate(near_threshold_shape(1000), LIMITS)).method == "exact"
        (worker,) = multiprocessing.active_children()
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        outcomes = []
        for _ in range(2):
            result = await estimator.estimate(near_threshold_shape(1000), LIMITS)
            outcomes.append(result.method if isinstance(result, TokenEstimate) else "unavailable")
        # The count in flight when the worker died (if any) is unavailable (a 503); the next one works.
        assert outcomes[-1] == "exact"
        assert set(outcomes) <= {"exact", "unavailable"}

    try:
        asyncio.run(main())
    finally:
        estimator.close()
