"""Which engines an endpoint picker may name, and which one serves a request that holds no reservation.

Pure, over the gate's views of its agents. In picker mode (`server.protocol: endpoint-picker`, the
Gateway API Inference Extension's Endpoint Picker Protocol) the gateway asks for an engine for every
request, and may narrow the choice with a subset hint (filter metadata `envoy.lb.subset_hint`, key
`x-gateway-destination-endpoint-subset`: gateway-api-inference-extension
docs/proposals/004-endpoint-picker-protocol/README.md @84436a96): an engine outside it is never named,
and a hint that leaves none eligible is a 503 (`no_healthy_node`).

A long request is named the engine whose agent granted its reservation (kvgate.gate.admission, over
the nodes `within` the hint). Any other request reserves nothing, so it goes to the interactive engine
that is least busy (a long-context engine only where the hint allows no interactive one), by the
figures its agent streams: fewest requests queued in the engine, then fewest running, then least KV
in use, as llm-d's queue and KV-utilization scorers weigh them
(llm-d-inference-scheduler pkg/plugins/scorer). The next ones in that order follow it as the fallback
list the protocol allows (`ip:port,ip:port`): they need no reservation either, so a gateway that
retries down the list breaks nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvgate.headroom.snapshot import NodeView

# The gateway's subset hint: the endpoints it allows (None: no hint, the whole pool).
Subset = frozenset[str] | None

# Engines named for a request without a reservation: the pick and its fallbacks (server.picker_endpoints).
UNRESERVED_ENDPOINTS = 3


def allowed(node: NodeView, subset: Subset) -> bool:
    """Whether the node's engine may be named under the hint."""
    endpoint = node.headroom.endpoint if node.headroom is not None else ""
    return bool(endpoint) and (subset is None or endpoint in subset)


def within(nodes: Sequence[NodeView], subset: Subset) -> tuple[NodeView, ...]:
    """The nodes whose engine the hint allows (all of them without one)."""
    if subset is None:
        return tuple(nodes)
    return tuple(node for node in nodes if allowed(node, subset))


def least_busy(
    nodes: Sequence[NodeView], subset: Subset, count: int = UNRESERVED_ENDPOINTS
) -> tuple[str, ...]:
    """Up to `count` engines for a request that reserves nothing, best first: fresh, healthy nodes the
    hint allows, fewest queued, then running, then KV in use. Empty: none is eligible (503)."""
    eligible = [n for n in nodes if n.usable and n.fresh and allowed(n, subset)]
    eligible.sort(key=_busy)
    endpoints: list[str] = []
    for node in eligible:
        assert node.headroom is not None
        if node.headroom.endpoint not in endpoints:
            endpoints.append(node.headroom.endpoint)
    return tuple(endpoints[:count])


def _busy(node: NodeView) -> tuple[int, int, float]:
    data = node.headroom
    assert data is not None
    usage = data.kv_usage if data.kv_usage is not None else math.inf
    return (data.waiting or 0, data.running or 0, usage)
