"""Which node of the long-context pool should hold a request: pure, over the gate's headroom view.

Without prefix affinity, the fresh, healthy nodes whose headroom fits are tried least prefill backlog
first (`NodeView.prefill_backlog_tokens`: granted prompt tokens the engine has yet to prefill), most
headroom first among equals. A long request's first token waits for the prompts granted before it on
its node: engines prefill waiting prompts first come first served. Most headroom first, the order
before this one, sent a request to the node with the fewest or shortest requests running, which on
the Mooncake replay is often the one still prefilling the last big prompt; least backlog first took
the replay's long TTFT p50 from 222 to 183 ms (round robin: 160 ms) at the same preemptions (0), chat
p99 293 -> 251 ms (`kvgate demo --trace mooncake_conversation_first_half --speed 6 --only
kvgate_prefix_off`, 2026-12-03; with affinity, below, 267 -> 185 ms). A pool at rest (no backlog
anywhere) still spreads by headroom.

With prefix affinity (`placement.prefix_affinity`), a request whose prompt begins as one a node
already holds (by that node's prefix summary) is placed by the node's prefill backlog less twice what
it holds of the prompt (`CACHED_WEIGHT`): the engine skips the prefill of what it holds, and the agent
charges once what live requests there share, so the node holding most of the prompt goes first unless
it has that much more prompt queued than another (then the request starts sooner elsewhere, and that
node caches the prompt too). A node holding the prompt is favoured so only while its requests in
flight stay within `load_bound` x the pool's mean + 1, the bound of consistent hashing with bounded
loads (Mirrokni, Thorup, Zadimoghaddam 2018; SGLang's cache-aware router and llm-d's scorers weigh
prefix hits against load the same way). Past it, the node is tried after the others, so a flood of
one document spreads, and the node it spills onto caches the document too.

Soft pools (docs/operations.md, "Soft pools"): a node whose agent says it is interactive and lends
(`NodeHeadroom.role`, `lend_tokens`) is placed like a long node, with what it lends
(min(headroom, lend_tokens)) as its room, and not at all for a request whose uncached prompt is past
its `lend_max_prompt_tokens`. It competes with the long nodes rather than waiting for them to fill: on
the Mooncake replay the long nodes carry 96% of the prefill work on three of four nodes, and a long
request's first token waits on that work, so an idle lender's prefill is worth taking early (a
900 s window: 129 -> 600 long requests lent, long TTFT p50 314 -> 265 ms, p99 2.3 -> 1.3 s; chat p99
279 -> 360 ms). Chat is kept whole by the agent's limits (its reserve, the prompt cap, the prefill
budget). The agent holds the same limits exactly; these only spare a Reserve it would refuse. An
interactive node that does not lend is never asked.

No node is asked for a request longer than its engine serves (`NodeHeadroom.max_model_len`, from the
engine's /v1/models): an interactive engine often runs a short max-model-len (4,096 in the chart's
simulator), and vLLM answers a request past it with 400 whatever room it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from kvgate.headroom.snapshot import NodeRole, NodeView, PrefixChain

StalePolicy = Literal["probe", "exclude"]

# With prefix affinity, a token a node holds of the prompt counts twice against its prefill backlog:
# once for this request's first token, once for the requests queued behind it there, whose wait it
# would otherwise lengthen. On the Mooncake replay (one run each, 2026-12-03) a weight of 1 gave long
# TTFT p50 173 ms and 3.52M prefix-hit tokens, 2 gave 185 ms and 3.62M (holders always first, the
# rule before: 267 ms and 3.65M); 4, on 2026-12-04, 210 ms and 3.60M.
CACHED_WEIGHT = 2


@dataclass(frozen=True, slots=True)
class Affinity:
    """A request's prefix chain, and how far placement may favour the nodes that hold it."""

    chain: PrefixChain
    load_bound: float


class Placement(StrEnum):
    OFF = "off"  # no affinity asked
    COLD = "cold"  # no node that fits holds any of the prefix
    AFFINITY = "affinity"  # the first node tried holds part of it
    # Nodes that hold it are past the load bound, or have more prompt queued than twice what they hold
    # of this one: another goes first.
    BOUNDED = "bounded"


@dataclass(frozen=True, slots=True)
class NodeChoice:
    """Nodes to try a Reserve on, best first. Empty `candidates` with `any_usable` False means 503."""

    candidates: tuple[NodeView, ...]
    any_usable: bool
    # Per candidate, the tokens of the request's prefix it is expected to hold (all 0 without affinity).
    cached_tokens: tuple[int, ...] = ()
    placement: Placement = Placement.OFF


