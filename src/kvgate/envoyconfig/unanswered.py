"""Where Envoy sends a request the gate did not answer: by the size of its body.

When the gate is down, or answers after ext_proc's message_timeout, Envoy fails open
(`failure_mode_allow`) and the request keeps the route Envoy chose on its headers: Envoy picks a route
before any HTTP filter runs (`ActiveStream::decodeHeaders` calls `refreshCachedRoute()` before the
filter chain, source/common/http/conn_manager_impl.cc), and ext_proc failing open leaves it in place
(`Filter::onMessageTimeout` and `onGrpcError` only `clearAsyncState()`,
source/extensions/filters/http/ext_proc/ext_proc.cc; envoyproxy/envoy, Envoy 1.40). Only the gate's
answer makes Envoy choose again (it clears the route cache), and every request the gate routes carries
its pool: the x-kvgate-pool header (two round trips) and the `pool` key of its dynamic metadata (one).
So a route that requires the pool to be absent applies exactly to the requests the gate did not answer
(and, before the gate answers, to every request: the route Envoy asks the gate from, whose per-route
ext_proc metadata it must carry like the pool routes beside it).

Among those, a body that may hold more prompt tokens than the default pool admits would get that
engine's 400 (once a 120k-token prompt): its Content-Length says so without the gate. A text of b
bytes takes at most `most_tokens_per_byte()` * b + 1 tokens under every shipped calibration (one token
per byte; JSON escapes only make the body longer than the text it carries), so bodies from
`unsafe_bytes` up are refused with 503 `gate_unavailable` and Retry-After, or sent to the long pool
unreserved where the operator chooses that. A POST with no Content-Length (chunked) or a compressed one
(its Content-Length counts the compressed bytes, and Envoy inflates after choosing the route) is of
unknown size and is treated the same, on the safe side. Smaller bodies, and bodiless requests, still
fail open to the default pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvgate.config import Config
from kvgate.estimate.calibration import most_tokens_per_byte
from kvgate.policy.decision import Reason, Refusal
from kvgate.policy.refusals import HttpAnswer, Refusals

# What to do with an unanswered request that may be too long for the default pool.
LongChoice = Literal["refuse", "long-pool"]
LONG_CHOICES: tuple[LongChoice, ...] = ("refuse", "long-pool")

GATE_UNAVAILABLE = Refusal(
    Reason.GATE_UNAVAILABLE,
    "The admission gate did not answer, and this request may be too long for the interactive pool; "
    "retry shortly.",
)


@dataclass(frozen=True, slots=True)
class Unanswered:
    # Bodies of this many bytes and more may hold more tokens than the default pool admits.
    unsafe_bytes: int
    # None: refuse them; else the pool they go to, unreserved.
    long_pool: str | None


def unsafe_bytes(tokens: int, tokens_per_byte: float) -> int:
    """The fewest body bytes that may hold more than `tokens` tokens, at `tokens_per_byte` * bytes + 1
    at most: every smaller body certainly fits."""
    return math.floor((tokens - 1) / tokens_per_byte) + 1


def interactive_limit(config: Config, pool: str) -> int | None:
    """The fewest tokens any model routed to `pool` as its interactive pool admits there (the pool's
    max-model-len); None when no model sends its short requests to `pool`."""
    limits = [
        model.capped().interactive_max_tokens
        for model in (config.default_model, *config.models)
        if model.pools.interactive == pool
    ]
    return min(limits, default=None)


def unanswered(config: Config, default_pool: str, long_choice: LongChoice) -> Unanswered | None:
    """The fail-open split for `default_pool`; None when no model limits it (nothing to protect)."""
    limit = interactive_limit(config, default_pool)
    if limit is None:
        return None
    long_pool = config.default_model.pools.long if long_choice == "long-pool" else None
    return Unanswered(unsafe_bytes(limit, most_tokens_per_byte()), long_pool)


def gate_unavailable() -> HttpAnswer:
    """Envoy's own answer in place of the gate's, from the one refusal table: Retry-After, the reason
    header and OpenAI's error shape on every path (an Anthropic SDK still retries a 503)."""
    return Refusals().answer(GATE_UNAVAILABLE, None)
