"""Leases that follow the stream: the gate renews each reservation it holds while its request lives.

A gate reserves on a short lease (headroom.lease_s, 30 s by default) and renews every reservation it
holds on an agent in one Renew call every third of that lease. What follows:
- A gate that dies (SIGKILL, an OOM kill, a node drain) stops renewing, and each agent frees its KV
  at most one lease after the last renewal: within lease + period (40 s) of the kill, where a lease
  that was never renewed had to outlast the longest request (600 s) and stranded the KV for ten minutes.
- A renewal that fails (or lands late) costs nothing: the next one still comes a period before the lease
  ends. Two failed in a row lose the reservation.
- A renewal that reaches the agent after the lease lapsed is refused (RenewResponse.lapsed): the room
  may already be another request's, so nothing is booked again. The gate forgets the reservation,
  counts it (kvgate_gate_lease_renewals_total{result="lapsed"}) and logs it. The request runs on: the
  engine already holds its KV, and the agent's ledger never counts less than the engine reports
  (kvgate.agent.ledger), so the node is not overfilled; it only reacts a scrape later.
The trade-off: a shorter lease frees a dead gate's KV sooner, but leaves a slow or cut-off link to the
agent less time before live requests lose their reservations. Three renewals a lease keep one lost
call harmless. The cost is one call per agent per period, however many requests are in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from kvgate.errors import HeadroomError
from kvgate.telemetry import GateMetrics

log = logging.getLogger(__name__)

# Renewals per lease: one lost or late renewal still leaves another before the lease ends.
RENEWALS_PER_LEASE = 3


class Renews(Protocol):
    """A pool's agents as far as leases go (kvgate.gate.admission.HeadroomSource renews this way)."""

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]: ...


class LeaseKeeper:
    def __init__(self, source: Renews, lease_s: float, metrics: GateMetrics) -> None:
        self._source = source
        self.period_s = lease_s / RENEWALS_PER_LEASE
        self._metrics = metrics
        self._held: dict[str, dict[str, None]] = {}  # agent -> the request ids held there, in grant order

    def hold(self, agent: str, request_id: str) -> None:
        """A reservation was granted: renew it until `let_go`."""
        self._held.setdefault(agent, {})[request_id] = None

    def let_go(self, agent: str, request_id: str) -> None:
        """Its request ended (or its lease lapsed): renew it no more."""
        ids = self._held.get(agent)
        if ids is not None:
            ids.pop(request_id, None)
            if not ids:
                del self._held[agent]

    def held(self, agent: str) -> tuple[str, ...]:
        return tuple(self._held.get(agent, ()))

    async def run(self) -> None:
        """Forever: every period, renew what is held."""
        while True:
            await asyncio.sleep(self.period_s)
            await self.renew()

    async def renew(self) -> None:
        """One Renew per agent that holds something of ours, all at once."""
        await asyncio.gather(*(self._renew(agent, tuple(ids)) for agent, ids in list(self._held.items())))

    async def _renew(self, agent: str, request_ids: tuple[str, ...]) -> None:
        try:
            lapsed = await self._source.renew(agent, request_ids)
        except HeadroomError as error:
            # The lease still runs: the next period tries again.
            log.warning("renewing %d reservations on %s failed: %s", len(request_ids), agent, error)
            self._metrics.renewed("error", len(request_ids))
            return
        # A request that ended while the call was out was let go here: whatever the agent says of it,
        # it was neither renewed nor lost.
        held = self._held.get(agent, {})
        lost = [r for r in request_ids if r in lapsed and r in held]
        renewed = sum(1 for r in request_ids if r not in lapsed and r in held)
        for request_id in lost:
            log.warning(
                "reservation %s on %s lapsed before its renewal: the request runs on unreserved",
                request_id,
                agent,
            )
            self.let_go(agent, request_id)
        self._metrics.renewed("renewed", renewed)
        if lost:
            self._metrics.renewed("lapsed", len(lost))
