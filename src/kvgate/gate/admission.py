"""Admission against live headroom: reserve on a node before a long request is let through.

The pure parts (which nodes, what level, who is shed) live in kvgate.policy; this module does the
waiting and the talking to agents. A long request is admitted only once an agent has granted its
reservation: several requests that arrive within one sampling period cannot all read the same free
capacity, because the agent charges each grant before answering the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.config import AdmissionConfig, ModelConfig
from kvgate.errors import HeadroomError
from kvgate.gate.waitqueue import WaitQueue
from kvgate.headroom.snapshot import NodeView
from kvgate.headroom.view import HeadroomView
from kvgate.policy import Decision, Reason, Refusal, Route
from kvgate.policy.nodes import choose_nodes
from kvgate.policy.shedding import should_shed
from kvgate.policy.water import Breaker, BreakerState, Level, WaterLevel, pool_signals
from kvgate.telemetry import (
    ADMISSION_WAITING,
    NODE_AGE,
    NODE_FRESH,
    NODE_HEADROOM,
    POOL_BREAKER_OPEN,
    POOL_WATER_LEVEL,
    GateMetrics,
    observe,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ticket:
    """A granted reservation, released when the request ends."""

    agent: str
    request_id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Admitted:
    decision: Decision
    ticket: Ticket | None = None


_ERROR_CODES = {
    Reason.SHED: "pool_saturated",
    Reason.QUEUE_FULL: "no_capacity",
    Reason.NO_CAPACITY: "no_capacity",
    Reason.NO_HEALTHY_NODE: "no_healthy_node",
}


class _PoolState:
    def __init__(self, config: AdmissionConfig) -> None:
        self.water = WaterLevel(config.water)
        self.breaker = Breaker(config.breaker_open_s, config.breaker_probes)

    def observe(self, view: HeadroomView, waiting: int, queue_size: int, now: float) -> Level:
        level = self.water.update(pool_signals(view.snapshot(), waiting, queue_size))
        self.breaker.observe(level, now)
        return level


class Admission:
    def __init__(
        self,
        config: AdmissionConfig,
        long_view: HeadroomView | None,
        interactive_view: HeadroomView | None = None,
        telemetry: GateMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._long_view = long_view
        self._interactive_view = interactive_view
        self._clock = clock
        self._queue = WaitQueue(config.queue_size)
        self._long = _PoolState(config)
        self._interactive = _PoolState(config)
        self._ranks = {name: rank for rank, name in enumerate(config.priorities)}
        self._pump: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._metrics = telemetry or GateMetrics()
        self._observe_gauges()

    def _observe_gauges(self) -> None:
        pools = {
            "long": (self._long_view, self._long),
            "interactive": (self._interactive_view, self._interactive),
        }

        def water() -> list[tuple[float, dict[str, str]]]:
            return [
                (float(state.water.level), {"pool": pool}) for pool, (view, state) in pools.items() if view
            ]

        def breaker() -> list[tuple[float, dict[str, str]]]:
            states = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 1.0, BreakerState.OPEN: 2.0}
            return [
                (states[state.breaker.state], {"pool": pool}) for pool, (view, state) in pools.items() if view
            ]

        def nodes(
            read: Callable[[NodeView], float | None],
        ) -> Callable[[], list[tuple[float, dict[str, str]]]]:
            def gauge() -> list[tuple[float, dict[str, str]]]:
                found = []
                for pool, (view, _state) in pools.items():
                    for node in view.snapshot() if view else ():
                        value = read(node)
                        if value is not None:
                            found.append((value, {"pool": pool, "agent": node.agent}))
                return found

            return gauge

        m = self._metrics.meter
        observe(
            m,
            ADMISSION_WAITING,
            "{request}",
            "Long requests waiting for capacity",
            lambda: [(len(self._queue), {})],
        )
        observe(m, POOL_WATER_LEVEL, "1", "0 green, 1 yellow, 2 red", water)
        observe(m, POOL_BREAKER_OPEN, "1", "0 closed, 1 half-open, 2 open", breaker)
        observe(
            m,
            NODE_HEADROOM,
            "{token}",
            "Headroom the node's agent last reported",
            nodes(lambda n: float(n.headroom.headroom_tokens) if n.headroom else None),
        )
        observe(
            m,
            NODE_AGE,
            "s",
            "Age of the node's latest headroom message",
            nodes(lambda n: n.age_s if n.headroom else None),
        )
        observe(m, NODE_FRESH, "1", "1 when the node's headroom is fresh", nodes(lambda n: float(n.fresh)))

    async def start(self) -> None:
        for view in (self._long_view, self._interactive_view):
            if view is not None:
                await view.start()
        if self._long_view is not None:
            self._pump = asyncio.create_task(self._pump_updates(self._long_view), name="kvgate-admission")

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        for view in (self._long_view, self._interactive_view):
            if view is not None:
                await view.stop()

    def rank(self, priority: str | None) -> int:
        return self._ranks.get(priority or "", self._ranks[self._config.default_priority])

    async def admit(
        self, route: Route, model: ModelConfig, priority: str | None, request_id: str
    ) -> Admitted:
        rank = self.rank(priority)
        if route.reason is Reason.SHORT:
            return Admitted(self._admit_interactive(route, rank))
        if route.reason is not Reason.LONG or self._long_view is None:
            return Admitted(route)
        if not choose_nodes(self._long_view.snapshot(), route.tokens, self._config.stale_nodes).any_usable:
            return Admitted(self._no_healthy_node(route))
        level = self._long.observe(self._long_view, len(self._queue), self._config.queue_size, self._clock())
        if should_shed(level, self._long.breaker, rank, len(self._ranks)):
            return Admitted(
                self._overflow(route, model, Reason.SHED, f"the long-context pool is {level.name.lower()}")
            )
        return await self._admit_long(route, model, rank, request_id)

    def _admit_interactive(self, route: Route, rank: int) -> Decision:
        if self._interactive_view is None:
            return route
        level = self._interactive.observe(self._interactive_view, 0, 1, self._clock())
        # The interactive pool is not reserved per request; when red, only its lowest priority is shed.
        if level is Level.RED and len(self._ranks) > 1 and rank == len(self._ranks) - 1:
            return self._refuse(429, Reason.SHED, route.tokens, "The interactive pool is saturated.")
        return route

    async def _admit_long(self, route: Route, model: ModelConfig, rank: int, request_id: str) -> Admitted:
        assert self._long_view is not None
        place = self._queue.join(rank)
        if place is None:
            return Admitted(self._overflow(route, model, Reason.QUEUE_FULL, "the admission queue is full"))
        deadline = self._clock() + self._config.max_wait_s
        try:
            while True:
                if self._queue.is_head(place):
                    choice = choose_nodes(self._long_view.snapshot(), route.tokens, self._config.stale_nodes)
                    if not choice.any_usable:
                        return Admitted(self._no_healthy_node(route))
                    for node in choice.candidates:
                        ticket = await self._try_reserve(node.agent, request_id, route.tokens)
                        if ticket is not None and node.headroom is not None:
                            return Admitted(
                                Route(route.pool, Reason.LONG, route.tokens, node.headroom.endpoint), ticket
                            )
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return Admitted(self._overflow(route, model, Reason.NO_CAPACITY, "no node has room"))
                await self._queue.wait_change(remaining)
        finally:
            self._queue.leave(place)

    async def _try_reserve(self, agent: str, request_id: str, tokens: int) -> Ticket | None:
        assert self._long_view is not None
        try:
            outcome = await self._long_view.reserve(agent, request_id, tokens)
        except asyncio.CancelledError:
            # The stream went away mid-Reserve (client abort, Envoy timeout): the agent may have granted
            # already, so give it back now rather than hold the capacity until the lease runs out.
            self._release_later(Ticket(agent, request_id, tokens))
            raise
        except HeadroomError as error:
            log.warning("reserve on %s failed: %s", agent, error)
            self._metrics.reservation("error")
            return None
        self._metrics.reservation("granted" if outcome.granted else "refused")
        return Ticket(agent, request_id, tokens) if outcome.granted else None

    def _release_later(self, ticket: Ticket) -> None:
        task = asyncio.create_task(self.release(ticket))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, ticket: Ticket) -> None:
        assert self._long_view is not None
        try:
            await self._long_view.release(ticket.agent, ticket.request_id)
        except HeadroomError as error:
            # The lease expires on the agent: the capacity comes back late, not never.
            log.warning("release of %s on %s failed: %s", ticket.request_id, ticket.agent, error)
        self._queue.pulse()

    def _overflow(self, route: Route, model: ModelConfig, reason: Reason, why: str) -> Decision:
        if self._config.async_fallback:
            return Route(model.pools.async_, Reason.ASYNC, route.tokens)
        return self._refuse(
            429, reason, route.tokens, f"No capacity for a {route.tokens}-token request now: {why}."
        )

    def _no_healthy_node(self, route: Route) -> Refusal:
        return self._refuse(
            503, Reason.NO_HEALTHY_NODE, route.tokens, "No long-context node is healthy and reachable."
        )

    def _refuse(self, status: int, reason: Reason, tokens: int, message: str) -> Refusal:
        code = _ERROR_CODES[reason]
        return Refusal(
            status,
            code,
            reason,
            message + " Retry later.",
            tokens,
            retry_after_s=self._config.retry_after_s,
            error_type="rate_limit_error" if status == 429 else "server_error",
        )

    async def _pump_updates(self, view: HeadroomView) -> None:
        while True:
            await view.wait_update(1.0)
            self._queue.pulse()
