"""Whether a job can ever fit the long-context pool, from the agents' reports. Pure.

Which node to try first is the gate's rule (kvgate.policy.nodes.choose_nodes); this module answers
the one question the queue adds: a job bigger than every node's admissible capacity (capacity x
safety ratio, what the agent grants against) would wait forever, so it fails at once instead.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvgate.headroom.snapshot import NodeView
from kvgate.queue.jobs import JobError


class Fit(enum.Enum):
    FITS = "fits"  # some node can hold it when idle
    TOO_BIG = "too_big"  # every node has reported, and none can
    UNKNOWN = "unknown"  # no node can by what is known, but some node has not reported its capacity


def admissible_tokens(node: NodeView) -> int | None:
    """The most tokens the node's agent grants when idle; None while it is unknown."""
    report = node.headroom
    if report is None or report.capacity_tokens <= 0:
        return None
    return report.admissible_tokens


def fit(nodes: Sequence[NodeView], tokens: int) -> Fit:
    limits = [admissible_tokens(node) for node in nodes]
    if any(limit is not None and limit >= tokens for limit in limits):
        return Fit.FITS
    if limits and all(limit is not None for limit in limits):
        return Fit.TOO_BIG
    return Fit.UNKNOWN


def too_big_error(nodes: Sequence[NodeView], tokens: int) -> JobError:
    largest = max((admissible_tokens(node) or 0 for node in nodes), default=0)
    return JobError(
        "exceeds_node_capacity",
        f"This request needs {tokens} tokens, more than any node of the long-context pool admits even "
        f"when idle (the largest admits {largest}). Shorten the prompt or lower max_tokens.",
    )
