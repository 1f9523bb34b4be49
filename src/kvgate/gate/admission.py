"""Admission against live headroom: reserve on a node before a long request is let through.

This module waits and talks to agents; every rule it follows is kvgate.policy's: which nodes to
ask (`nodes.choose_nodes`), how hot a pool is and who is shed (`pressure.PoolPressure`), what a
request that finds no room gets (`overflow`). A long request is admitted only once an agent has
granted its reservation: several requests that arrive within one sampling period cannot all read
the same free capacity, because the agent charges each grant before answering the next.

A long request refused for want of capacity is told when to come back (`retry_forecast.RetryPlanner`:
when the agents expect enough KV to free for it, or admission.retry_after_s), and every such answer is
checked against when its capacity did free, on each message of the pool's agents.

Admission needs little of a headroom source, and says so in `HeadroomSource`: the gate's
`kvgate.headroom.view.HeadroomView` is one, and `kvgate.agent.in_process.FakeHeadroom` (in-process
agents with a controllable clock) is another, for tests that drive admission without processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvgate.config import AdmissionConfig, ModelConfig
from kvgate.errors import HeadroomError
from kvgate.gate.waitqueue import MONOTONIC, Clock, WaitQueue
from kvgate.headroom import giveback
from kvgate.headroom.giveback import unanswered
from kvgate.headroom.snapshot import NodeView, PrefixChain, ReleaseOutcome, ReserveOutcome
from kvgate.policy import Decision, Reason, Refusal, Route
from kvgate.policy.identity import Priorities
from kvgate.policy.nodes import Affinity, choose_nodes
from kvgate.policy.overflow import interactive_saturated, no_healthy_node, overflow
from kvgate.policy.pressure import PoolPressure
from kvgate.policy.retry_forecast import RetryPlanner, RetrySettings
from kvgate.policy.shedding import PoolKind, Verdict
from kvgate.policy.water import pool_signals
from kvgate.telemetry import AdmissionGauges, GateMetrics, NodeGauges, PoolGauges

log = logging.getLogger(__name__)


class HeadroomSource(Protocol):
    """What admission needs of a pool's agents (see the module doc for the two implementations)."""

    def snapshot(self) -> tuple[NodeView, ...]: ...

    async def reserve(
        self,
        node: str,
        request_id: str,
        tokens: int,
        prefix: PrefixChain | None = None,
        *,
        output_tokens: int = 0,
    ) -> ReserveOutcome:
        """The agent's answer, a refusal included; HeadroomError when it gives none. Blocks of `prefix`
        that live reservations on the node hold are not charged again; `output_tokens` (the request's
        output budget, 0 when unknown) tells the agent when the reservation is expected to end."""
        ...

    async def release(self, node: str, request_id: str, *, unanswered: bool = False) -> ReleaseOutcome:
        """End the reservation this source made (it releases as the holder it reserved as: an agent
        frees only its holder's reservations); `unanswered`: its Reserve got no answer (giveback)."""
        ...

    async def wait_update(self, timeout_s: float) -> bool: ...


