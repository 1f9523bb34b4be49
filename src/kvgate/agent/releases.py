"""When a node's live reservations are expected to end: what its agent tells the gates, so that a
refused client can be told when to come back (kvgate.policy.retry_forecast).

Pure. A reservation that carries its request's output budget ends about `output_tokens / rate` after
it started decoding, at the engine's measured per-request decode rate (kvgate.agent.decode_rate), and
never after its lease. It starts decoding at its grant, or, where its holder reports the first token
(an endpoint picker reads the engine's answer), at that first token, and not before it is told so.
Prefill is not counted apart from the grant: the rate is measured over prefill and decode alike. A
reservation past its expected end is expected now (0 s). One without an output budget has no
expected end and is left out: it frees capacity the forecast did not count on, never the other way.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvgate.agent.ledger import Reservation
from kvgate.headroom.snapshot import ExpectedRelease

# Entries per message: a node runs a few dozen long requests at most; past this the latest ones are
# folded into the last entry.
MAX_RELEASES = 64


def expected_releases(
    reservations: Iterable[Reservation],
    now: float,
    decode_tokens_per_s: float | None,
    limit: int = MAX_RELEASES,
) -> tuple[ExpectedRelease, ...]:
    """Soonest first; empty without a measured rate. The last of `limit` entries stands for every
    later one (their tokens together, at the latest time), so nothing is expected earlier than it is."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not decode_tokens_per_s or decode_tokens_per_s <= 0:
        return ()
    rate = decode_tokens_per_s
    ends = sorted(
        (max(0.0, min(_decoding_from(r, now) + r.output_tokens / rate, r.expires_at) - now), r.own_tokens)
        for r in reservations
        if r.output_tokens > 0
    )
    if len(ends) > limit:
        folded = sum(tokens for _, tokens in ends[limit - 1 :])
        ends = [*ends[: limit - 1], (ends[-1][0], folded)]
    return tuple(ExpectedRelease(after_s, tokens) for after_s, tokens in ends)


def _decoding_from(reservation: Reservation, now: float) -> float:
    if reservation.first_token_at is not None:
        return reservation.first_token_at
    return now if reservation.reports_first_token else reservation.granted_at
