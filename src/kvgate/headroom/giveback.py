"""Giving a reservation back when the first try gets no answer: the one rule for the gate and the queue.

A Release that gets no answer (an agent starved of CPU, a dropped connection) leaves the node's room
held until the reservation's lease ends, minutes later: under a burst that is a node's whole long
pool shrinking while its engine empties (docs/benchmarks.md, "Real traffic"). So a Release is tried
again a few times.

A Reserve that gets no answer may still have been granted: the agent answers after the caller's
deadline, or the answer is lost on the way back. Nothing would ever release such a grant, so the
caller gives it back as if it had been granted, saying the Reserve went unanswered: an agent that
finds nothing to release then remembers the request id for a while (kvgate.agent.ledger), so a
Reserve that reaches it after its Release is refused rather than granted for good.

Both go out as the holder that reserved: a source (the gate's or the queue's headroom view) releases
as the holder it reserves as, and an agent frees, or remembers, only that holder's reservation.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from kvgate.errors import AgentCallError, HeadroomError
from kvgate.headroom.snapshot import ReleaseOutcome

log = logging.getLogger(__name__)

# Pauses between the tries of a Release that got no answer; after the last, the lease is the net.
RELEASE_RETRIES_S = (0.05, 0.25, 1.0)


class Releases(Protocol):
    """Releases as the holder the reservation was made by (see the module doc)."""

    async def release(self, node: str, request_id: str, *, unanswered: bool = False) -> ReleaseOutcome: ...


async def release(
    source: Releases, agent: str, request_id: str, *, unanswered: bool = False
) -> ReleaseOutcome | None:
    """Release `request_id` on `agent`, tried again while the agent gives no answer; None when it
    never did (logged: the reservation's lease gives the room back). `unanswered`: its Reserve got no
    answer, so the agent may not have seen it yet."""
    for pause in (*RELEASE_RETRIES_S, None):
        try:
            return await source.release(agent, request_id, unanswered=unanswered)
        except HeadroomError as error:
            if pause is None or not isinstance(error, AgentCallError):
                log.warning("release of %s on %s failed, left to its lease: %s", request_id, agent, error)
                return None
            await asyncio.sleep(pause)
    return None


def unanswered(error: HeadroomError) -> bool:
    """Whether a Reserve that raised `error` may have been granted: it reached the wire and got no
    answer (an agent unknown to the caller never saw it)."""
    return isinstance(error, AgentCallError)
