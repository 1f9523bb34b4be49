"""The bounded, priority-ordered wait for capacity. Only the head of the queue tries to reserve.

Letting only the head try keeps the order honest: a low-priority request that happens to fit cannot
overtake a high-priority one that is waiting for room. Everyone is woken on every change (a headroom
update, a release, the head leaving), and whoever is head then tries.

Waits end on the queue's injected clock: `MONOTONIC` in the gate, a test's manual clock in tests,
which then drive time instead of sleeping.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds, and a sleep measured on the same clock."""

    def __call__(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class _Monotonic:
    """time.monotonic and asyncio.sleep (the event loop's clock is time.monotonic)."""

    def __call__(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


MONOTONIC: Clock = _Monotonic()


class WaitQueue:
    def __init__(self, size: int, clock: Clock = MONOTONIC) -> None:
        self._size = size
        self._clock = clock
        self._heap: list[tuple[int, int]] = []
        self._order = itertools.count()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._heap)

    def join(self, rank: int) -> tuple[int, int] | None:
        """A place in the queue, or None when the queue is full."""
        if len(self._heap) >= self._size:
            return None
        place = (rank, next(self._order))
        heapq.heappush(self._heap, place)
        return place

    def is_head(self, place: tuple[int, int]) -> bool:
        return bool(self._heap) and self._heap[0] == place

    def leave(self, place: tuple[int, int]) -> None:
        was_head = self.is_head(place)
        self._heap.remove(place)
        heapq.heapify(self._heap)
        if was_head:
            self.pulse()

    def pulse(self) -> None:
        """Something changed: wake every waiter."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, deadline: float) -> None:
        """Until something changes or the queue's clock reaches `deadline`, whichever comes first."""
        # Not asyncio.wait_for: on Python 3.11 it can swallow a cancel that meets a set event.
        changed = asyncio.ensure_future(self._changed.wait())
        timer = asyncio.ensure_future(self._clock.sleep(deadline - self._clock()))
        try:
            await asyncio.wait((changed, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            timer.cancel()
