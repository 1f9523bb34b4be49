"""The soak's traffic: a fixed mix of request kinds sent open loop at a steady rate, and what came back.

Kinds: short chats (interactive), long requests (long-context pool, reserved on a node), long requests
that generate for longer than the gate's reservation lease (`long_held`: their reservations live only
if the gate renews them), too-long requests (the gate's 413), malformed JSON (the gate's 400), and gzip
bodies of short and long chats. Every answer is sorted into one outcome:
- `ok`: a 2xx from a node of the pool the kind belongs to;
- `refused`: an answer of the gate itself (it carries x-kvgate-reason), by status and reason;
- `fail_open`: an answer from a node of another pool (the gate was unreachable and Envoy let the
  request through to the interactive pool), by node and status;
- `error`: any other non-2xx, e.g. Envoy's own 503 when an upstream reset;
- `lost`: no HTTP answer at all (connection error or timeout).
Every answer that is neither `ok` nor a refusal its kind may get is kept with when it was sent and when
it came back (`Tally.failures`), so the soak can charge it to the fault it followed.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

NODE_HEADER = "x-kvgate-sim-node"
REASON_HEADER = "x-kvgate-reason"

HELD_KIND = "long_held"
# Per kind: (weight, pool whose nodes serve it, or None when the gate answers it itself).
KINDS: dict[str, tuple[float, str | None]] = {
    "short": (0.53, "interactive"),
    "long": (0.15, "long"),
    # Few: each holds about a quarter of a long node for 1.5 leases.
    HELD_KIND: (0.02, "long"),
    "too_long": (0.05, None),
    "malformed": (0.10, None),
    "gzip_short": (0.10, "interactive"),
    "gzip_long": (0.05, "long"),
}
# The gate's own answers expected per kind (anything else it answers is still counted, by reason).
EXPECTED_REFUSALS = {"too_long": (413, "too_long"), "malformed": (400, "invalid_request")}
_WORDS = (
    "the", "report", "lists", "revenue", "growth", "risk", "margin", "quarter", "customer", "supply",
    "chain", "forecast", "team", "plan", "model", "cache", "token", "request", "node", "memory",
    "budget", "latency", "review", "summary", "answer", "question", "detail",
)  # fmt: skip


def text_of(n_bytes: int, rng: random.Random) -> str:
    words: list[str] = []
    size = 0
    while size < n_bytes:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def chat_body(n_bytes: int, max_tokens: int, rng: random.Random) -> bytes:
    message = {"role": "user", "content": text_of(n_bytes, rng)}
    return json.dumps({"model": "kvgate-sim", "messages": [message], "max_tokens": max_tokens}).encode()


@dataclass(frozen=True, slots=True)
class Planned:
    kind: str
    body: bytes
    headers: dict[str, str]


def make_bodies(seed: int, held_output_tokens: int, variants: int = 8) -> dict[str, list[Planned]]:
    """A few bodies of every kind, built once: the soak measures the stack, not JSON encoding.
    `held_output_tokens`: the output of a `long_held` request, which sets how long it runs."""
    rng = random.Random(seed)
    short = [chat_body(rng.randint(2_000, 4_000), 32, rng) for _ in range(variants)]
    # About 8k tokens by any count (the simulator's is bytes / 4): the long pool, well under 16,384.
    long = [chat_body(rng.randint(28_000, 34_000), 64, rng) for _ in range(variants)]
    held = [chat_body(rng.randint(28_000, 34_000), held_output_tokens, rng) for _ in range(2)]
    json_type = {"content-type": "application/json"}
    gz = {**json_type, "content-encoding": "gzip"}
    return {
        "short": [Planned("short", body, json_type) for body in short],
        "long": [Planned("long", body, json_type) for body in long],
        HELD_KIND: [Planned(HELD_KIND, body, json_type) for body in held],
        # Surely too long without a tokenizer: the gate refuses only when its whole band is above the
        # limit, so the output budget alone passes it.
        "too_long": [Planned("too_long", chat_body(2_000, 20_000, rng), json_type)],
        "malformed": [Planned("malformed", b'{"model": "kvgate-sim", "messages": [{"role": "us', json_type)],
        "gzip_short": [Planned("gzip_short", gzip.compress(body), gz) for body in short],
        "gzip_long": [Planned("gzip_long", gzip.compress(body), gz) for body in long],
    }


def node_pool(node: str) -> str:
    return node.split("-", 1)[0]


def classify(kind: str, status: int, headers: dict[str, str]) -> str:
    """One outcome key for an answer: see the module doc."""
    node = headers.get(NODE_HEADER)
    if node is not None:
        if 200 <= status < 300 and node_pool(node) == KINDS[kind][1]:
            return "ok"
        return f"fail_open {node} {status}"
    reason = headers.get(REASON_HEADER)
    if reason is not None:
        return f"refused {status} {reason}"
    return f"error {status}"


def unexpected_refusal(kind: str, outcome: str) -> bool:
    """A refusal the kind should never get (a short chat refused, a malformed body answered 413...)."""
    if not outcome.startswith("refused"):
        return False
    _, status, reason = outcome.split()
    if reason == "gate_unavailable":
        # Envoy's own answer while the gate is down (failing open by size, kvgate.envoyconfig.unanswered):
        # a body that may be too long for the interactive pool, compressed or chunked, is told to retry.
        return False
    long_refusal = KINDS[kind][1] == "long" and status in ("429", "503")
    return (int(status), reason) != EXPECTED_REFUSALS.get(kind) and not long_refusal


def failed(kind: str, outcome: str) -> bool:
    """Neither served where it belongs nor refused the way its kind may be."""
    return outcome.startswith(("lost", "error", "fail_open")) or unexpected_refusal(kind, outcome)


@dataclass(frozen=True, slots=True)
class Failure:
    kind: str
    outcome: str
    sent_at: float  # time.monotonic()
    ended_at: float


@dataclass
class Tally:
    """Outcomes by kind, the latency of the `ok` answers (long_held apart), and every failed answer with
    its times."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    sent: int = 0
    skipped: int = 0

    def count(self, prefix: str) -> int:
        return sum(n for (_kind, outcome), n in self.outcomes.items() if outcome.startswith(prefix))

    def unexpected_refusals(self) -> int:
        return sum(n for (kind, outcome), n in self.outcomes.items() if unexpected_refusal(kind, outcome))


