"""The worker process that runs exact counts, restarted if it dies, gone when its owner is.

A process rather than a thread: the tokenizer libraries hold the GIL for parts of a count, and a
process keeps even a 200k-token count from stalling the gate's event loop. If the worker is killed
(out of memory, say), the counts it held fail and the next one starts a fresh worker.

The owner stops the worker with `shutdown()` (or a `with` block); at a normal interpreter exit the
standard library's own exit hook stops a pool nobody shut down. A worker whose owner was killed
(SIGKILL, an out-of-memory kill) would wait for work forever, so each worker watches the process that
started it and exits once that process is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import ParamSpec, TypeVar

from kvgate.estimate.decide import start_worker
from kvgate.estimate.exact import TokenizerFile

P = ParamSpec("P")
T = TypeVar("T")
# How often a worker checks that the process that started it is still there.
OWNER_CHECK_S = 1.0


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
            initializer=_start_worker,
            initargs=(self._tokenizer, os.getpid()),
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


def _start_worker(tokenizer: TokenizerFile, owner: int) -> None:
    """In the worker: leave when `owner` (the process that started this one) is gone, then set up."""
    threading.Thread(target=_exit_without, args=(owner,), name="kvgate-owner-watch", daemon=True).start()
    start_worker(tokenizer)


def _exit_without(owner: int) -> None:
    # A dead parent's children are handed to another process (init, or a subreaper): the parent pid
    # changes. Nothing is left to finish for an owner that is gone, so no clean-up is owed either.
    while os.getppid() == owner:
        time.sleep(OWNER_CHECK_S)
    os._exit(0)
