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

What the reservations commit the node to follows their use once the node's per-sequence decode rate
is measured (`decode_rate`): each is projected over its life, its uncached prompt from the grant and
its output as it is generated (kvgate.agent.footprint), at the output this node's requests really
generate rather than the budget they declared (kvgate.agent.output_budget), and a grant must keep the
peak over time of all of them, the new one included, within the admissible tokens. The engine's usage
reconciles the projection every time it is read: what the engine holds beyond what the reservations
hold now is drift, carried on top of the peak; less than them is never credited. So the commitment is
never below the engine's usage. Without a rate, every reservation holds its whole charge for its
whole life: admissible - max(engine usage, Σ reserved), as before
(kvgate.headroom.snapshot.headroom_tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvgate.agent.footprint import FirstToken, Footprint, held_now, peak, project
from kvgate.agent.output_budget import OutputHistory
from kvgate.agent.prefix_blocks import PrefixBlocks
from kvgate.headroom.snapshot import (
    PrefixChain,
    ReleaseOutcome,
    ReserveOutcome,
    ReserveReason,
    admissible,
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
    # Its holder says when the engine sends its first token (FirstToken); when that came, by the
    # ledger's clock (None: not yet, or never told).
    reports_first_token: bool = False
    first_token_at: float | None = None


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


@dataclass(frozen=True, slots=True)
class Commitment:
    """What the live reservations commit the node to: admission compares admissible - `tokens` with
    a request's size, and a grant must keep it within admissible with the request included."""

    tokens: int  # peak + drift
    # The most the reservations hold together from now on, prefix blocks included: their projected
    # peak over time, or Σ reserved when the rate is unknown.
    peak: int
    # What the engine holds beyond what the reservations hold now: carried as if held for as long as
    # any reservation projects. Without a rate, engine usage beyond Σ reserved.
    drift: int
    follows_use: bool  # False: the decode rate is unknown and every reservation holds its charge


class ReservationLedger:
    def __init__(
        self,
        clock: Callable[[], float],
        default_lease_s: float,
        max_lease_s: float,
        prefixes: PrefixBlocks | None = None,
        *,
        max_holder_tokens: int | None = None,
        decode_rate: Callable[[], float | None] | None = None,
        outputs: OutputHistory | None = None,
    ) -> None:
        """`max_holder_tokens`: what one holder's live reservations may be charged together; None for
        no cap beyond the node's headroom. `decode_rate`: the node's measured output tokens per second
        per running request, None while unknown (kvgate.agent.decode_rate); without one the ledger
        keeps every charge for its reservation's whole life. `outputs`: what ended reservations
        generated, learned here."""
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
        # Expired since the agent last took them: any call may expire a lease (a Reserve, a snapshot),
        # and the agent's tick counts and logs each one once (`take_expired`).
        self._expired_untaken: list[Reservation] = []
        self._released_early: dict[tuple[str, str], float] = {}  # (holder, request_id) -> until, oldest first
        # Reservations released lately, the same way: a renewal that a Release overtook names them, and
        # they are not lapses (`renew`).
        self._released_lately: dict[tuple[str, str], float] = {}
        self._held_by: dict[str, int] = {}  # holder -> what its live reservations' grants charged
        self._own = 0  # own tokens of live reservations: _reserved - _own is the held prefix blocks
        self._decode_rate = decode_rate if decode_rate is not None else _unknown_rate
        self.outputs = outputs if outputs is not None else OutputHistory()

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
        self._expired_untaken += expired
        self._next_expiry = min((r.expires_at for r in self._live.values()), default=math.inf)
        return expired

    def take_expired(self) -> list[Reservation]:
        """Every reservation whose lease ran out since the last call, whichever call expired it."""
        self.expire()
        taken, self._expired_untaken = self._expired_untaken, []
        return taken

    def headroom(self, budget: Budget) -> int:
        """admissible - the commitment: the largest request of any shape (all prompt, never ending)
        that a grant would take now. A larger one may still be granted when its peak does not meet the
        others'."""
        return admissible(budget.capacity_tokens, budget.safety_ratio) - self.commitment(budget).tokens

    def commitment(self, budget: Budget) -> Commitment:
        self.expire()
        return self._commitment(budget)

    def _commitment(self, budget: Budget, new: _Ask | None = None) -> Commitment:
        """With `new`, as if it were granted now."""
        observed = budget.observed_tokens
        rate = self._decode_rate()
        if rate is None or rate <= 0:
            reserved = self._reserved
            drift = 0 if observed is None else max(0, observed - reserved)
            added = new.own + new.shared if new is not None else 0
            return Commitment(reserved + drift + added, reserved + added, drift, False)
        now = self._clock()
        levels = self.outputs.levels()
        footprints = [
            self._project(
                r.own_tokens,
                r.output_tokens,
                now - r.granted_at,
                rate,
                levels,
                first_token=_first_token(r, now),
            )
            for r in self._live.values()
        ]
        prefix = self._reserved - self._own  # held prefix blocks: counted until the end, conservatively
        # Every reservation counts, the ones the engine has not written yet too: subtracting only those
        # it surely holds would count a fresh prompt twice (in the usage as it is written, and in the
        # peak) and, on the Mooncake replay's model, make more long requests wait than today's rule.
        # The same masking as today's max(usage, Σ reserved), and never below the usage.
        drift = 0 if observed is None else max(0, observed - prefix - held_now(footprints))
        if new is not None:
            footprints.append(self._project(new.own, new.output, 0.0, rate, levels))
            prefix += new.shared
        top = prefix + peak(footprints)
        return Commitment(top + drift, top, drift, True)

    def _project(
        self,
        own: int,
        output: int,
        age_s: float,
        rate: float,
        levels: tuple[int, ...],
        *,
        first_token: FirstToken | None = None,
    ) -> Footprint:
        declared = min(output, own)  # a prefix chain may cover what the caller said was output
        prompt = own - declared
        if declared == 0:
            return Footprint(prompt, 0, 0, math.inf)  # no output budget: no expected end
        return project(
            prompt,
            declared,
            age_s,
            rate,
            lambda g: self.outputs.projected(declared, g, levels),
            first_token=first_token,
        )

    def largest_holders(self, limit: int) -> list[tuple[str, int]]:
        """The `limit` holders charged the most by their live reservations, largest first. Read by the
        metrics exporter from its own thread, so it changes nothing: a lease that ran out still counts
        until the next tick expires it."""
        return sorted(self._held_by.items(), key=lambda item: item[1], reverse=True)[:limit]

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
        reports_first_token: bool = False,
    ) -> ReserveOutcome:
        """Charge `tokens` to `holder` if they fit in the headroom, its holder cap and every one of
        `caps`, else refuse. `lease_s`
        <= 0 takes the default. A repeat by the same holder renews the lease and charges nothing more.

        With a `prefix` chain, the chain's blocks that live reservations hold are not charged again.
        `output_tokens`, the request's output budget within `tokens`, says when it is expected to end;
        `reports_first_token`: the holder will say when it starts decoding (first_token).
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
        ask = _Ask(own, output_tokens, cost - own)
        if self._commitment(budget, ask).tokens > admissible(budget.capacity_tokens, budget.safety_ratio):
            return self._result(False, ReserveReason.INSUFFICIENT_HEADROOM, budget, 0.0, cached=cached)
        for bound in caps:
            if cost > bound.tokens:
                return self._result(False, bound.reason, budget, 0.0, cached=cached)
        held = self.prefixes.hold(chain) if chain is not None else 0
        blocks = chain.blocks if chain is not None else ()
        now = self._clock()
        charged = own + held
        self._hold(
            Reservation(
                request_id,
                tokens,
                now + lease,
                holder,
                blocks,
                own,
                now,
                output_tokens,
                charged,
                reports_first_token,
            )
        )
        self._reserved += charged
        self._own += own
        self._asked += tokens
        self._held_by[holder] = self._held_by.get(holder, 0) + charged
        return self._result(True, ReserveReason.GRANTED, budget, lease, charged=charged, cached=cached)

    def renew(self, request_ids: Iterable[str], holder: str, lease_s: float) -> tuple[list[str], float]:
        """Extend `holder`'s live reservations among `request_ids` by `lease_s` (<= 0: the default) from
        now; return the ids it holds nothing under (lapsed, or another holder's) and the lease granted.
        An id the holder released lately is neither: its Release overtook the renewal. A lapsed id is
        never booked again here: its room may already be someone else's, so the holder learns it lost
        it rather than double-booking the node (kvgate.gate.leases)."""
        check_ids("renew", holder)
        lease = self._lease(lease_s)
        self.expire()
        now = self._clock()
        until = now + lease
        lapsed = []
        for request_id in request_ids:
            check_ids(request_id, holder)
            existing = self._live.get(request_id)
            if existing is None or existing.holder != holder:
                if self._released_lately.get((holder, request_id), -math.inf) <= now:
                    lapsed.append(request_id)
            elif existing.expires_at < until:
                self._hold(dataclasses.replace(existing, expires_at=until))
        return lapsed, lease

    def first_token(self, request_id: str, holder: str = "") -> bool:
        """The engine sent `holder`'s request its first token: from now its output grows. False when
        no live reservation of that holder's awaited it (unknown, another's, or told already)."""
        check_ids(request_id, holder)
        existing = self._live.get(request_id)
        if existing is None or existing.holder != holder or existing.first_token_at is not None:
            return False
        self._live[request_id] = dataclasses.replace(
            existing, reports_first_token=True, first_token_at=self._clock()
        )
        return True

    def release(
        self,
        request_id: str,
        holder: str = "",
        *,
        unanswered_reserve: bool = False,
        generated_tokens: int = 0,
    ) -> bool:
        """End `holder`'s reservation; False when it was already gone (released twice, or expired), is
        another holder's (which it leaves alone), or, for the Release of an `unanswered_reserve`, is
        not here yet (that holder's Reserve is then refused on arrival). `generated_tokens`: what the
        request generated by its engine's answer, 0 when the releaser did not read it."""
        check_ids(request_id, holder)
        self.expire()
        existing = self._live.get(request_id)
        if existing is not None:
            if existing.holder != holder:
                return False
            self._learn(existing, generated_tokens)
            _remember(self._released_lately, (holder, request_id), self._clock())
            return self._drop(request_id)
        if unanswered_reserve:
            _remember(self._released_early, (holder, request_id), self._clock())
        return False

    def _learn(self, ended: Reservation, generated_tokens: int) -> None:
        """Learn what a released reservation generated (`output_generated`). An expired one is not
        learned: its request may have ended long before."""
        if generated_tokens > 0:
            self.outputs.learn(generated_tokens)
            return
        estimate = self._output_estimate(ended)
        if estimate is not None:
            self.outputs.learn(estimate)

    def output_generated(self, request_id: str, holder: str, generated_tokens: int = 0) -> int:
        """What `holder`'s live reservation generated: what its releaser read in the engine's answer
        (`generated_tokens`), else its hold (from its first token, where told) x the node's measured
        decode rate, within its budget; 0 when neither is known or it is not held here. A hold from
        the grant counts its prefill and its trip to the engine too, so the estimate errs high."""
        if generated_tokens > 0:
            return generated_tokens
        existing = self._live.get(request_id)
        if existing is None or existing.holder != holder:
            return 0
        return self._output_estimate(existing) or 0

    def _output_estimate(self, ended: Reservation) -> int | None:
        rate = self._decode_rate()
        declared = min(ended.output_tokens, ended.own_tokens)
        if rate is None or rate <= 0 or declared == 0:
            return None
        decoding_since = ended.first_token_at if ended.first_token_at is not None else ended.granted_at
        held = max(0.0, self._clock() - decoding_since)
        return min(declared, math.floor(held * rate))

    def release_answer(
        self, released: bool, budget: Budget, settled_output_tokens: int = 0
    ) -> ReleaseOutcome:
        """The answer to a Release: whether it ended a reservation, the node's figures after it
        (`budget` taken after it too: a reservation-only node's usage is its reservations), and the
        output it was settled on (`output_generated`, taken before it ended)."""
        settled = settled_output_tokens if released else 0
        return ReleaseOutcome(released, self.headroom(budget), self.reserved_tokens, settled)

    def _hold(self, reservation: Reservation) -> None:
        self._live[reservation.request_id] = reservation
        self._next_expiry = min(self._next_expiry, reservation.expires_at)

    def _drop(self, request_id: str) -> bool:
        reservation = self._live.pop(request_id, None)
        if reservation is None:
            return False
        freed = reservation.own_tokens + self.prefixes.release(reservation.blocks)
        self._reserved -= freed
        self._own -= reservation.own_tokens
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


@dataclass(frozen=True, slots=True)
class _Ask:
    """A Reserve being decided: its own tokens, its output budget, and the prefix blocks it would hold
    that no live reservation holds yet."""

    own: int
    output: int
    shared: int


def _remember(kept: dict[tuple[str, str], float], key: tuple[str, str], now: float) -> None:
    """Keep `key` for EARLY_RELEASE_S in `kept` (oldest first), which never holds more than
    EARLY_RELEASES_KEPT keys nor any that has run out when a new one comes."""
    kept.pop(key, None)
    while kept:
        oldest = next(iter(kept))
        if kept[oldest] > now and len(kept) < EARLY_RELEASES_KEPT:
            break
        del kept[oldest]
    kept[key] = now + EARLY_RELEASE_S


def _unknown_rate() -> float | None:
    return None


def check_ids(request_id: str, holder: str) -> None:
    """ValueError (caller misuse) for an empty request id, or an id or holder past MAX_ID_BYTES."""
    if not request_id:
        raise ValueError("a reservation needs a request_id")
    for name, value in (("request_id", request_id), ("holder", holder)):
        # Characters first: a str of a few MiB is not encoded to learn that it is too long.
        if len(value) > MAX_ID_BYTES or len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
            raise ValueError(f"{name} is longer than {MAX_ID_BYTES} bytes")


def _first_token(reservation: Reservation, now: float) -> FirstToken | None:
    if not reservation.reports_first_token:
        return None
    at = reservation.first_token_at
    return FirstToken(None if at is None else now - at)