def choose_nodes(
    nodes: Sequence[NodeView],
    tokens: int,
    stale: StalePolicy,
    affinity: Affinity | None = None,
    *,
    output_tokens: int = 0,
) -> NodeChoice:
    """Fresh, healthy nodes with room for `tokens`, least prefill backlog first, then most room;
    with `affinity`, least backlog less twice what each holds of the prompt's prefix, and the nodes
    holding it past the load bound after the others. A node that lends (see the module doc) is one of
    them, with what it lends as its room.

    A stale node is neither full nor empty: its agent still grants reservations atomically from its own
    latest sample, so with `stale: probe` it is asked after every fresh node; with `exclude` it is not
    asked at all. Disconnected or unhealthy nodes are never asked. `output_tokens`, the request's output
    budget within `tokens`, tells its prompt (0: the whole of `tokens` is taken as prompt).
    """
    fresh: list[NodeView] = []
    stale_own: list[NodeView] = []
    stale_lenders: list[NodeView] = []
    for node in nodes:
        if not _eligible(node, tokens):
            continue
        lender = _interactive(node)
        if node.fresh:
            fresh.append(node)
        elif stale == "probe":
            (stale_lenders if lender else stale_own).append(node)
    any_usable = bool(fresh or stale_own or stale_lenders)
    chain = affinity.chain if affinity is not None else None
    cached = {
        n.agent: _held(n, chain) if chain is not None else 0 for n in (*fresh, *stale_own, *stale_lenders)
    }
    fitting = [n for n in fresh if _fits(n, tokens, output_tokens, cached[n.agent])]
    by_backlog = sorted(fitting, key=_least_backlog_then_most_room)
    stale_nodes = stale_own + stale_lenders
    if affinity is None:
        ordered = tuple(by_backlog + stale_nodes)
        return NodeChoice(ordered, any_usable, (0,) * len(ordered))
    loads = [_load(n) for n in fresh]
    bound = affinity.load_bound * (sum(loads) / len(loads) if loads else 0.0) + 1
    past_bound = [n for n in by_backlog if cached[n.agent] > 0 and _load(n) > bound]
    skipped = {n.agent for n in past_bound}
    # The prompt is the same on every node: what differs is the prefill queued there and what of the
    # prompt the node holds.
    first_token_wait = sorted(
        (n for n in fitting if n.agent not in skipped),
        key=lambda n: (
            n.prefill_backlog_tokens - CACHED_WEIGHT * cached[n.agent],
            -cached[n.agent],
            -_room(n),
        ),
    )
    ordered = tuple(first_token_wait + past_bound + stale_nodes)
    if first_token_wait and cached[first_token_wait[0].agent] > 0:
        placement = Placement.AFFINITY
    elif any(cached[n.agent] > 0 for n in fitting):
        placement = Placement.BOUNDED
    else:
        placement = Placement.COLD
    return NodeChoice(ordered, any_usable, tuple(cached[n.agent] for n in ordered), placement)


def takes_now(node: NodeView, tokens: int, output_tokens: int = 0) -> bool:
    """Whether a fresh, healthy node would be tried for a request of `tokens` now and has room for all
    of it (none of its prompt counted as cached): as `choose_nodes` judges a node, on the safe side."""
    return node.fresh and _eligible(node, tokens) and _fits(node, tokens, output_tokens, 0)


def _eligible(node: NodeView, tokens: int) -> bool:
    """A healthy node whose engine serves a request of `tokens`, and that lends if it serves chat."""
    return node.usable and (not _interactive(node) or _lends(node)) and _serves(node, tokens)


def _least_backlog_then_most_room(node: NodeView) -> tuple[float, int]:
    return (node.prefill_backlog_tokens, -_room(node))


def _fits(node: NodeView, tokens: int, output_tokens: int, cached: int) -> bool:
    """A node asks only for what it does not hold (at best: blocks it holds idle are charged again);
    a lender also takes no uncached prompt past its cap."""
    if not _interactive(node):
        return _room(node) >= tokens - cached
    return _room(node) >= tokens - cached and _prompt_fits(node, tokens - output_tokens - cached)


def _serves(node: NodeView, tokens: int) -> bool:
    """Whether the node's engine takes a request of `tokens` (prompt + output) at all."""
    limit = node.headroom.max_model_len if node.headroom is not None else 0
    return limit == 0 or tokens <= limit


def _room(node: NodeView) -> int:
    """What one request may take on the node now: its headroom, within what it lends on a lender."""
    if node.headroom is None:
        return 0
    if node.headroom.lend_tokens is None:
        return node.headroom.headroom_tokens
    return min(node.headroom.headroom_tokens, node.headroom.lend_tokens)


def _interactive(node: NodeView) -> bool:
    return node.headroom is not None and node.headroom.role is NodeRole.INTERACTIVE


def _lends(node: NodeView) -> bool:
    return node.headroom is not None and node.headroom.lend_tokens is not None


def _prompt_fits(node: NodeView, uncached_prompt_tokens: int) -> bool:
    cap = node.headroom.lend_max_prompt_tokens if node.headroom is not None else 0
    return cap == 0 or uncached_prompt_tokens <= cap


def _load(node: NodeView) -> int:
    return node.headroom.reservations if node.headroom is not None else 0


def _held(node: NodeView, chain: PrefixChain) -> int:
    if node.headroom is None:
        return 0
    return node.headroom.prefix.matched_blocks(chain) * chain.block_tokens
