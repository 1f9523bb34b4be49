"""The head's slot and what may go beside it: EASY backfilling's arithmetic, shared by agent and gate.

Pure. EASY backfilling (Mu'alem and Feitelson, "Utilization, predictability, workloads, and user
runtime estimates in scheduling the IBM SP2 with backfilling", IEEE TPDS 12(6), 2001) gives the first
waiting job a reservation, its *shadow*: the time the running jobs' expected ends first free enough
for it. Any later job may start now if it leaves that reservation untouched.

Here a node's live reservations are the running jobs and their expected releases
(`NodeHeadroom.releases`, kvgate.agent.releases) their ends. The head's slot is when the headroom now
plus what frees by then first covers its tokens; what is left at the slot beyond the head's tokens
(the *extra*) is what a request behind it may take now. A request let in now is assumed to still hold
its tokens at the slot: EASY's other rule (a job that ends before the shadow may take more) is left
out, because a request's end is itself a forecast that a long decode can overrun, and an overrun
would delay the head.

The agent applies this to every Reserve (kvgate.agent.backfill); the gate applies it to its snapshots
to choose whom to wake and where to ask (kvgate.gate.admission), so the agent's refusals are rare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvgate.headroom.snapshot import ExpectedRelease, HeadClaim, NodeHeadroom


def slot_after_s(headroom: int, releases: Sequence[ExpectedRelease], tokens: int) -> float | None:
    """When `tokens` first fit, in seconds from the releases' sample: 0.0 when the headroom holds them
    now, else the expected release that brings them in; None when the forecast never does."""
    if tokens <= headroom:
        return 0.0
    total = headroom
    for release in releases:
        total += release.tokens
        if total >= tokens:
            return release.after_s
    return None


def room_behind(
    headroom: int, releases: Sequence[ExpectedRelease], head_tokens: int, slot: float | None
) -> int:
    """What a request behind the head may take now and leave its slot whole: the headroom plus what is
    expected to free by the slot, less the head's tokens (at least 0), and never past the headroom.

    With no slot (the forecast never fits the head: reservations without an output budget, or no
    decode rate measured yet), the head's tokens are held against everyone behind it: they may take
    only what would be left after every forecast release and the head, which is nothing. That is
    head-of-line waiting, on the one node the head holds only (it holds no other)."""
    if slot is None:
        return 0
    freed = sum(r.tokens for r in releases if r.after_s <= slot)
    return max(0, min(headroom, headroom + freed - head_tokens))


def ahead_of(rank: int, waiting_since_unix_ns: int, head: HeadClaim, fair_service: float = 0.0) -> bool:
    """Whether a Reserve of this rank, waiting since then, comes before `head` in the one order (rank,
    then its tenant's fair service, then waiting since). A Reserve that names no waiting time (0) is
    behind every waiter."""
    if waiting_since_unix_ns <= 0:
        return False
    place = (rank, fair_service, waiting_since_unix_ns)
    return place < (head.rank, head.fair_service, head.waiting_since_unix_ns)


def room_for(
    headroom: NodeHeadroom,
    rank: int,
    waiting_since_unix_ns: int,
    local: HeadClaim | None = None,
    *,
    fair_service: float = 0.0,
) -> int:
    """What a request at this place in the order may take on the node now, by its latest message: all
    its headroom when it is ahead of the node's head, else only the room behind the head.

    `local`: a waiter of the caller's own whose claim the node's message may not show yet (its slot
    unknown: it is worked out here from the same message); the first of the two in the order holds.
    A head at this very place is the caller's own claim (a waiting time in nanoseconds names one
    waiter), which does not hold room against itself."""
    head = headroom.head
    if local is not None and (
        head is None or ahead_of(local.rank, local.waiting_since_unix_ns, head, local.fair_service)
    ):
        slot = slot_after_s(headroom.headroom_tokens, headroom.releases, local.tokens)
        head = dataclasses.replace(local, slot_after_s=slot)
    own = (rank, waiting_since_unix_ns) == (head.rank, head.waiting_since_unix_ns) if head else False
    if head is None or own or ahead_of(rank, waiting_since_unix_ns, head, fair_service):
        return headroom.headroom_tokens
    return room_behind(headroom.headroom_tokens, headroom.releases, head.tokens, head.slot_after_s)
