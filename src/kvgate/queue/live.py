"""Jobs running in this process, as the held clients connected to this replica follow them.

A held client whose job runs here gets the engine's answer as it comes (a stream stays a stream);
one whose job runs on another replica is woken by the store's events and reads the stored result.
`Signals` is the wake-up: a held request waits on its job id, and anything that may have changed that
job (it started here, it ended anywhere, the store asks everyone to look again) signals the id.

`Signals` also knows, from those watches, which jobs have a held client still connected here: the
holds this replica renews in the store (kvgate.queue.store, `hold`). A held job whose client left runs
for nobody: its engine's work, and its tenant's charge, buy no answer. An engine does not do that
either: vLLM aborts a request whose HTTP client disconnected (`vllm/entrypoints/utils.py`,
`with_cancellation` and `listen_for_disconnect`). The queue cannot abort at once, since a held client
may come back for its job with the same x-request-id (docs/queue.md, "Held"); so a hold that lapses
(the client left, or the replica died with the connection) cancels the job unless it has started
(`queue.reattach_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from kvgate.queue.jobs import JobError


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    content_type: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class LiveRun:
    """One attempt of one job: the engine's head, its chunks so far, and how it ended."""

    def __init__(self) -> None:
        self.head: Head | None = None
        self.chunks: list[bytes] = []
        self.ended = False
        # Set when the attempt ended without a complete answer (engine dropped it, job cancelled).
        self.error: JobError | None = None
        # The job went back to the queue: followers wait for its next attempt.
        self.requeued = False
        # A follower has been sent part of the answer: the attempt can no longer be run again unseen.
        self.relayed = False
        self._changed = asyncio.Event()

    def start(self, head: Head) -> None:
        self.head = head
        self._pulse()

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self._pulse()

    def end(self, error: JobError | None = None, requeued: bool = False) -> None:
        self.ended = True
        self.error = error
        self.requeued = requeued
        self._pulse()

    async def wait(self, timeout_s: float) -> None:
        """Until something changes, or `timeout_s`."""
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await changed.wait()

    async def follow(self) -> AsyncIterator[bytes]:
        """Every chunk from the first, as they arrive, until the attempt ends."""
        sent = 0
        while True:
            while sent < len(self.chunks):
                self.relayed = True
                yield self.chunks[sent]
                sent += 1
            if self.ended:
                return
            changed = self._changed
            await changed.wait()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class LiveRuns:
    def __init__(self, signals: Signals) -> None:
        self._runs: dict[str, LiveRun] = {}
        self._signals = signals

    def open(self, job_id: str) -> LiveRun:
        run = self._runs[job_id] = LiveRun()
        self._signals.signal(job_id)
        return run

    def get(self, job_id: str) -> LiveRun | None:
        return self._runs.get(job_id)

    def close(self, job_id: str, run: LiveRun) -> None:
        if self._runs.get(job_id) is run:
            del self._runs[job_id]
        self._signals.signal(job_id)


class Connection(Protocol):
    """What the hold's renewal reads of a held request's connection (aiohttp's transport)."""

    def is_closing(self) -> bool: ...


class Watch:
    """A held request's wake-up for one job, registered before it looks at the job, so that a change
    between looking and waiting is not missed; `connection`: its client's (None: already gone)."""

    def __init__(self, signals: Signals, job_id: str, connection: Connection | None) -> None:
        self._signals = signals
        self._job_id = job_id
        self.connection = connection
        self.event = asyncio.Event()

    def __enter__(self) -> Watch:
        self._signals.add(self._job_id, self)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._signals.discard(self._job_id, self)

    @property
    def connected(self) -> bool:
        return self.connection is not None and not self.connection.is_closing()

    async def wait(self, timeout_s: float) -> None:
        # Not asyncio.wait_for: on Python 3.11 a cancel that meets the event being set is lost.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.event.wait()
        self.event.clear()


class Signals:
    def __init__(self) -> None:
        self._watches: dict[str, set[Watch]] = {}

    def watch(self, job_id: str, connection: Connection | None = None) -> Watch:
        return Watch(self, job_id, connection)

    def add(self, job_id: str, watch: Watch) -> None:
        self._watches.setdefault(job_id, set()).add(watch)

    def discard(self, job_id: str, watch: Watch) -> None:
        watches = self._watches.get(job_id)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[job_id]

    def signal(self, job_id: str) -> None:
        for watch in self._watches.get(job_id, ()):
            watch.event.set()

    def signal_all(self) -> None:
        for watches in self._watches.values():
            for watch in watches:
                watch.event.set()

    def connected(self) -> list[str]:
        """The jobs with a held client still connected here: the holds to renew."""
        return [job_id for job_id, watches in self._watches.items() if any(w.connected for w in watches)]
