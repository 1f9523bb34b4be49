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

Each reservation belongs to its holder (who the holder is, the agent's adapter says: the caller's
certificate under mTLS, else the name it sends). Only that holder renews or releases it: the same
request id from anyone else is a conflict, and their Release frees nothing. One holder's live
reservations are charged at most `max_holder_tokens` together, so a single caller cannot take a node
whole. Ids and holders are at most `MAX_ID_BYTES`, which bounds every id the ledger keeps.
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
# nothing is remembered. Each entry is a (holder, request id) pair of at most 2 x MAX_ID_BYTES, so the
# memory is bounded in bytes too: about 10,000 x (512 + ~250 of Python objects) = 7.5 MiB at worst.
EARLY_RELEASE_S = 30.0
EARLY_RELEASES_KEPT = 10_000
# The longest request id or holder, in UTF-8 bytes: a gate's ids are about 50 (kvgate.gate.reservation_ids),
# host names at most 253.
MAX_ID_BYTES = 256


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
    charged: int = 0  # what its grant added to the reserved tokens: counted against its holder's cap


@dataclass(frozen=True, slots=True)
class Cap:
    """A bound on one grant's charge beyond the node's headroom, and the refusal's reason when it is
    passed: what the node's other rules (the head's slot, an interactive node's lending limits) leave
    this request."""

    tokens: int
    reason: ReserveReason


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
        *,
        max_holder_tokens: int | None = None,
    ) -> None:
        """`max_holder_tokens`: what one holder's live reservations may be charged together; None for
        no cap beyond the node's headroom."""
        if not 0 < default_lease_s <= max_lease_s:
            raise ValueError("leases must satisfy 0 < default_lease_s <= max_lease_s")
        if max_holder_tokens is not None and max_holder_tokens <= 0:
            raise ValueError(f"max_holder_tokens must be > 0, got {max_holder_tokens}")
        self._clock = clock
        self._default_lease_s = default_lease_s
        self._max_lease_s = max_lease_s
        self._max_holder_tokens = max_holder_tokens
        self.prefixes = prefixes if prefixes is not None else PrefixBlocks()
        self._live: dict[str, Reservation] = {}
        self._reserved = 0  # own tokens of live reservations plus every held prefix block once
        self._asked = 0  # tokens live reservations asked for: _asked - _reserved is what sharing saves
        self._freed = 0  # tokens ended reservations gave back (released or expired), in all
        # No lease ends before this (renewals may leave it early, never late): until then `expire`,
        # called on every snapshot and reservation, has nothing to scan for.
        self._next_expiry = math.inf
        self._released_early: dict[tuple[str, str], float] = {}  # (holder, request_id) -> until, oldest first
        self._held_by: dict[str, int] = {}  # holder -> what its live reservations' grants charged

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

    def held_by(self, holder: str) -> int:
        """What `holder`'s live reservations were charged when granted (its part of the cap)."""
        self.expire()
        return self._held_by.get(holder, 0)

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
        caps: tuple[Cap, ...] = (),
    ) -> ReserveOutcome:
        """Charge `tokens` to `holder` if they fit in the headroom, its holder cap and every one of
        `caps`, else refuse. `lease_s`
        <= 0 takes the default. A repeat by the same holder renews the lease and charges nothing more.

        With a `prefix` chain, the chain's blocks that live reservations hold are not charged again.
        `output_tokens`, the request's output budget within `tokens`, says when it is expected to end.
        """
        check_ids(request_id, holder)
        if tokens <= 0:
            raise ValueError(f"a reservation needs tokens > 0, got {tokens}")
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
            # Another holder's id (a client that chose it, a second caller guessing it) takes nothing
            # and renews nothing: only its holder's own retry is the same reservation.
            if existing.tokens != tokens or existing.holder != holder:
                return self._result(False, ReserveReason.REQUEST_ID_CONFLICT, budget, 0.0)
            self._hold(dataclasses.replace(existing, expires_at=self._clock() + lease))
            return self._result(True, ReserveReason.ALREADY_RESERVED, budget, lease)
        if self._released_early.pop((holder, request_id), -math.inf) > self._clock():
            return self._result(False, ReserveReason.RELEASED_FIRST, budget, 0.0)
        if not budget.healthy:
            return self._result(False, ReserveReason.UNHEALTHY, budget, 0.0)
        if budget.capacity_tokens <= 0:
            return self._result(False, ReserveReason.NO_CAPACITY, budget, 0.0)
        chain = prefix if prefix is not None and prefix.blocks else None
        own = tokens - chain.tokens if chain is not None else tokens
        cached = self.prefixes.cached_blocks(chain) * chain.block_tokens if chain is not None else 0
        cost = own + (self.prefixes.cost(chain) if chain is not None else 0)
        cap = self._max_holder_tokens
        if cap is not None and self._held_by.get(holder, 0) + cost > cap:
            return self._result(False, ReserveReason.HOLDER_CAP, budget, 0.0, cached=cached)
        if cost > self.headroom(budget):
            return self._result(False, ReserveReason.INSUFFICIENT_HEADROOM, budget, 0.0, cached=cached)
        for bound in caps:
            if cost > bound.tokens:
                return self._result(False, bound.reason, budget, 0.0, cached=cached)
        held = self.prefixes.hold(chain) if chain is not None else 0
        blocks = chain.blocks if chain is not None else ()
        now = self._clock()
        charged = own + held
        self._hold(
            Reservation(request_id, tokens, now + lease, holder, blocks, own, now, output_tokens, charged)
        )
        self._reserved += charged
        self._asked += tokens
        self._held_by[holder] = self._held_by.get(holder, 0) + charged
        return self._result(True, ReserveReason.GRANTED, budget, lease, charged=charged, cached=cached)

    def release(self, request_id: str, holder: str = "", *, unanswered_reserve: bool = False) -> bool:
        """End `holder`'s reservation; False when it was already gone (released twice, or expired), is
        another holder's (which it leaves alone), or, for the Release of an `unanswered_reserve`, is
        not here yet (that holder's Reserve is then refused on arrival)."""
        check_ids(request_id, holder)
        self.expire()
        existing = self._live.get(request_id)
        if existing is not None:
            return existing.holder == holder and self._drop(request_id)
        if unanswered_reserve:
            self._remember_early_release((holder, request_id))
        return False

    def _remember_early_release(self, key: tuple[str, str]) -> None:
        now = self._clock()
        early = self._released_early
        early.pop(key, None)
        while early:
            oldest = next(iter(early))
            if early[oldest] > now and len(early) < EARLY_RELEASES_KEPT:
                break
            del early[oldest]
        early[key] = now + EARLY_RELEASE_S

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
        holder = reservation.holder
        left = self._held_by[holder] - reservation.charged
        if left > 0:
            self._held_by[holder] = left
        else:
            del self._held_by[holder]
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


def check_ids(request_id: str, holder: str) -> None:
    """ValueError (caller misuse) for an empty request id, or an id or holder past MAX_ID_BYTES."""
    if not request_id:
        raise ValueError("a reservation needs a request_id")
    for name, value in (("request_id", request_id), ("holder", holder)):
        # Characters first: a str of a few MiB is not encoded to learn that it is too long.
        if len(value) > MAX_ID_BYTES or len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
            raise ValueError(f"{name} is longer than {MAX_ID_BYTES} bytes")
