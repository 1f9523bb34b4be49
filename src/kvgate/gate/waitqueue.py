"""The gate's bounded line of requests waiting for capacity, in the one waiting order.

A waiter's place is its rank (0 most important), then since when it waits by the wall clock, the same
order every gate replica and `kvgate queue` send the agents with each Reserve (kvgate.agent.backfill).
When room may have freed, only the head is woken, and each waiter behind it that the caller's `fits`
says fits now without touching the head's slot (EASY backfilling: kvgate.headroom.shadow); the rest
sleep on. Waking every waiter on every change made each of them a task that read the view and
found nothing, many times a second under load.

With fair shares (kvgate.policy.fair_share) the line is ordered by `order`: rank first still, then the
waiter's tenant's weighted attained service, then since when it waits. That changes as requests are
admitted, so the caller `reorder`s the line after each, and a new head is woken.

A full line turns away a newcomer only when it would stand last. One that goes ahead of the last
waiter takes that waiter's place, and the last is pushed out (woken, to be answered as the full line
would have answered it): a higher priority pushes out a lower, and with fair shares the least-served
tenant's request pushes out the most-served one's. Otherwise a tenant that floods fills the line, and
every other tenant's requests are turned away at once while its own wait their turn. (Fair queueing's
buffer policy makes the same choice, dropping from the flow that holds the most buffer rather than the
arriving packet: Demers, Keshav and Shenker, SIGCOMM'89.)

A wake is never lost: a waiter woken while it is busy trying finds its wake on its next wait.
Waits end on the queue's injected clock: `MONOTONIC` in the gate, a test's manual clock in tests,
which then drive time instead of sleeping.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True, order=True)
class Place:
    """A waiter's place in the line: rank, then waiting since (wall clock, ns), then joining order."""

    rank: int
    waiting_since_unix_ns: int
    seq: int
    tokens: int = field(compare=False)
    tenant: str = field(compare=False, default="")


# A waiter's place in a fair line: any sortable key, least first.
Order = Callable[[Place], tuple[float, ...]]


def arrival(place: Place) -> tuple[float, ...]:
    """The one waiting order without fair shares: rank, then since when it waits."""
    return (place.rank, place.waiting_since_unix_ns, place.seq)


class WaitQueue:
    def __init__(self, size: int, clock: Clock = MONOTONIC, order: Order = arrival) -> None:
        self._size = size
        self._clock = clock
        self._order_of = order
        self._line: list[Place] = []  # in order: the head first
        self._woken: dict[Place, asyncio.Event] = {}
        self._pushed_out: set[Place] = set()  # out of the line, until their waiter leaves
        self._order = itertools.count()
        self.wakeups = 0  # wakes sent to waiters, in all: what pulses cost

    def __len__(self) -> int:
        return len(self._line)

    def join(self, rank: int, waiting_since_unix_ns: int, tokens: int, tenant: str = "") -> Place | None:
        """A place in the line, or None when the line is full and this one would stand last."""
        place = Place(rank, waiting_since_unix_ns, next(self._order), tokens, tenant)
        if len(self._line) >= self._size:
            if not self._line or self._order_of(place) >= self._order_of(self._line[-1]):
                return None
            self._push_out(self._line[-1])
        bisect.insort(self._line, place, key=self._order_of)
        self._woken[place] = asyncio.Event()
        return place

    def reorder(self) -> None:
        """The order's keys changed (a tenant was charged): sort the line again, waking a new head."""
        if len(self._line) <= 1:
            return
        head = self._line[0]
        self._line.sort(key=self._order_of)
        if self._line[0] != head:
            self._wake(self._line[0])

    def waits_other_than(self, tenant: str) -> bool:
        """Whether a waiter of another tenant is in the line."""
        return any(place.tenant != tenant for place in self._line)

    def is_head(self, place: Place) -> bool:
        return bool(self._line) and self._line[0] == place

    def pushed_out(self, place: Place) -> bool:
        """Whether a newcomer ahead of `place` in the order took its place in the full line."""
        return place in self._pushed_out

    def leave(self, place: Place) -> None:
        if place in self._pushed_out:
            self._pushed_out.discard(place)
            del self._woken[place]
            return
        was_head = self.is_head(place)
        self._line.remove(place)
        del self._woken[place]
        if was_head and self._line:
            self._wake(self._line[0])

    def pulse(self, fits: Callable[[Place], bool] = lambda place: False) -> None:
        """Room may have freed: wake the head, and each waiter behind it that `fits` now."""
        for index, place in enumerate(self._line):
            if index == 0 or fits(place):
                self._wake(place)

    def _push_out(self, place: Place) -> None:
        self._line.remove(place)
        self._pushed_out.add(place)
        self._wake(place)

    def _wake(self, place: Place) -> None:
        # Counted per wake sent: a waiter woken twice before it runs tries once.
        self._woken[place].set()
        self.wakeups += 1

    async def wait_change(self, place: Place, deadline: float) -> None:
        """Until `place` is woken or the queue's clock reaches `deadline`, whichever comes first."""
        woken = self._woken[place]
        # Not asyncio.wait_for: on Python 3.11 it can swallow a cancel that meets a set event.
        changed = asyncio.ensure_future(woken.wait())
        timer = asyncio.ensure_future(self._clock.sleep(deadline - self._clock()))
        try:
            await asyncio.wait((changed, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            timer.cancel()
            woken.clear()