@dataclass(frozen=True, slots=True)
class Ticket:
    """A granted reservation, released when the request ends: the agent's answer, as it gave it."""

    agent: str
    request_id: str  # the gate's reservation id (kvgate.gate.reservation_ids), not the client's
    tokens: int
    outcome: ReserveOutcome

    @property
    def charged_tokens(self) -> int:
        """What the agent added to its reserved tokens (less than `tokens` with shared prefixes)."""
        return self.outcome.charged_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine is expected to find in its prefix cache."""
        return self.outcome.cached_tokens


@dataclass(frozen=True, slots=True)
class _Ask:
    """One long request asking for a node."""

    request_id: str
    rank: int
    max_wait_s: float
    affinity: Affinity | None
    output_tokens: int
    # Agents whose Reserve went unanswered: their give-back is in flight, so this request does not
    # ask them again (the give-back could release the new grant).
    unanswered_by: set[str] = dataclasses.field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Admitted:
    decision: Decision
    ticket: Ticket | None = None


class Admission:
    def __init__(
        self,
        config: AdmissionConfig,
        long: HeadroomSource | None,
        interactive: HeadroomSource | None = None,
        telemetry: GateMetrics | None = None,
        clock: Clock = MONOTONIC,
        *,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._config = config
        self._long = long
        self._interactive = interactive
        self._clock = clock
        self._queue = WaitQueue(config.queue_size, clock)
        self._long_pressure = PoolPressure(PoolKind.LONG, config)
        self._interactive_pressure = PoolPressure(PoolKind.INTERACTIVE, config)
        self._priorities = Priorities(config.priorities, config.default_priority)
        self._pump: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._metrics = telemetry or GateMetrics()
        retry = RetrySettings(
            config.retry_after,
            config.retry_after_s,
            config.retry_after_min_s,
            config.retry_after_max_s,
            config.retry_jitter,
        )
        self._retries = RetryPlanner(retry, clock, rng)

    def gauges(self) -> AdmissionGauges:
        pools = [
            PoolGauges(
                kind.value, pressure.level, pressure.breaker, tuple(map(_node_gauges, source.snapshot()))
            )
            for kind, source, pressure in (
                (PoolKind.LONG, self._long, self._long_pressure),
                (PoolKind.INTERACTIVE, self._interactive, self._interactive_pressure),
            )
            if source is not None
        ]
        return AdmissionGauges(len(self._queue), tuple(pools))

    async def start(self) -> None:
        """Wake the waiting requests whenever an agent of the long pool speaks."""
        if self._long is not None:
            self._pump = asyncio.create_task(self._pump_updates(self._long), name="kvgate-admission")

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)

    def rank(self, priority: str | None) -> int:
        return self._priorities.rank(priority)

    async def admit(
        self,
        route: Route,
        model: ModelConfig,
        priority: str | None,
        reservation_id: str,
        wait_s: float | None = None,
        *,
        affinity: Affinity | None = None,
        output_tokens: int = 0,
    ) -> Admitted:
        """A long request reserves under `reservation_id`, which the gate made for it: an id a client
        chose could name another request's reservation (kvgate.gate.reservation_ids).
        `wait_s` (the client's `Prefer: wait=N`) can only shorten admission.max_wait_s. With
        `affinity`, nodes that hold the prompt's prefix are tried first (kvgate.policy.nodes).
        `output_tokens` is the request's output budget within route.tokens (0 when unknown)."""
        rank = self.rank(priority)
        if route.reason is Reason.SHORT:
            return Admitted(self._admit_interactive(route, rank))
        if route.reason is not Reason.LONG or self._long is None:
            return Admitted(route)
        nodes = self._long.snapshot()
        if not choose_nodes(nodes, route.tokens, self._config.stale_nodes).any_usable:
            return Admitted(no_healthy_node(route))
        signals = pool_signals(nodes, len(self._queue), self._config.queue_size)
        if self._long_pressure.judge(signals, self._clock(), rank) is Verdict.SHED:
            why = f"the long-context pool is {self._long_pressure.level.name.lower()}"
            shed = overflow(route, model, Reason.SHED, why, self._config.async_fallback)
            return Admitted(self._come_back(shed, self._long, output_tokens))
        max_wait_s = self._config.max_wait_s if wait_s is None else min(wait_s, self._config.max_wait_s)
        ask = _Ask(reservation_id, rank, max_wait_s, affinity, output_tokens)
        return await self._place(self._long, route, model, ask)

    def _come_back(self, decision: Decision, source: HeadroomSource, output_tokens: int) -> Decision:
        """A capacity refusal with when to come back (retry_forecast); any other decision as it is."""
        if not isinstance(decision, Refusal):
            return decision
        advice = self._retries.advise(source.snapshot(), decision.tokens, output_tokens)
        self._metrics.retry_advised(advice.basis.value, advice.retry_after_s)
        return dataclasses.replace(decision, retry_after_s=advice.retry_after_s)

    def _admit_interactive(self, route: Route, rank: int) -> Decision:
        if self._interactive is None:
            return route
        signals = pool_signals(self._interactive.snapshot(), 0, 1)
        if self._interactive_pressure.judge(signals, self._clock(), rank) is Verdict.SHED:
            return interactive_saturated(route)
        return route

    async def _place(self, source: HeadroomSource, route: Route, model: ModelConfig, ask: _Ask) -> Admitted:
        """Wait in priority order, at most max_wait_s, until a node's agent grants the reservation.

        The wait is measured on admission's clock; the head of the queue always tries at least once,
        so max_wait_s 0 means "no waiting", not "never".
        """
        place = self._queue.join(ask.rank)
        if place is None:
            why = "the admission queue is full"
            full = overflow(route, model, Reason.QUEUE_FULL, why, self._config.async_fallback)
            return Admitted(self._come_back(full, source, ask.output_tokens))
        deadline = self._clock() + ask.max_wait_s
        affinity = ask.affinity
        try:
            while True:
                if self._queue.is_head(place):
                    choice = choose_nodes(source.snapshot(), route.tokens, self._config.stale_nodes, affinity)
                    if not choice.any_usable:
                        return Admitted(no_healthy_node(route))
                    prefix = affinity.chain if affinity is not None else None
                    for node in choice.candidates:
                        if node.agent in ask.unanswered_by:
                            continue
                        ticket = await self._try_reserve(source, node.agent, route.tokens, ask, prefix)
                        if ticket is not None and node.headroom is not None:
                            if prefix is not None:
                                saved = ticket.tokens - ticket.charged_tokens
                                self._metrics.placed(
                                    choice.placement, ticket.cached_tokens, saved, prefix.tokens
                                )
                            pinned = Route(route.pool, Reason.LONG, route.tokens, node.headroom.endpoint)
                            return Admitted(pinned, ticket)
                if self._clock() >= deadline:
                    why = "no node has room"
                    refused = overflow(route, model, Reason.NO_CAPACITY, why, self._config.async_fallback)
                    return Admitted(self._come_back(refused, source, ask.output_tokens))
                await self._queue.wait_change(deadline)
        finally:
            self._queue.leave(place)

    async def _try_reserve(
        self, source: HeadroomSource, agent: str, tokens: int, ask: _Ask, prefix: PrefixChain | None
    ) -> Ticket | None:
        request_id = ask.request_id
        try:
            outcome = await source.reserve(agent, request_id, tokens, prefix, output_tokens=ask.output_tokens)
        except asyncio.CancelledError:
            # The stream went away mid-Reserve (client abort, Envoy timeout): the agent may have granted
            # already, so give it back now rather than hold the capacity until the lease runs out.
            self._release_later(agent, request_id, unanswered=True)
            raise
        except HeadroomError as error:
            log.warning("reserve on %s failed: %s", agent, error)
            self._metrics.reservation("error")
            if unanswered(error):
                # The agent may have granted it all the same: nothing else would ever release it.
                ask.unanswered_by.add(agent)
                self._release_later(agent, request_id, unanswered=True)
            return None
        self._metrics.reservation("granted" if outcome.granted else "refused")
        if not outcome.granted:
            return None
        return Ticket(agent, request_id, tokens, outcome)

    def _release_later(self, agent: str, request_id: str, *, unanswered: bool = False) -> None:
        task = asyncio.create_task(self._release(agent, request_id, unanswered=unanswered))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, ticket: Ticket) -> None:
        await self._release(ticket.agent, ticket.request_id)

    async def _release(self, agent: str, request_id: str, *, unanswered: bool = False) -> None:
        assert self._long is not None, "a reservation exists only where a long pool granted it"
        await giveback.release(self._long, agent, request_id, unanswered=unanswered)
        self._queue.pulse()

    async def _pump_updates(self, source: HeadroomSource) -> None:
        while True:
            await source.wait_update(1.0)
            self._queue.pulse()
            for checked in self._retries.check(source.snapshot()):
                self._metrics.retry_checked(checked.basis.value, checked.error_s)


def _node_gauges(node: NodeView) -> NodeGauges:
    if node.headroom is None:
        return NodeGauges(node.agent, None, None, node.fresh)
    return NodeGauges(node.agent, node.headroom.headroom_tokens, node.age_s, node.fresh)
