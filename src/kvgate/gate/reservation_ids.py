"""The ids the gate reserves under: one per request, made here, never taken from the client.

A client's `x-request-id` is its own to choose: five requests that share one would share one
reservation (the agent answers a repeat Reserve of a live id as the same reservation), and a client
that knew another's id could end that one's. So each request the gate admits reserves under
`<instance>-<n>`: the gate process's instance name (host, pid and 48 random bits, so two processes
never meet, and nobody outside can guess the next id) and a counter. The gate sends it upstream as
X-Session-ID (the engine's KV events then name the reservation, kvgate.agent.prefix_events);
`x-request-id` is left for logs and the queue's job alias.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket

# Host names can be 253 bytes; the agent takes ids of up to 256 (kvgate.agent.ledger.MAX_ID_BYTES).
_HOST_BYTES = 63


def instance_name() -> str:
    """This process's name among the gates: host, pid and a random suffix."""
    host = socket.gethostname().encode()[:_HOST_BYTES].decode(errors="ignore") or "gate"
    return f"{host}-{os.getpid()}-{secrets.token_hex(6)}"


class ReservationIds:
    """`next()` is a new id each time, unique across the gate processes of a fleet."""

    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance or instance_name()
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.instance}-{next(self._counter)}"
