"""Where a waiting head holds its place, and who may go beside it: pure, over the headroom view.

A waiter that finds no room holds its place (ReserveRequest.hold_slot) on one node only: the node
whose expected releases fit it first (`retry_forecast.forecast_fit`), else, with nothing to forecast
from, the node that must free the fewest tokens for it. Holding on several nodes would stop
backfilling on all of them for a request that will run on one. Once chosen, the node is kept while it
can still hold the request, so a forecast that wavers between two nodes does not move the hold (and
its room) back and forth.

Any other request may go now on a node where it fits beside the heads the node holds room for
(kvgate.headroom.shadow.room_for): the gate asks only there, and wakes a waiter only when such a node
exists, so the agents' refusals (held_for_head) stay rare; the agent still decides, atomically.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.headroom.shadow import room_for
from kvgate.headroom.snapshot import HeadClaim, NodeView
from kvgate.policy.retry_forecast import forecast_fit


def slot_node(
    nodes: Sequence[NodeView], tokens: int, output_tokens: int, current: str | None = None
) -> str | None:
    """The agent a waiter of `tokens` holds its place on (`current`, the one it holds now, while that
    node can still hold it); None when no usable node could ever hold it."""
    able = [
        n for n in nodes if n.usable and n.headroom is not None and n.headroom.admissible_tokens >= tokens
    ]
    if any(n.agent == current for n in able):
        return current
    fit = forecast_fit(able, tokens, output_tokens)
    if fit is not None:
        return fit.agent
    closest = max(able, key=lambda n: n.headroom.headroom_tokens if n.headroom else 0, default=None)
    return closest.agent if closest is not None else None


def fits_beside_heads(
    node: NodeView,
    tokens: int,
    rank: int,
    waiting_since_unix_ns: int,
    local: HeadClaim | None = None,
    *,
    fair_service: float = 0.0,
) -> bool:
    """Whether a request at this place in the order fits on a fresh node now by its latest message,
    beside the room the node holds for its head (and for `local`, the caller's own head holding
    there, which the message may not show yet)."""
    h = node.headroom
    if h is None or not node.usable or not node.fresh:
        return False
    return room_for(h, rank, waiting_since_unix_ns, local, fair_service=fair_service) >= tokens
