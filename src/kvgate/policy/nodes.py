"""Which node of the long-context pool should hold a request: pure, over the gate's headroom view."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvgate.headroom.snapshot import NodeView

StalePolicy = Literal["probe", "exclude"]


@dataclass(frozen=True, slots=True)
class NodeChoice:
    """Nodes to try a Reserve on, best first. Empty `candidates` with `any_usable` False means 503."""

    candidates: tuple[NodeView, ...]
    any_usable: bool


def choose_nodes(nodes: Sequence[NodeView], tokens: int, stale: StalePolicy) -> NodeChoice:
    """Fresh, healthy nodes whose headroom fits, most headroom first (spreads load, keeps big holes).

    A stale node is neither full nor empty: its agent still grants reservations atomically from its own
    latest sample, so with `stale: probe` it is asked after every fresh node; with `exclude` it is not
    asked at all. Disconnected or unhealthy nodes are never asked.
    """
    fresh: list[NodeView] = []
    stale_nodes: list[NodeView] = []
    for node in nodes:
        if node.headroom is None or not node.connected or not node.healthy:
            continue
        if node.fresh:
            fresh.append(node)
        elif stale == "probe":
            stale_nodes.append(node)
    fitting = sorted(
        (n for n in fresh if n.headroom is not None and n.headroom.headroom_tokens >= tokens),
        key=lambda n: -n.headroom.headroom_tokens if n.headroom else 0,
    )
    return NodeChoice(tuple(fitting + stale_nodes), any_usable=bool(fresh or stale_nodes))
