"""The agent's reservations: the synchronous charge that stops a burst inside one sampling period.

Every admission decision on a node goes through one ledger in one process, and `reserve` checks and
charges without yielding, so two gates asking at the same instant are served one after the other
against the same numbers. A full node is a refusal (a return value); a negative token count is
caller misuse (ValueError). Its answers are the contract's (kvgate.headroom.snapshot): ReserveOutcome
and ReleaseOutcome, what the agent sends and what a gate reads.

A reservation may carry its prompt's prefix chain: the blocks that live reservations already hold are
one copy in the engine's prefix cache, so they are charged once (kvgate.agent.prefix_blocks). The
reserved tokens are then each reservation's own part (its tokens less its chain) plus every held block
once.

A caller that got no answer to a Reserve releases it unseen (kvgate.headroom.giveback), saying so.
When that Release finds nothing, it overtook its Reserve: the ledger remembers it for a while
(`EARLY_RELEASE_S`) and refuses the Reserve on arrival instead of holding room until its lease ends.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.agent.prefix_blocks import PrefixBlocks
from kvgate.headroom.snapshot import (
    PrefixChain,
    ReleaseOutcome,
    ReserveOutcome,
    ReserveReason,
    headroom_tokens,
)

# How long, and for how many request ids at most, a Release of an unanswered Reserve that found
# nothing is remembered.
EARLY_RELEASE_S = 30.0
EARLY_RELEASES_KEPT = 10_000


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    tokens: int
    expires_at: float
    holder: str
    blocks: tuple[int, ...] = ()  # its prefix chain's blocks, held in the ledger's PrefixBlocks
    own_tokens: int = 0  # tokens beyond its chain: charged to it alone
    granted_at: float = 0.0  # by the ledger's clock; a renewal keeps it
    output_tokens: int = 0  # of `tokens`, the request's output budget; 0 when unknown


@dataclass(frozen=True, slots=True)
class Budget:
    """What the latest sample says the node can hold; the ledger adds its own reservations."""

    capacity_tokens: int
    safety_ratio: float
    observed_tokens: int | None
    healthy: bool
    reason: str = ""


class ReservationLedger:
    def __init__(
        self,
        clock: Callable[[], float],
        default_lease_s: float,
        max_lease_s: float,
        prefixes: PrefixBlocks | None = None,
    ) -> None:
        if not 0 < default_lease_s <= max_lease_s:
            raise ValueError("leases must satisfy 0 < default_lease_s <= max_lease_s")
        self._clock = clock
        self._default_lease_s = default_lease_s
        self._max_lease_s = max_lease_s
        self.prefixes = prefixes if prefixes is not None else PrefixBlocks()
        self._live: dict[str, Reservation] = {}
        self._reserved = 0  # own tokens of live reservations plus every held prefix block once
        self._asked = 0  # tokens live reservations asked for: _asked - _reserved is what sharing saves
        self._freed = 0  # tokens ended reservations gave back (released or expired), in all
        # No lease ends before this (renewals may leave it early, never late): until then `expire`,
        # called on every snapshot and reservation, has nothing to scan for.
        self._next_expiry = math.inf
        self._released_early: dict[str, float] = {}  # request_id -> until, oldest first

    @property
    def reserved_tokens(self) -> int:
        self.expire()
        return self._reserved

    @property
    def count(self) -> int:
        self.expire()
        return len(self._live)

    @property
    def freed_tokens(self) -> int:
        """Tokens ended reservations (released or expired) gave back since the ledger began."""
        self.expire()
        return self._freed

    def live(self) -> tuple[Reservation, ...]:
        self.expire()
        return tuple(self._live.values())

    @property
    def saved_tokens(self) -> int:
        """Tokens live reservations asked for but share with others (prefix blocks charged once)."""
        self.expire()
        return self._asked - self._reserved

    def expire(self) -> list[Reservation]:
        now = self._clock()
        if now < self._next_expiry:
            return []
        expired = [r for r in self._live.values() if r.expires_at <= now]
        for reservation in expired:
            self._drop(reservation.request_id)
        self._next_expiry = min((r.expires_at for r in self._live.values()), default=math.inf)
        return expired

    def headroom(self, budget: Budget) -> int:
        return headroom_tokens(
            budget.capacity_tokens, budget.safety_ratio, budget.observed_tokens, self.reserved_tokens
        )

    def reserve(
        self,
        request_id: str,
        tokens: int,
        lease_s: float,
        budget: Budget,
        holder: str = "",
        *,
        prefix: PrefixChain | None = None,
        output_tokens: int = 0,
    ) -> ReserveOutcome:
        """Charge `tokens` if they fit in the headroom, else refuse. `lease_s` <= 0 takes the default.

        With a `prefix` chain, the chain's blocks that live reservations hold are not charged again.
        `output_tokens`, the request's output budget within `tokens`, says when it is expected to end.
        """
        if tokens <= 0 or not request_id:
            raise ValueError(f"a reservation needs a request_id and tokens > 0, got {request_id!r}, {tokens}")
        if not 0 <= output_tokens <= tokens:
            raise ValueError(f"output_tokens must be within 0..tokens ({tokens}), got {output_tokens}")
        if prefix is not None and (prefix.block_tokens <= 0 or prefix.tokens > tokens):
            raise ValueError(
                f"a prefix chain of {len(prefix.blocks)} blocks x {prefix.block_tokens} tokens does not "
                f"fit in the {tokens} tokens asked"
            )
        lease = self._lease(lease_s)
        self.expire()
        existing = self._live.get(request_id)
        if existing is not None:
            if existing.tokens != tokens:
                return self._result(False, ReserveReason.REQUEST_ID_CONFLICT, budget, 0.0)
            self._hold(dataclasses.replace(existing, expires_at=self._clock() + lease, holder=holder))
            return self._result(True, ReserveReason.ALREADY_RESERVED, budget, lease)
        if self._released_early.pop(request_id, -math.inf) > self._clock():
            return self._result(False, ReserveReason.RELEASED_FIRST, budget, 0.0)
        if not budget.healthy:
            return self._result(False, ReserveReason.UNHEALTHY, budget, 0.0)
        if budget.capacity_tokens <= 0:
            return self._result(False, ReserveReason.NO_CAPACITY, budget, 0.0)
        chain = prefix if prefix is not None and prefix.blocks else None
        own = tokens - chain.tokens if chain is not None else tokens
        cached = self.prefixes.cached_blocks(chain) * chain.block_tokens if chain is not None else 0
        cost = own + (self.prefixes.cost(chain) if chain is not None else 0)
        if cost > self.headroom(budget):
            return self._result(False, ReserveReason.INSUFFICIENT_HEADROOM, budget, 0.0, cached=cached)
        held = self.prefixes.hold(chain) if chain is not None else 0
        blocks = chain.blocks if chain is not None else ()
        now = self._clock()
        self._hold(Reservation(request_id, tokens, now + lease, holder, blocks, own, now, output_tokens))
        self._reserved += own + held
        self._asked += tokens
        return self._result(True, ReserveReason.GRANTED, budget, lease, charged=own + held, cached=cached)

    def release(self, request_id: str, *, unanswered_reserve: bool = False) -> bool:
        """End the reservation; False when it was already gone (released twice, or expired) or, for
        the Release of an `unanswered_reserve`, not here yet (its Reserve is then refused on arrival)."""
        self.expire()
        if self._drop(request_id):
            return True
        if unanswered_reserve:
            self._remember_early_release(request_id)
        return False

    def _remember_early_release(self, request_id: str) -> None:
        now = self._clock()
        early = self._released_early
        early.pop(request_id, None)
        while early:
            oldest = next(iter(early))
            if early[oldest] > now and len(early) < EARLY_RELEASES_KEPT:
                break
            del early[oldest]
        early[request_id] = now + EARLY_RELEASE_S

    def release_answer(self, released: bool, budget: Budget) -> ReleaseOutcome:
        """The answer to a Release: whether it ended a reservation, and the node's figures after it
        (`budget` taken after it too: a reservation-only node's usage is its reservations)."""
        return ReleaseOutcome(released, self.headroom(budget), self.reserved_tokens)

    def _hold(self, reservation: Reservation) -> None:
        self._live[reservation.request_id] = reservation
        self._next_expiry = min(self._next_expiry, reservation.expires_at)

    def _drop(self, request_id: str) -> bool:
        reservation = self._live.pop(request_id, None)
        if reservation is None:
            return False
        freed = reservation.own_tokens + self.prefixes.release(reservation.blocks)
        self._reserved -= freed
        self._freed += freed
        self._asked -= reservation.tokens
        return True

    def _lease(self, lease_s: float) -> float:
        if lease_s <= 0:
            return self._default_lease_s
        return min(lease_s, self._max_lease_s)

    def _result(
        self,
        granted: bool,
        reason: ReserveReason,
        budget: Budget,
        lease: float,
        *,
        charged: int = 0,
        cached: int = 0,
    ) -> ReserveOutcome:
        return ReserveOutcome(
            granted, reason, self.headroom(budget), self._reserved, lease, charged, cached, len(self._live)
        )
