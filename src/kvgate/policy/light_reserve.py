"""Room kept for light tenants: while another tenant's request waits, a long request may take the
last `light_reserve_tokens` of room on the pool's emptiest node only if its tenant is light: no other
request of its own waits at the gate, and it has attained no more weighted service than the least
served other tenant that waits (what VTC calls a client not in the queue; a tenant below its share).

Pure. Fair shares order the waiters, but a light tenant (one request at a time, below its share) is
first in the order only once it waits, and in a pool that a flood keeps full its first token then waits
for a release that fits it: on the fairness scenario tenant B, at half its fair part, waited in the
line on 33 of its 40 requests and its TTFT p99 was 2.3-3.6 s against 240 ms alone (2026-12-04). A
request's room frees only when another ends, and kvgate never preempts, so the only way to start a
light tenant's request at once is room it did not have to wait for. The reserve holds that room back
from backlogged tenants alone, and only while another tenant's request waits at this gate: a pool one
tenant floods by itself, or nobody contends, stays work-conserving. Lightness is read when the
request asks, not when it came: a flood's first request after a lull came to an empty line too.

The check reads the agents' latest figures, as the gate's choice of node does; the agent's Reserve
still decides. It is this gate's own rule: another gate replica, or `kvgate queue`'s dispatch, does
not keep it (docs/operations.md, "Room for light tenants").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.headroom.snapshot import NodeView


def leaves_reserve(nodes: Sequence[NodeView], agent: str, tokens: int, reserve_tokens: int) -> bool:
    """Whether granting `tokens` on `agent` leaves `reserve_tokens` of room free on some usable
    node, by the nodes' latest messages."""
    for node in nodes:
        headroom = node.headroom
        if headroom is None or not node.usable or not node.fresh:
            continue
        room = headroom.headroom_tokens - (tokens if node.agent == agent else 0)
        if room >= reserve_tokens:
            return True
    return False
