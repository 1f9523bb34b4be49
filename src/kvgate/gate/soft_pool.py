"""The long pool as admission sees it under soft pools: the long pool's agents, then the interactive
pool's agents that lend (docs/operations.md, "Soft pools").

One `HeadroomSource` over two views: its snapshot is every long-pool node followed by the interactive
nodes whose agent says it lends (role interactive, `lend_tokens` set), so `choose_nodes` tries them
after the long nodes and within what they lend; a Reserve, FirstToken, Release or Renew goes to the view
that follows that agent; an update from either view wakes admission. The interactive view still serves
the interactive pool's water level as before. Pinning needs nothing more: the gate pins an admitted long
request to the endpoint its node's agent reports (vetted by that view's headroom.allowed_endpoints),
and Envoy's long_pinned cluster routes to the address in x-kvgate-endpoint whatever node it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvgate.gate.admission import HeadroomSource
from kvgate.headroom.snapshot import NodeRole, NodeView, PrefixChain, ReleaseOutcome, ReserveOutcome


def lends(node: NodeView) -> bool:
    """Whether the node's agent says it is interactive and lends to long requests."""
    data = node.headroom
    return data is not None and data.role is NodeRole.INTERACTIVE and data.lend_tokens is not None


class SoftPool:
    def __init__(self, long: HeadroomSource, interactive: HeadroomSource) -> None:
        self._long = long
        self._interactive = interactive

    def snapshot(self) -> tuple[NodeView, ...]:
        return self._long.snapshot() + tuple(n for n in self._interactive.snapshot() if lends(n))

    def _source(self, node: str) -> HeadroomSource:
        if any(n.agent == node for n in self._interactive.snapshot()):
            return self._interactive
        return self._long

    async def reserve(
        self, node: str, request_id: str, tokens: int, prefix: PrefixChain | None = None, **asked: Any
    ) -> ReserveOutcome:
        """The Reserve as admission makes it (its keyword arguments passed on as they are)."""
        return await self._source(node).reserve(node, request_id, tokens, prefix, **asked)

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        return await self._source(node).release(
            node, request_id, unanswered=unanswered, generated_tokens=generated_tokens
        )

    async def first_token(self, node: str, request_id: str) -> bool:
        return await self._source(node).first_token(node, request_id)

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]:
        return await self._source(node).renew(node, request_ids)

    async def wait_update(self, timeout_s: float) -> bool:
        """Until either pool's agents speak; False when `timeout_s` passed first."""
        waits = [asyncio.ensure_future(s.wait_update(timeout_s)) for s in (self._long, self._interactive)]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return any(not w.cancelled() and w.exception() is None and w.result() for w in done)
