"""Fan the latest value out to any number of listeners; a slow listener skips values, never blocks.

Each listener has a one-slot mailbox that keeps only the newest value: a gate that falls behind
gets the current headroom next (the gap shows in `seq`), and the agent's loop never waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class _Mailbox(Generic[T]):
    __slots__ = ("_event", "_value")

    def __init__(self) -> None:
        self._value: T | None = None
        self._event = asyncio.Event()

    def put(self, value: T | None) -> None:
        self._value = value
        self._event.set()

    async def take(self) -> T | None:
        await self._event.wait()
        self._event.clear()
        return self._value


class Broadcast(Generic[T]):
    def __init__(self) -> None:
        self._boxes: set[_Mailbox[T]] = set()
        self._latest: T | None = None
        self._closed = False
        self.published = 0  # values published in all

    @property
    def listeners(self) -> int:
        return len(self._boxes)

    def publish(self, value: T) -> None:
        self._latest = value
        self.published += 1
        for box in self._boxes:
            box.put(value)

    def close(self) -> None:
        """End every listener's iteration (a None in the mailbox ends it)."""
        self._closed = True
        for box in self._boxes:
            box.put(None)

    async def listen(self) -> AsyncIterator[T]:
        """The latest value at once (if any), then every newer one the listener keeps up with."""
        box: _Mailbox[T] = _Mailbox()
        if self._latest is not None:
            box.put(self._latest)
        self._boxes.add(box)
        try:
            while not self._closed:
                value = await box.take()
                if value is None:
                    return
                yield value
        finally:
            self._boxes.discard(box)
