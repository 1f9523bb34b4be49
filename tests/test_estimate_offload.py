"""Exact counts run in a worker process with a bounded queue, and never stall the event loop."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from corpus.cases import text
from leftovers import alive
from waiting import until

from kvgate.estimate import PromptCosts, build_estimator, calibration
from kvgate.estimate.estimator import Estimator, TokenEstimate, Unavailable
from kvgate.estimate.exact import TokenizerFile
from kvgate.estimate.fast import FastEstimator
from kvgate.request.shape import Api, RequestShape

LIMITS = (4096, 16384)


def near_threshold_shape(budget: int) -> RequestShape:
    # ~15k tokens of prose plus the budget: close enough to 16384 that only an exact count decides.
    return RequestShape(Api.CHAT, None, (text("english")[:56000],), messages=1, output_budget=budget)


async def _ticks_while(task: asyncio.Future[object]) -> tuple[int, float]:
    """How often a 1 ms ticker ran while `task` did, and its longest gap."""
    ticks, worst = 0, 0.0
    last = time.perf_counter()
    while not task.done():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        ticks, worst = ticks + 1, max(worst, now - last - 0.001)
        last = now
    return ticks, worst


@pytest.mark.slow
def test_exact_counts_run_off_the_event_loop(sp_model_path: Path) -> None:
    """A count on the loop would stall it for the whole count. Off the loop, the loop keeps ticking
    while it runs, with gaps that are a small part of it however loaded the machine is (the stall
    itself, in milliseconds, is `python -m bench estimate`'s figure)."""
    # About 230k tokens, with a limit right at its exact total so that all of it must be counted.
    huge = RequestShape(Api.CHAT, None, (text("english") * 5,), messages=1, output_budget=1000)

    async def main(estimator: Estimator, total: int) -> None:
        warm = await estimator.estimate(near_threshold_shape(1000), LIMITS)
        assert warm.method == "exact"
        started = time.perf_counter()
        task = asyncio.ensure_future(estimator.estimate(huge, (total - 1,)))
        ticks, gap = await _ticks_while(task)
        took = time.perf_counter() - started
        result = await task
        assert isinstance(result, TokenEstimate) and result.method == "exact"
        assert result.total > total - 1
        assert ticks >= 10, f"the loop ticked {ticks} times during a {took:.2f} s count"
        assert gap < took / 4, f"the loop stalled {gap:.3f} s of a {took:.2f} s count"

    with build_estimator(sp_model_path, PromptCosts()) as estimator:
        asyncio.run(main(estimator, estimator.count_sync(huge).total))


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
    async def main(estimator: Estimator) -> None:
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

    with build_estimator(sp_model_path, PromptCosts()) as estimator:
        asyncio.run(main(estimator))
    assert multiprocessing.active_children() == [], "closing the estimator stopped its worker"


OWNER = """
import multiprocessing, sys, time
from pathlib import Path
from kvgate.estimate import PromptCosts, build_estimator
estimator = build_estimator(Path(sys.argv[1]), PromptCosts())
print(*(child.pid for child in multiprocessing.active_children()), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_worker_whose_owner_is_killed_exits(sp_model_path: Path) -> None:
    """SIGKILL gives the gate no chance to stop its worker: the worker notices and leaves by itself."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(sp_model_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        (worker,) = map(int, owner.stdout.readline().split())
        assert alive(worker)
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    until(lambda: not alive(worker), "the orphaned worker to exit")
