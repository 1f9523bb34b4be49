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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from kvgate.headroom.snapshot import NodeView, PrefixChain

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
    nodes: Sequence[NodeView], tokens: int, stale: StalePolicy, affinity: Affinity | None = None
) -> NodeChoice:
    """Fresh, healthy nodes whose headroom fits, most headroom first (spreads load, keeps big holes);
    with `affinity`, the nodes that hold the prompt's prefix within the load bound before them.

    A stale node is neither full nor empty: its agent still grants reservations atomically from its own
    latest sample, so with `stale: probe` it is asked after every fresh node; with `exclude` it is not
    asked at all. Disconnected or unhealthy nodes are never asked.
    """
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


def _headroom(node: NodeView) -> int:
    return node.headroom.headroom_tokens if node.headroom is not None else 0


def _load(node: NodeView) -> int:
    return node.headroom.reservations if node.headroom is not None else 0


def _held(node: NodeView, chain: PrefixChain) -> int:
    if node.headroom is None:
        return 0
    return node.headroom.prefix.matched_blocks(chain) * chain.block_tokens
