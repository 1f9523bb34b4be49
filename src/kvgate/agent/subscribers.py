"""The gates and queues that follow an agent's stream, and what each of them already knows.

Each subscriber has a pacer of its own (kvgate.agent.push): what it was last sent, and what the answers
to its own Reserve and Release calls told it since. A gate takes an answer's figures into its view at
once (kvgate.headroom.view), so a change that its own call alone made is no reason to send it a
message; every other subscriber still gets it within a period. With one gate, its own grants and
releases were the cause of about a third of each long node's messages on the Mooncake replay
(docs/benchmarks.md, "Messages a caller's own calls caused"), and each message wakes three threads on
each side.

A subscriber is known by the holder its calls are made as: its certificate's identity under mTLS,
else the name it subscribes with, which a gate also reserves under by default
(kvgate.headroom.view). One that reserves under another name simply gets every message, as before.

A subscriber that falls behind skips values: its one-slot mailbox keeps only the newest message, and
the agent's loop never waits for it (the gap shows in `seq`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from kvgate.agent.push import Cause, StreamPacer
from kvgate.headroom.snapshot import LedgerFigures, NodeHeadroom

# The agent's latest sample, its message and when it was taken (None before the first).
Latest = tuple[NodeHeadroom, bytes, float] | None


class Subscriber:
    """One stream: who it is, its pacer, and its one-slot mailbox."""

    __slots__ = ("_event", "_value", "holder", "pacer", "sent")

    def __init__(self, holder: str, pacer: StreamPacer) -> None:
        self.holder = holder
        self.pacer = pacer
        self.sent = 0  # messages put in its mailbox
        self._value: bytes | None = None
        self._event = asyncio.Event()

    def put(self, value: bytes | None) -> None:
        """The newest message (None ends the stream), replacing one not taken yet."""
        self._value = value
        self._event.set()

    async def take(self) -> bytes | None:
        await self._event.wait()
        self._event.clear()
        return self._value


class Subscribers:
    def __init__(self, period_s: float, heartbeat_s: float) -> None:
        self._period_s = period_s
        self._heartbeat_s = heartbeat_s
        self._all: set[Subscriber] = set()
        self._closed = False
        self.published = 0  # distinct messages sent, to one subscriber or more

    def __len__(self) -> int:
        return len(self._all)

    def add(self, holder: str, latest: Latest) -> Subscriber:
        """A new subscriber, sent the latest message at once when there is one; `holder`: whom its calls
        are made as."""
        subscriber = Subscriber(holder, StreamPacer(self._period_s, self._heartbeat_s))
        if self._closed:
            subscriber.put(None)
        elif latest is not None:
            headroom, message, now = latest
            subscriber.put(message)
            subscriber.pacer.sent(headroom, now)
        self._all.add(subscriber)
        return subscriber

    def remove(self, subscriber: Subscriber) -> None:
        self._all.discard(subscriber)

    def offer(
        self, headroom: NodeHeadroom, now: float, encode: Callable[[NodeHeadroom], bytes]
    ) -> list[Cause]:
        """Send `headroom` to every subscriber it is worth a message to, encoded once; why, for each."""
        causes: list[Cause] = []
        message: bytes | None = None
        for subscriber in self._all:
            cause = subscriber.pacer.due(headroom, now)
            if cause is None:
                continue
            if message is None:
                message = encode(headroom)
                self.published += 1
            subscriber.put(message)
            subscriber.sent += 1
            subscriber.pacer.sent(headroom, now)
            causes.append(cause)
        return causes

    def told(self, holder: str, figures: LedgerFigures, now: float) -> bool:
        """`holder` had `figures` in an answer; whether another subscriber still needs to hear of them."""
        others = False
        for subscriber in self._all:
            if subscriber.holder == holder:
                subscriber.pacer.told(figures, now)
            else:
                others = True
        return others

    def close(self) -> None:
        """End every subscriber's stream."""
        self._closed = True
        for subscriber in self._all:
            subscriber.put(None)

    async def listen(self, holder: str, latest: Latest) -> AsyncIterator[bytes]:
        """`holder`'s messages as they come: the latest at once (if any), then each one due to it."""
        subscriber = self.add(holder, latest)
        try:
            while True:
                message = await subscriber.take()
                if message is None:
                    return
                yield message
        finally:
            self.remove(subscriber)
