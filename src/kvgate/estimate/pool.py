"""The worker process that runs exact counts, restarted if it dies.

A process rather than a thread: the tokenizer libraries hold the GIL for parts of a count, and a
process keeps even a 200k-token count from stalling the gate's event loop. If the worker is killed
(out of memory, say), the counts it held fail and the next one starts a fresh worker.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import ParamSpec, TypeVar

from kvgate.estimate.decide import start_worker
from kvgate.estimate.exact import TokenizerFile

P = ParamSpec("P")
T = TypeVar("T")


class CountingPool(Executor):
    def __init__(self, tokenizer: TokenizerFile, workers: int = 1) -> None:
        self._tokenizer = tokenizer
        self._workers = workers
        self._pool = self._start()
        # Start the worker now (it loads the tokenizer) rather than on the first long request.
        self._pool.submit(int)

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self._workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=start_worker,
            initargs=(self._tokenizer,),
        )

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        try:
            return self._pool.submit(fn, *args, **kwargs)
        except BrokenProcessPool:
            self._pool.shutdown(wait=False)
            self._pool = self._start()
            return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
