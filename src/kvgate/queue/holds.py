"""The held clients connected to this replica, by the job each waits on: what the replica renews the
holds of in the store (kvgate.queue.store, `hold`).

A held job whose client left runs for nobody: its engine's work, and its tenant's charge, buy no
answer. An engine does not do that either: vLLM aborts a request whose HTTP client disconnected
(`vllm/entrypoints/utils.py`, `with_cancellation` and `listen_for_disconnect`). The queue cannot
abort at once, since a held client may come back for its job with the same x-request-id
(docs/queue.md, "Held"). So the replica holding the connection renews the job's hold while the client
is connected, and a hold that lapses (the client left, or the replica died with the connection)
cancels the job unless it has started (`queue.reattach_s`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Connection(Protocol):
    """What the renewal reads of a held request's connection (aiohttp's transport)."""

    def is_closing(self) -> bool: ...


class HeldClients:
    def __init__(self) -> None:
        self._waiting: dict[str, list[Connection | None]] = {}

    @contextmanager
    def holding(self, job_id: str, connection: Connection | None) -> Iterator[None]:
        """While the caller waits on `job_id` for a client on `connection` (None: already gone)."""
        self._waiting.setdefault(job_id, []).append(connection)
        try:
            yield
        finally:
            connections = self._waiting[job_id]
            connections.remove(connection)
            if not connections:
                del self._waiting[job_id]

    def connected(self) -> list[str]:
        """The jobs with a client still connected here: the holds to renew."""
        return [
            job_id
            for job_id, connections in self._waiting.items()
            if any(c is not None and not c.is_closing() for c in connections)
        ]
