"""Which node of the long-context pool should hold a request: pure, over the gate's headroom view.

Without prefix affinity, the fresh, healthy nodes whose headroom fits are tried most headroom first.
With it (`placement.prefix_affinity`), a request whose prompt begins as one a node already holds (by
that node's prefix summary) goes there first, the node holding most of it first: the engine skips the
prefill of what it holds, and the agent charges once what live requests there share. A node is
favoured so only while its requests in flight stay within `load_bound` x the pool's mean + 1, the
bound of consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018; SGLang's
cache-aware router and llm-d's scorers weigh prefix hits against load the same way). Past it, the node
is tried after the others like any node, so a flood of one document spreads, and the node it spills
onto caches the document too.

Soft pools (docs/operations.md, "Soft pools"): nodes whose agent says they are interactive and lend
(`NodeHeadroom.role`, `lend_tokens`) are tried only after every fresh long node, for at most what they
lend (min(headroom, lend_tokens)), and not at all for a request whose uncached prompt is past their
`lend_max_prompt_tokens`. The agent holds the same limits exactly; these only spare a Reserve it would
refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from kvgate.headroom.snapshot import NodeRole, NodeView, PrefixChain

StalePolicy = Literal["probe", "exclude"]


@dataclass(frozen=True, slots=True)
class Affinity:
    """A request's prefix chain, and how far placement may favour the nodes that hold it."""

    chain: PrefixChain
    load_bound: float


class Placement(StrEnum):
    OFF = "off"  # no affinity asked
    COLD = "cold"  # no node that fits holds any of the prefix
    AFFINITY = "affinity"  # the first node tried holds part of it
    BOUNDED = "bounded"  # nodes that hold it are past the load bound: the others go first


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
    """Fresh, healthy nodes whose headroom fits, most headroom first (spreads load, keeps big holes);
    with `affinity`, the nodes that hold the prompt's prefix within the load bound before them; then
    the interactive nodes that lend enough (see the module doc).

    A stale node is neither full nor empty: its agent still grants reservations atomically from its own
    latest sample, so with `stale: probe` it is asked after every fresh node; with `exclude` it is not
    asked at all. Disconnected or unhealthy nodes are never asked. `output_tokens`, the request's output
    budget within `tokens`, tells its prompt (0: the whole of `tokens` is taken as prompt).
    """
    own = [n for n in nodes if not _interactive(n)]
    lenders = [
        n for n in nodes if _interactive(n) and n.headroom is not None and n.headroom.lend_tokens is not None
    ]
    choice = _own_nodes(own, tokens, stale, affinity)
    if not lenders:
        return choice
    return _with_lenders(choice, lenders, tokens, output_tokens=output_tokens, stale=stale, affinity=affinity)


def _own_nodes(
    nodes: Sequence[NodeView], tokens: int, stale: StalePolicy, affinity: Affinity | None
) -> NodeChoice:
    fresh: list[NodeView] = []
    stale_nodes: list[NodeView] = []
    for node in nodes:
        if not node.usable:
            continue
        if node.fresh:
            fresh.append(node)
        elif stale == "probe":
            stale_nodes.append(node)
    any_usable = bool(fresh or stale_nodes)
    if affinity is None:
        fitting = sorted((n for n in fresh if _headroom(n) >= tokens), key=lambda n: -_headroom(n))
        ordered = tuple(fitting + stale_nodes)
        return NodeChoice(ordered, any_usable, (0,) * len(ordered))
    return _with_affinity(fresh, stale_nodes, tokens, affinity, any_usable)


def _with_affinity(
    fresh: list[NodeView], stale_nodes: list[NodeView], tokens: int, affinity: Affinity, any_usable: bool
) -> NodeChoice:
    chain = affinity.chain
    cached = {n.agent: _held(n, chain) for n in fresh + stale_nodes}
    # A node asks only for what it does not hold (at best: blocks it holds idle are charged again).
    fitting = [n for n in fresh if _headroom(n) >= tokens - cached[n.agent]]
    loads = [_load(n) for n in fresh]
    bound = affinity.load_bound * (sum(loads) / len(loads) if loads else 0.0) + 1
    favoured = sorted(
        (n for n in fitting if cached[n.agent] > 0 and _load(n) <= bound),
        key=lambda n: (-cached[n.agent], -_headroom(n)),
    )
    chosen = {n.agent for n in favoured}
    rest = sorted((n for n in fitting if n.agent not in chosen), key=lambda n: -_headroom(n))
    ordered = tuple(favoured + rest + stale_nodes)
    if favoured:
        placement = Placement.AFFINITY
    elif any(cached[n.agent] > 0 for n in fitting):
        placement = Placement.BOUNDED
    else:
        placement = Placement.COLD
    return NodeChoice(ordered, any_usable, tuple(cached[n.agent] for n in ordered), placement)


def _with_lenders(
    choice: NodeChoice,
    lenders: list[NodeView],
    tokens: int,
    *,
    output_tokens: int,
    stale: StalePolicy,
    affinity: Affinity | None,
) -> NodeChoice:
    """`choice`'s fresh nodes, then the fresh lenders that fit, most room lent first, then the stale
    nodes of both kinds (lenders last)."""
    chain = affinity.chain if affinity is not None else None
    cached = dict(zip((n.agent for n in choice.candidates), choice.cached_tokens, strict=True))
    fresh: list[NodeView] = []
    stale_lenders: list[NodeView] = []
    for node in lenders:
        if not node.usable:
            continue
        held = _held(node, chain) if chain is not None else 0
        cached[node.agent] = held
        if not node.fresh:
            if stale == "probe":
                stale_lenders.append(node)
        elif _lent(node) >= tokens - held and _prompt_fits(node, tokens - output_tokens - held):
            fresh.append(node)
    fresh.sort(key=lambda n: (-cached[n.agent], -_lent(n)))
    own_fresh = [n for n in choice.candidates if n.fresh]
    own_stale = [n for n in choice.candidates if not n.fresh]
    ordered = tuple(own_fresh + fresh + own_stale + stale_lenders)
    any_usable = choice.any_usable or any(n.usable for n in lenders if n.fresh or stale == "probe")
    return NodeChoice(ordered, any_usable, tuple(cached[n.agent] for n in ordered), choice.placement)


def _interactive(node: NodeView) -> bool:
    return node.headroom is not None and node.headroom.role is NodeRole.INTERACTIVE


def _lent(node: NodeView) -> int:
    """What a lender lets one long request take now: its headroom, within what it lends."""
    assert node.headroom is not None and node.headroom.lend_tokens is not None
    return min(node.headroom.headroom_tokens, node.headroom.lend_tokens)


def _prompt_fits(node: NodeView, uncached_prompt_tokens: int) -> bool:
    cap = node.headroom.lend_max_prompt_tokens if node.headroom is not None else 0
    return cap == 0 or uncached_prompt_tokens <= cap


def _headroom(node: NodeView) -> int:
    return node.headroom.headroom_tokens if node.headroom is not None else 0


def _load(node: NodeView) -> int:
    return node.headroom.reservations if node.headroom is not None else 0


def _held(node: NodeView, chain: PrefixChain) -> int:
    if node.headroom is None:
        return 0
    return node.headroom.prefix.matched_blocks(chain) * chain.block_tokens