async def _one(session: aiohttp.ClientSession, url: str, planned: Planned, tally: Tally) -> None:
    started = time.monotonic()
    try:
        async with session.post(url, data=planned.body, headers=planned.headers) as response:
            await response.read()
            headers = {k.lower(): v for k, v in response.headers.items()}
            outcome = classify(planned.kind, response.status, headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome = f"lost {type(exc).__name__}"
    ended = time.monotonic()
    tally.outcomes[planned.kind, outcome] += 1
    if outcome == "ok":
        # A long_held request's latency is the length it was made to run.
        if planned.kind != HELD_KIND:
            tally.latencies_s.append(ended - started)
    elif failed(planned.kind, outcome):
        tally.failures.append(Failure(planned.kind, outcome, started, ended))


async def send_steady(
    url: str,
    rate: float,
    duration_s: float,
    seed: int,
    *,
    held_output_tokens: int,
    max_in_flight: int = 256,
    timeout_s: float = 60.0,
) -> Tally:
    """Send `rate` requests per second for `duration_s` (open loop) and wait for every answer."""
    bodies = make_bodies(seed, held_output_tokens)
    rng = random.Random(seed + 1)
    kinds = list(KINDS)
    weights = [KINDS[kind][0] for kind in kinds]
    tally = Tally()
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=5.0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=max_in_flight)
    ) as session:
        start = time.monotonic()
        for i in range(int(rate * duration_s)):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= max_in_flight:
                tally.skipped += 1
                continue
            planned = rng.choice(bodies[rng.choices(kinds, weights)[0]])
            task = asyncio.create_task(_one(session, url, planned, tally))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            tally.sent += 1
        if tasks:
            await asyncio.gather(*tasks)
    return tally
