"""The one waiting order on a node: the waiters' claims, the head's slot, and the cap on everyone else.

Pure: the node's state asks it for each Reserve's cap and tells it each refusal and grant.

Every caller's waiters (each gate replica's, `kvgate queue`'s jobs) send their place in one order with
each Reserve: rank (0 most important), then, under fair shares, the weighted service their tenant
has attained (least first, as every gate and queue orders its own line: kvgate.policy.fair_share),
then since when they wait, by their wall clock. A waiter that
finds no room on the node it chose to hold its place on (ReserveRequest.hold_slot) leaves a *claim*
here; the first claim in the order is the *head*. The head's slot is when the node's expected
releases first fit it (kvgate.headroom.shadow, EASY backfilling), and every Reserve behind the head,
a fresh try included, may take only what leaves that slot whole: it is capped at the room behind the
head and refused `held_for_head` past it. A Reserve ahead of the head in the order, and the head's own,
is not capped. Only the head holds room; the claims behind it only say who is next.

A claim lives `CLAIM_TTL_S` unless its waiter tries again (every retry renews it): a waiter that has
gone (admitted elsewhere without saying so, timed out, its gate crashed) holds the node's room that
long at most. Claims are bounded in all and per holder, as the ledger bounds reservations; past a
bound, a claim later in the order than every one held is not kept, and an earlier one replaces the
latest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvgate.agent.ledger import Cap
from kvgate.headroom.shadow import room_behind, slot_after_s
from kvgate.headroom.snapshot import ExpectedRelease, HeadClaim, ReserveOutcome, ReserveReason

# How long a claim lives without a retry. A gate's head retries at least every 0.5 s while it waits
# (kvgate.gate.admission CLAIM_RENEW_S) and the queue's blocked head at least every refresh (1 s), so
# one late or lost retry does not drop the place; and a waiter gone without a word holds the node's
# room for 2 s at most, the gate's default admission.max_wait_s.
CLAIM_TTL_S = 2.0
# Claims kept at once. A gate replica or a queue replica claims for its own head, and holds one claim
# per node at a time; a few hundred is far above any cluster's replicas. Each claim keeps two ids of at
# most 256 bytes (kvgate.agent.ledger.MAX_ID_BYTES): about 256 x 800 B = 200 KiB at worst, and the
# head is found by a scan of at most that many.
MAX_CLAIMS = 256
MAX_CLAIMS_PER_HOLDER = 64

_Key = tuple[str, str]  # (holder, request_id)
# Refusals that leave a waiter's claim (it found no room, or only room held for the head): not those
# about the caller (a conflict, its holder cap) or the node's health.
NO_ROOM = frozenset({ReserveReason.INSUFFICIENT_HEADROOM, ReserveReason.HELD_FOR_HEAD})


@dataclass(frozen=True, slots=True)
class Waiter:
    """Who asks, and its place in the order: rank, then its tenant's fair service (0 without fair
    shares), then since when it waits (0: it names none)."""

    holder: str
    request_id: str
    rank: int = 0
    waiting_since_unix_ns: int = 0
    fair_service: float = 0.0

    @property
    def key(self) -> _Key:
        return (self.holder, self.request_id)

    @property
    def order(self) -> tuple[int, float, int, str, str]:
        """Rank, then fair service, then waiting since; holder and id only break ties, so the order is
        total."""
        return (self.rank, self.fair_service, self.waiting_since_unix_ns, self.holder, self.request_id)


@dataclass(frozen=True, slots=True)
class Claim:
    waiter: Waiter
    tokens: int
    expires_at: float  # by the node's monotonic clock


class WaitingClaims:
    def __init__(
        self,
        clock: Callable[[], float],
        *,
        ttl_s: float = CLAIM_TTL_S,
        max_claims: int = MAX_CLAIMS,
        max_per_holder: int = MAX_CLAIMS_PER_HOLDER,
    ) -> None:
        if ttl_s <= 0 or max_claims < 1 or max_per_holder < 1:
            raise ValueError("claims need ttl_s > 0, max_claims >= 1 and max_per_holder >= 1")
        self._clock = clock
        self._ttl_s = ttl_s
        self._max = max_claims
        self._max_per_holder = max_per_holder
        self._claims: dict[_Key, Claim] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._claims)

    def head(self) -> Claim | None:
        """The first live claim in the order, if any."""
        self._expire()
        return min(self._claims.values(), key=lambda c: c.waiter.order, default=None)

    def cap(self, waiter: Waiter, headroom: int, releases: Sequence[ExpectedRelease]) -> Cap | None:
        """The cap on a Reserve from `waiter`: None for the head's own and for one ahead of it (or when
        nobody waits), else the room behind the head (reason held_for_head)."""
        head = self.head()
        if head is None or head.waiter.key == waiter.key:
            return None
        if waiter.waiting_since_unix_ns > 0 and waiter.order < head.waiter.order:
            return None
        slot = slot_after_s(headroom, releases, head.tokens)
        return Cap(room_behind(headroom, releases, head.tokens, slot), ReserveReason.HELD_FOR_HEAD)

    def caps(
        self,
        waiter: Waiter,
        headroom: Callable[[], int],
        releases: Callable[[], Sequence[ExpectedRelease]],
    ) -> tuple[Cap, ...]:
        """`cap` as the ledger's `caps` (`headroom` and `releases` are only worked out when somebody
        waits: each costs a projection of every live reservation)."""
        if self.head() is None:
            return ()
        cap = self.cap(waiter, headroom(), releases())
        return () if cap is None else (cap,)

    def answered(
        self, outcome: ReserveOutcome, waiter: Waiter, tokens: int, *, hold_slot: bool, admissible_tokens: int
    ) -> None:
        """What a Reserve's answer does to the claims: a grant ends its waiter's claim; a waiter that
        holds its slot here and found no room (or only room held for the head) keeps one, unless it is
        bigger than the node could ever hold (it would hold the node for good)."""
        if outcome.granted:
            self.drop(waiter)
        elif (
            hold_slot
            and waiter.waiting_since_unix_ns > 0
            and outcome.reason in NO_ROOM
            and tokens <= admissible_tokens
        ):
            self.claim(waiter, tokens)

    def claim(self, waiter: Waiter, tokens: int) -> bool:
        """Keep (or renew) a waiter's claim; False when the bounds leave no place for it."""
        if waiter.waiting_since_unix_ns <= 0 or tokens <= 0:
            raise ValueError("a claim needs waiting_since_unix_ns > 0 and tokens > 0")
        self._expire()
        new = Claim(waiter, tokens, self._clock() + self._ttl_s)
        if waiter.key not in self._claims:
            mine = [c for c in self._claims.values() if c.waiter.holder == waiter.holder]
            if len(mine) >= self._max_per_holder and not self._make_room(mine, new):
                return False
            if len(self._claims) >= self._max and not self._make_room(self._claims.values(), new):
                return False
        self._claims[waiter.key] = new
        return True

    def holds(self, waiter: Waiter) -> bool:
        """Whether `waiter` holds a live claim here: it waits for room on this node."""
        self._expire()
        return waiter.key in self._claims

    def drop(self, waiter: Waiter) -> None:
        """The waiter was admitted here, or said it no longer waits (it released)."""
        self._claims.pop(waiter.key, None)

    def published(self, headroom: int, releases: Sequence[ExpectedRelease]) -> HeadClaim | None:
        """The head as the node's messages show it, with its slot (seconds after the message's sample)."""
        head = self.head()
        if head is None:
            return None
        slot = slot_after_s(headroom, releases, head.tokens)
        waiter = head.waiter
        return HeadClaim(head.tokens, waiter.waiting_since_unix_ns, waiter.rank, slot, waiter.fair_service)

    def _make_room(self, among: Iterable[Claim], new: Claim) -> bool:
        """Drop the latest claim of `among` when `new` comes before it; False when it does not."""
        latest = max(among, key=lambda c: c.waiter.order)
        if new.waiter.order >= latest.waiter.order:
            return False
        del self._claims[latest.waiter.key]
        return True

    def _expire(self) -> None:
        now = self._clock()
        gone = [key for key, claim in self._claims.items() if claim.expires_at <= now]
        for key in gone:
            del self._claims[key]
