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
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from kvgate.config import AdmissionConfig, FairnessConfig, ModelConfig
from kvgate.config.headroom import DEFAULT_LEASE_S
from kvgate.errors import HeadroomError
from kvgate.gate.leases import LeaseKeeper
from kvgate.gate.waitqueue import MONOTONIC, Clock, Place, WaitQueue, arrival
from kvgate.headroom import giveback
from kvgate.headroom.giveback import unanswered
from kvgate.headroom.snapshot import (
    HeadClaim,
    NodeView,
    PrefixChain,
    ReleaseOutcome,
    ReserveOutcome,
    TenantCharge,
)
from kvgate.names import ANONYMOUS_TENANT, OTHER_TENANTS
from kvgate.policy import Decision, Reason, Refusal, Route
from kvgate.policy.endpoints import UNRESERVED_ENDPOINTS, Subset, allowed, least_busy, within
from kvgate.policy.fair_share import (
    FairShare,
    agents_heads,
    agents_lifts,
    agents_totals,
    heads_elsewhere,
)
from kvgate.policy.identity import Priorities
from kvgate.policy.nodes import Affinity, NodeChoice, choose_nodes, takes_now
from kvgate.policy.overflow import interactive_saturated, no_healthy_node, overflow
from kvgate.policy.pressure import PoolPressure
from kvgate.policy.retry_forecast import RetryPlanner, RetrySettings
from kvgate.policy.shedding import PoolKind, Verdict
from kvgate.policy.slot import fits_beside_heads, slot_node
from kvgate.policy.tenant_book import TenantBook
from kvgate.policy.tenant_limits import TenantLimits, agents_tokens
from kvgate.policy.water import pool_signals
from kvgate.telemetry import AdmissionGauges, GateMetrics, NodeGauges, PoolGauges

log = logging.getLogger(__name__)

# How often a waiting head tells the agent it holds its place on that it still waits: a quarter of the
# agent's claim lifetime (kvgate.agent.backfill.CLAIM_TTL_S, 2 s), so a late or lost Reserve or two
# does not drop its place.
CLAIM_RENEW_S = 0.5
# Why a waiter left a full line early: a newcomer ahead of it in the order took its place
# (kvgate.gate.waitqueue).
PUSHED_OUT = "the admission queue is full and requests ahead of this one in the waiting order took its place"


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
        waiting_since_unix_ns: int = 0,
        rank: int = 0,
        fair_service: float = 0.0,
        hold_slot: bool = False,
        charge: TenantCharge | None = None,
        reports_first_token: bool = False,
    ) -> ReserveOutcome:
        """The agent's answer, a refusal included; HeadroomError when it gives none. Blocks of `prefix`
        that live reservations on the node hold are not charged again; `output_tokens` (the request's
        output budget, 0 when unknown) tells the agent when the reservation is expected to end;
        `waiting_since_unix_ns`, `rank` and `hold_slot` are the request's place in the one waiting
        order and whether it holds its place there (kvgate.agent.backfill); `reports_first_token`:
        this source will call first_token when the engine starts answering."""
        ...

    async def first_token(self, node: str, request_id: str) -> bool:
        """The engine started answering the request this source reserved `request_id` for: whether a
        live reservation took it. HeadroomError when the agent gives no answer."""
        ...

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        """End the reservation this source made (it releases as the holder it reserved as: an agent
        frees only its holder's reservations); `unanswered`: its Reserve got no answer (giveback)."""
        ...

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]:
        """Extend the leases of this source's reservations `request_ids` on `node`, in one call: the ids
        the agent no longer holds (lapsed). HeadroomError when it gives no answer."""
        ...

    async def wait_update(self, timeout_s: float) -> bool: ...


@dataclass(frozen=True, slots=True)
class Ticket:
    """A granted reservation, released when the request ends: the agent's answer, as it gave it."""

    agent: str
    request_id: str  # the gate's reservation id (kvgate.gate.reservation_ids), not the client's
    tokens: int
    outcome: ReserveOutcome
    output_tokens: int = 0  # the request's output budget within `tokens` (0: unknown)
    tenant: str = ANONYMOUS_TENANT

    @property
    def charged_tokens(self) -> int:
        """What the agent added to its reserved tokens (less than `tokens` with shared prefixes)."""
        return self.outcome.charged_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine is expected to find in its prefix cache."""
        return self.outcome.cached_tokens


@dataclass(slots=True)
class _Ask:
    """One long request asking for a node, and where it holds its place while it waits."""

    request_id: str
    rank: int
    max_wait_s: float
    affinity: Affinity | None
    output_tokens: int
    tokens: int
    waiting_since_unix_ns: int  # the wall clock when it arrived: its place in the one waiting order
    tenant: str = ANONYMOUS_TENANT
    # The prompt its tenant's charge counts (None: `tokens` less `output_tokens`).
    charged_prompt_tokens: int | None = None
    subset: Subset = None  # the engines an endpoint picker's gateway allows it (None: any)
    # Agents whose Reserve went unanswered: their give-back is in flight, so this request does not
    # ask them again (the give-back could release the new grant).
    unanswered_by: set[str] = dataclasses.field(default_factory=set)
    holds_on: str | None = None  # the agent it holds its place on (hold_slot), once it is the head
    # The agent its Reserve is in flight to, and whether its claim there was let go meanwhile: a
    # Release of the id now could end the grant that Reserve brings back (`_let_go`).
    asking: str | None = None
    let_go_late: bool = False
    waited: bool = False  # it found no room at once and joined the waiting order
    held_at: float = float("-inf")  # when it last told that agent so (admission's clock)
    place: Place | None = None  # its place in this gate's line while it waits

    def claim(self, fair_service: float) -> HeadClaim:
        """Its place as a head claim (the slot is the agent's to work out)."""
        return HeadClaim(self.tokens, self.waiting_since_unix_ns, self.rank, None, fair_service)


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
        wall_ns: Callable[[], int] = time.time_ns,
        lease_s: float = DEFAULT_LEASE_S,
        loop_lag: Callable[[], float] | None = None,
        fairness: FairnessConfig | None = None,
        reports_first_token: bool = False,
        picker_endpoints: int = UNRESERVED_ENDPOINTS,
    ) -> None:
        """`wall_ns`: the wall clock a request's place in the one waiting order is read from; the
        agents compare it with other gates' and the queue's, so it is the host's real time. `lease_s`:
        the lease the long pool's agents grant this gate, renewed every third of it (kvgate.gate.leases).
        `loop_lag`: how far behind the gate's event loop runs, in seconds (kvgate.gate.loop_lag).
        `fairness`, where enabled: waiters of a priority go by their tenant's weighted attained
        service (kvgate.policy.fair_share), not by arrival. `reports_first_token`: this gate reads the
        engines' answers (an endpoint picker) and tells the agents when each reserved request starts
        decoding (first_token), which they project its end from."""
        self._loop_lag = loop_lag
        self._reports_first_token = reports_first_token
        self._picker_endpoints = picker_endpoints
        self._config = config
        self._wall_ns = wall_ns
        # The head of this gate's line while it holds its place on an agent: behind it, this gate asks
        # and wakes only where the room that agent holds for it is left whole.
        self._holding: _Ask | None = None
        self._long = long
        self._interactive = interactive
        self._clock = clock
        self._fairness = fairness or FairnessConfig()
        self._book = TenantBook(self._fairness)
        enabled = fairness is not None and fairness.enabled
        self._fair = FairShare(self._fairness, clock=clock, book=self._book) if enabled else None
        self._limits = TenantLimits(self._book) if self._fairness.limits_tenants else None
        self._queue = WaitQueue(config.queue_size, clock, self._fair_order if self._fair else arrival)
        self._long_pressure = PoolPressure(PoolKind.LONG, config)
        self._interactive_pressure = PoolPressure(PoolKind.INTERACTIVE, config)
        self._priorities = Priorities(config.priorities, config.default_priority)
        self._pump: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[ReleaseOutcome | None]] = set()
        self._metrics = telemetry or GateMetrics()
        self._metrics.tenant_label.name(fairness.tenants if fairness is not None else ())
        self.leases = LeaseKeeper(long, lease_s, self._metrics) if long is not None else None
        self._renewing: asyncio.Task[None] | None = None
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
        return AdmissionGauges(len(self._queue), tuple(pools), self._tenant_gauges())

    def _tenant_gauges(self) -> tuple[tuple[str, float, int], ...]:
        """With fair shares, each labelled tenant's attained service and waiters; the tenants past the
        label bound as `_other`: their waiters summed, the least of their counters (the next in line)."""
        if self._fair is None:
            return ()
        labelled: list[tuple[str, float, int]] = []
        others: list[tuple[float, int]] = []
        for tenant, attained, waiting in self._fair.standing():
            label = self._metrics.tenant_label(tenant)
            if label == OTHER_TENANTS:
                others.append((attained, waiting))
            else:
                labelled.append((label, attained, waiting))
        if others:
            labelled.append((OTHER_TENANTS, min(a for a, _ in others), sum(w for _, w in others)))
        return tuple(labelled)

    async def start(self) -> None:
        """Wake the waiting requests whenever an agent of the long pool speaks."""
        if self._long is not None:
            self._pump = asyncio.create_task(self._pump_updates(self._long), name="kvgate-admission")
        if self.leases is not None:
            self._renewing = asyncio.create_task(self.leases.run(), name="kvgate-leases")

    async def stop(self) -> None:
        for task in (self._pump, self._renewing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @property
    def waiters_woken(self) -> int:
        """Waiters woken to try again, in all (each wake is a Reserve round at most)."""
        return self._queue.wakeups

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
        subset: Subset = None,
        tenant: str = ANONYMOUS_TENANT,
        tenant_class: str | None = None,
        charged_prompt_tokens: int | None = None,
    ) -> Admitted:
        """A long request reserves under `reservation_id`, which the gate made for it: an id a client
        chose could name another request's reservation (kvgate.gate.reservation_ids).
        `wait_s` (the pipeline's bound for this request: the client's `Prefer: wait=N` within
        admission.max_wait_s, or max_hold_s for a request the gate holds) is capped at the longest
        wait, admission.longest_wait_s; None: admission.max_wait_s. With
        `affinity`, nodes that hold the prompt's prefix are tried first (kvgate.policy.nodes).
        `output_tokens` is the request's output budget within route.tokens (0 when unknown). `subset`:
        an endpoint picker's gateway allows only these engines (kvgate.policy.endpoints). `tenant`:
        whose share it is charged to, with fair shares (kvgate.policy.fair_share), weighed and capped
        by its own settings or its route's `tenant_class` (kvgate.policy.tenant_book), for
        `charged_prompt_tokens` of prompt (the likeliest count, where route.tokens took the safe side
        of a threshold; None: route.tokens less the output budget)."""
        rank = self.rank(priority)
        if route.reason is Reason.SHORT:
            return Admitted(self._admit_interactive(route, rank))
        if route.reason is not Reason.LONG or self._long is None:
            return Admitted(route)
        self._book.learn(tenant, tenant_class)
        max_wait_s = self._config.max_wait_s if wait_s is None else min(wait_s, self._config.longest_wait_s)
        ask = _Ask(
            reservation_id,
            rank,
            max_wait_s,
            affinity,
            output_tokens,
            route.tokens,
            self._wall_ns(),
            tenant,
            charged_prompt_tokens,
            subset,
        )
        source = self._long if subset is None else _Within(self._long, subset)
        capped = self._over_limits(source, route, ask) if self._limits is not None else None
        if capped is not None:
            admitted = Admitted(capped)
        else:
            try:
                admitted = await self._admit_long(source, route, model, ask)
            except BaseException:
                if self._limits is not None:  # cancelled (the stream went away): its quota comes back
                    self._limits.give_back(ask.tenant, ask.tokens, self._clock())
                raise
            if self._limits is not None:
                self._count_limits(admitted, ask)
        if admitted.ticket is not None:
            outcome = "waited" if ask.waited else "at_once"
        else:
            outcome = admitted.decision.reason.value
        self._metrics.tenant_outcome(tenant, outcome)
        return admitted

    async def _admit_long(
        self, source: HeadroomSource, route: Route, model: ModelConfig, ask: _Ask
    ) -> Admitted:
        nodes = source.snapshot()
        choice = choose_nodes(nodes, route.tokens, self._config.stale_nodes, ask.affinity)
        if not choice.any_usable:
            return Admitted(no_healthy_node(route))
        if self._long_pressure.judge(pool_signals(nodes), self._clock(), ask.rank) is Verdict.SHED:
            why = f"the long-context pool is {self._long_pressure.level.name.lower()}"
            shed = overflow(route, model, Reason.SHED, why, self._config.async_fallback)
            return Admitted(self._come_back(shed, source, ask.output_tokens))
        behind_s = self._loop_lag() if self._loop_lag is not None else 0.0
        if behind_s > self._config.max_loop_lag_s:
            why = f"the gateway runs {behind_s:.1f} s behind"
            late = overflow(route, model, Reason.OVERLOADED, why, self._config.async_fallback)
            return Admitted(self._come_back(late, source, ask.output_tokens))
        started = time.perf_counter()
        admitted = await self._place(source, route, model, ask, choice)
        result = "refused" if admitted.ticket is None else "waited" if ask.waited else "at_once"
        self._metrics.admitted(result, time.perf_counter() - started)
        return admitted

    def _over_limits(self, source: HeadroomSource, route: Route, ask: _Ask) -> Refusal | None:
        """The tenant's own caps (kvgate.policy.tenant_limits): its share of KV while another tenant
        waits, then its quota, which the request takes from here on (given back if not admitted)."""
        limits = self._limits
        assert limits is not None
        nodes = source.snapshot()
        admissible_tokens = sum(n.headroom.admissible_tokens for n in nodes if n.headroom is not None)
        # What every replica's grants to the tenant hold, by the agents (this gate's own counted at
        # once, kvgate.headroom.view); this gate's own count where the agents say nothing.
        shared = sum(n.headroom.tenant_held.get(ask.tenant, 0) for n in nodes if n.headroom is not None)
        others_wait = self._queue.waits_other_than(ask.tenant)
        share = limits.share_passed(ask.tenant, route.tokens, admissible_tokens, others_wait, shared)
        if share is not None:
            refused = Refusal(
                Reason.TENANT_SHARE,
                f"Tenant {ask.tenant!r} holds its most share of the long-context pool ({share:.0%}) while "
                "others wait. Retry later.",
                route.tokens,
            )
            return cast(Refusal, self._come_back(refused, source, ask.output_tokens))
        limits.observe(agents_tokens(nodes), self._clock())
        retry_after_s = limits.take_quota(ask.tenant, route.tokens, self._clock())
        if retry_after_s is None:
            return None
        return Refusal(
            Reason.TENANT_QUOTA,
            f"Tenant {ask.tenant!r} has used its token quota for now. "
            f"Retry after {math.ceil(retry_after_s)} s.",
            route.tokens,
            retry_after_s,
        )

    def _count_limits(self, admitted: Admitted, ask: _Ask) -> None:
        """An admitted request holds its tokens against its tenant's share; one that was not gives
        back the quota it took."""
        assert self._limits is not None
        if admitted.ticket is not None:
            self._limits.hold(ask.tenant, admitted.ticket.tokens)
            self._limits.granted(ask.tenant, ask.tokens)
        else:
            self._limits.give_back(ask.tenant, ask.tokens, self._clock())

    def _fair_order(self, place: Place) -> tuple[float, ...]:
        """Rank first, then the tenant's place in the fair order (FairShare.order), then arrival."""
        assert self._fair is not None, "the fair order is the queue's only with fair shares"
        return (place.rank, *self._fair.order(place.tenant), place.waiting_since_unix_ns, place.seq)

    def pick_unreserved(self, route: Route, subset: Subset) -> Decision:
        """An endpoint picker's engines for a request that reserves nothing (kvgate.policy.endpoints):
        the route with the least busy interactive engines the hint allows, else the least busy long
        ones it allows, or a 503 when it allows none."""
        interactive = self._interactive.snapshot() if self._interactive is not None else ()
        endpoints = least_busy(interactive, subset, self._picker_endpoints)
        if not endpoints and self._long is not None:
            endpoints = least_busy(self._long.snapshot(), subset, self._picker_endpoints)
        if not endpoints:
            return no_healthy_node(route)
        return dataclasses.replace(route, endpoint=",".join(endpoints))

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
        signals = pool_signals(self._interactive.snapshot())
        if self._interactive_pressure.judge(signals, self._clock(), rank) is Verdict.SHED:
            return interactive_saturated(route)
        return route

    async def _place(
        self, source: HeadroomSource, route: Route, model: ModelConfig, ask: _Ask, choice: NodeChoice
    ) -> Admitted:
        """Reserve at once where the request fits beside the room the agents hold for the waiting
        order's heads; else wait in the one order, at most max_wait_s, until an agent grants it.

        Only the head of this gate's line holds its place on an agent (kvgate.policy.slot) and is
        woken on every change; a waiter behind it is woken only when it fits beside the heads
        (kvgate.gate.waitqueue). Each try reads the view once (one `choose_nodes`). The wait is
        measured on admission's clock; max_wait_s 0 means one try and no waiting.
        """
        nodes = source.snapshot()
        if self._may_pass(ask, nodes):
            admitted = await self._attempt(source, route, ask, nodes, choice)
            if admitted is not None:
                return admitted
        if ask.max_wait_s <= 0:
            return self._no_room(source, route, model, ask)
        ask.waited = True
        place = self._join_line(ask)
        if place is None:
            return self._line_full(source, route, model, ask, "the admission queue is full")
        return await self._wait_in_line(source, route, model, ask, place=place, nodes=nodes, choice=choice)

    async def _wait_in_line(
        self,
        source: HeadroomSource,
        route: Route,
        model: ModelConfig,
        ask: _Ask,
        *,
        place: Place,
        nodes: tuple[NodeView, ...],
        choice: NodeChoice,
    ) -> Admitted:
        """`ask` waits in its `place` until it is admitted, its wait ends, or it is pushed out."""
        deadline = self._clock() + ask.max_wait_s
        just_tried = True  # the nodes it fits on were asked a moment ago: the head only holds its place
        try:
            while True:
                if self._queue.pushed_out(place):
                    # A newcomer ahead of it in the order took its place (once woken, it may first
                    # have tried beside the heads, as any newcomer may).
                    return self._line_full(source, route, model, ask, PUSHED_OUT)
                if self._queue.is_head(place):
                    admitted = await self._attempt(
                        source, route, ask, nodes, choice, head=True, candidates=not just_tried
                    )
                    if admitted is not None:
                        return admitted
                if self._clock() >= deadline:
                    return self._no_room(source, route, model, ask)
                await self._queue.wait_change(place, self._wake_at(ask, deadline))
                nodes = source.snapshot()
                choice = choose_nodes(nodes, route.tokens, self._config.stale_nodes, ask.affinity)
                just_tried = False
                if not choice.any_usable:
                    return Admitted(no_healthy_node(route))
                if not self._queue.is_head(place) and self._may_pass(ask, nodes):
                    # Woken behind the head: it fits beside the heads' slots by the latest messages.
                    admitted = await self._attempt(source, route, ask, nodes, choice)
                    if admitted is not None:
                        return admitted
                    just_tried = True
        finally:
            self._leave_line(place, ask)
            self._let_go(ask)

    def _line_full(
        self, source: HeadroomSource, route: Route, model: ModelConfig, ask: _Ask, why: str
    ) -> Admitted:
        full = overflow(route, model, Reason.QUEUE_FULL, why, self._config.async_fallback)
        return Admitted(self._come_back(full, source, ask.output_tokens))

    def _may_pass(self, ask: _Ask, nodes: Sequence[NodeView]) -> bool:
        """With fair shares, whether `ask` may take room ahead of the line (kvgate.policy.fair_share):
        ahead of this gate's waiters and of the heads the agents hold room for, which may wait in
        another replica's line or in the queue. This gate's line alone shows none of them: with two
        gates and a flooding tenant's requests all on the first, that line often holds the flooding
        tenant alone, and its arrivals could go ahead of every waiter on the other gate."""
        if self._fair is None:
            return True
        elsewhere = heads_elsewhere(nodes, ask.rank)
        return self._fair.may_pass(ask.tenant, self._cost(ask), ask.rank, elsewhere)

    def _join_line(self, ask: _Ask) -> Place | None:
        """A place in the line (None: it is full); with fair shares its tenant waits from now."""
        if self._fair is not None:
            self._fair.waits(ask.tenant, ask.rank)
        place = self._queue.join(ask.rank, ask.waiting_since_unix_ns, ask.tokens, ask.tenant)
        if place is None and self._fair is not None:
            self._fair.done_waiting(ask.tenant, ask.rank)
        ask.place = place
        self._claim_follows_head()  # a newcomer of a higher priority, or first in the fair order
        return place

    def _reorder(self) -> None:
        """Fair shares moved a tenant: sort the line again."""
        self._queue.reorder()
        self._claim_follows_head()

    def _claim_follows_head(self) -> None:
        """A head that is head no more stops holding its place on its agent, which otherwise keeps the
        room for it (the agents know nothing of this gate's line) rather than for the new
        head; and, with fair shares, it no longer names its wait (`_named_wait`), so it could not take
        that room either."""
        holding = self._holding
        if holding is not None and holding.place is not None and not self._queue.is_head(holding.place):
            self._let_go(holding)

    def _leave_line(self, place: Place, ask: _Ask) -> None:
        self._queue.leave(place)
        if self._fair is not None:
            self._fair.done_waiting(ask.tenant, ask.rank)

    async def _attempt(
        self,
        source: HeadroomSource,
        route: Route,
        ask: _Ask,
        nodes: tuple[NodeView, ...],
        choice: NodeChoice,
        *,
        head: bool = False,
        candidates: bool = True,
    ) -> Admitted | None:
        """One try: a Reserve on each candidate where the request fits beside the heads' slots (a stale
        node, which shows nothing to go by, is asked as the stale policy says), best first. The head
        of the line asks as the first in the order, holds its place on its slot node, and tells that
        agent so at least every CLAIM_RENEW_S."""
        prefix = ask.affinity.chain if ask.affinity is not None else None
        slot = slot_node(nodes, ask.tokens, ask.output_tokens, ask.holds_on) if head else None
        asked: set[str] = set()
        since = self._named_wait(ask.waiting_since_unix_ns, head)
        service = self._fair_service(ask)
        for node, cached in zip(choice.candidates, choice.cached_tokens, strict=True):
            if not candidates or node.agent in ask.unanswered_by:
                continue
            local = self._local_claim(node, ask)
            if node.fresh and not fits_beside_heads(
                node, ask.tokens - cached, ask.rank, since, local, fair_service=service
            ):
                continue
            asked.add(node.agent)
            ticket = await self._try_reserve(
                source, node.agent, ask, prefix, hold=node.agent == slot, waiting_since_unix_ns=since
            )
            if ticket is not None and node.headroom is not None:
                return self._granted(route, ask, choice, node, ticket)
        renew = ask.holds_on != slot or self._clock() - ask.held_at >= CLAIM_RENEW_S
        if slot is None or slot in asked or slot in ask.unanswered_by or not renew:
            return None
        ticket = await self._try_reserve(
            source, slot, ask, prefix, hold=True, waiting_since_unix_ns=ask.waiting_since_unix_ns
        )
        held = next((n for n in nodes if n.agent == slot), None)
        if ticket is not None and held is not None and held.headroom is not None:
            return self._granted(route, ask, choice, held, ticket)
        return None

    def _granted(
        self,
        route: Route,
        ask: _Ask,
        choice: NodeChoice,
        node: NodeView,
        ticket: Ticket,
    ) -> Admitted:
        assert node.headroom is not None
        if ask.affinity is not None:
            prefix = ask.affinity.chain
            saved = ticket.tokens - ticket.charged_tokens
            self._metrics.placed(choice.placement, ticket.cached_tokens, saved, prefix.tokens)
        if ask.holds_on == node.agent:
            ask.holds_on = None  # the agent ended its claim with the grant
        self._let_go(ask)
        if self._fair is not None:
            # Charged while still in the line: the line is sorted again before this request leaves
            # it, so leaving wakes the new head, not the one that led before the charge.
            self._fair.charge(ask.tenant, self._cost(ask))
            self._reorder()
        pinned = Route(route.pool, Reason.LONG, route.tokens, node.headroom.endpoint)
        return Admitted(pinned, ticket)

    def _no_room(self, source: HeadroomSource, route: Route, model: ModelConfig, ask: _Ask) -> Admitted:
        why = "no node has room"
        refused = overflow(route, model, Reason.NO_CAPACITY, why, self._config.async_fallback)
        return Admitted(self._come_back(refused, source, ask.output_tokens))

    def _local_claim(self, node: NodeView, ask: _Ask | None) -> HeadClaim | None:
        """This gate's head, where it holds its place on `node` or fits there now, and `ask` is not it.

        Where it holds its place, the node's messages may not show its claim yet. Where it fits now,
        it is woken to take the room, but the node's agent holds nothing for it there: a newcomer that
        arrived before it ran (or a waiter behind it, woken by the same message) took the room first,
        and the head waited on for its own slot (EASY backfilling starts the head wherever it fits)."""
        holding = self._holding
        if holding is None or holding is ask:
            return None
        if holding.holds_on != node.agent and not (
            allowed(node, holding.subset) and takes_now(node, holding.tokens, holding.output_tokens)
        ):
            return None
        return holding.claim(self._fair_service(holding))

    def _fair_service(self, ask: _Ask) -> float:
        """Its tenant's place in the fair order, named to the agents with each try: they order the
        waiters of one rank by it before their arrival, so every replica's heads and the queue's meet
        in the one fair order (0 without fair shares: by arrival alone)."""
        return self._fair.counter(ask.tenant) if self._fair is not None else 0.0

    @staticmethod
    def _wake_at(ask: _Ask, deadline: float) -> float:
        """A head holding its place wakes in time to tell its agent again before the claim lapses."""
        if ask.holds_on is None:
            return deadline
        return min(deadline, ask.held_at + CLAIM_RENEW_S)

    def _let_go(self, ask: _Ask) -> None:
        """`ask` waits no more: its claim, if it holds one, is dropped at once (a Release of the id
        ends it) rather than holding the agent's room until it lapses."""
        if self._holding is ask:
            self._holding = None
        if ask.holds_on is not None:
            if ask.holds_on == ask.asking:
                # Its Reserve there is in flight: if granted, the grant ended the claim, and a Release
                # would end the grant behind its back (the gate would send the request to a node that
                # holds nothing for it). The claim goes once the answer says it was no grant.
                ask.let_go_late = True
            else:
                self._release_later(ask.holds_on, ask.request_id)
            ask.holds_on = None

    @staticmethod
    def _let_go_after(ask: _Ask, *, granted: bool) -> bool:
        """Whether the claim let go while `ask`'s Reserve was in flight is to be released now: only when
        the answer was no grant."""
        late, ask.let_go_late = ask.let_go_late, False
        return late and not granted

    def _named_wait(self, waiting_since_unix_ns: int, head: bool) -> int:
        """The waiting time a try names to the agents, its place in their order (rank, then its tenant's
        fair service, then since when it waits). With fair shares only this gate's head names its
        wait, and every other try names none (0), so the agents let it take only what leaves the heads'
        slots whole (backfill): its own head is the one this gate holds room for."""
        if self._fair is None or head:
            return waiting_since_unix_ns
        return 0

    async def _try_reserve(
        self,
        source: HeadroomSource,
        agent: str,
        ask: _Ask,
        prefix: PrefixChain | None,
        *,
        hold: bool,
        waiting_since_unix_ns: int,
    ) -> Ticket | None:
        if hold:
            if ask.holds_on is not None and ask.holds_on != agent:
                self._release_later(ask.holds_on, ask.request_id)  # it holds its place on one node only
            ask.holds_on, ask.held_at = agent, self._clock()
            self._holding = ask
        request_id = ask.request_id
        ask.asking = agent
        try:
            outcome = await source.reserve(
                agent,
                request_id,
                ask.tokens,
                prefix,
                output_tokens=ask.output_tokens,
                waiting_since_unix_ns=waiting_since_unix_ns,
                rank=ask.rank,
                fair_service=self._fair_service(ask),
                hold_slot=hold,
                charge=self._charge_of(ask),
                reports_first_token=self._reports_first_token,
            )
        except asyncio.CancelledError:
            # The stream went away mid-Reserve (client abort, Envoy timeout): the agent may have granted
            # already, so give it back now rather than hold the capacity until the lease runs out.
            self._release_later(agent, request_id, unanswered=True)
            raise
        except HeadroomError as error:
            log.warning("reserve on %s failed: %s", agent, error)
            self._metrics.reservation("error")
            let_go = self._let_go_after(ask, granted=False)
            if unanswered(error):
                # The agent may have granted it all the same: nothing else would ever release it.
                ask.unanswered_by.add(agent)
                self._release_later(agent, request_id, unanswered=True)
            elif let_go:
                self._release_later(agent, request_id)
            return None
        finally:
            ask.asking = None
        self._metrics.reservation("granted" if outcome.granted else "refused")
        if self._let_go_after(ask, granted=outcome.granted):
            self._release_later(agent, request_id)
        if not outcome.granted:
            return None
        if self.leases is not None:
            self.leases.hold(agent, request_id)
        return Ticket(agent, request_id, ask.tokens, outcome, ask.output_tokens, ask.tenant)

    async def move(self, ticket: Ticket, endpoint: str) -> Ticket | None:
        """The gateway ran `ticket`'s request on `endpoint`, not on the engine whose agent reserved for
        it (an endpoint picker's gateway fell back to another engine after the named one failed): the
        KV is charged where the request runs, by a Reserve on the agent that follows `endpoint`, and
        the first reservation is given back. None when no agent follows that engine or its agent has no
        room: the request runs there unreserved, and only that engine's usage shows it to its agent."""
        assert self._long is not None, "a reservation exists only where a long pool granted it"
        node = next(
            (n for n in self._long.snapshot() if n.headroom is not None and n.headroom.endpoint == endpoint),
            None,
        )
        moved: Ticket | None = None
        if node is not None and node.agent != ticket.agent:
            try:
                outcome = await self._long.reserve(
                    node.agent,
                    ticket.request_id,
                    ticket.tokens,
                    output_tokens=ticket.output_tokens,
                    reports_first_token=self._reports_first_token,
                )
            except asyncio.CancelledError:
                self._release_later(node.agent, ticket.request_id, unanswered=True)
                self._release_later(ticket.agent, ticket.request_id)
                raise
            except HeadroomError as error:
                log.warning("moving reservation %s to %s failed: %s", ticket.request_id, node.agent, error)
                if unanswered(error):
                    self._release_later(node.agent, ticket.request_id, unanswered=True)
            else:
                if outcome.granted:
                    if self.leases is not None:
                        self.leases.hold(node.agent, ticket.request_id)
                    moved = dataclasses.replace(ticket, agent=node.agent, outcome=outcome)
                    if self._limits is not None:
                        self._limits.hold(ticket.tenant, ticket.tokens)
        self._metrics.reservation_moved(moved is not None)
        await self.release(ticket)
        return moved

    async def first_token(self, ticket: Ticket) -> None:
        """The engine sent `ticket`'s request its first token: its agent projects its end from now. An
        agent that gives no answer keeps projecting it as prefilling, which errs on the safe side."""
        assert self._long is not None, "a reservation exists only where a long pool granted it"
        try:
            await self._long.first_token(ticket.agent, ticket.request_id)
        except HeadroomError as error:
            log.info("first token of %s not told to %s: %s", ticket.request_id, ticket.agent, error)

    def _charge_of(self, ask: _Ask) -> TenantCharge | None:
        """With fair shares or tenant caps, what the agent adds to the request's tenant's service and
        held tokens when it grants."""
        if self._fair is None and self._limits is None:
            return None
        lift = self._fair.lift_cost(ask.tenant) if self._fair is not None else 0.0
        return TenantCharge(ask.tenant, self._cost(ask), self._fairness.output_weight, lift)

    def _cost(self, ask: _Ask) -> float:
        prompt = ask.charged_prompt_tokens
        return self._fairness.cost(
            ask.tokens - ask.output_tokens if prompt is None else prompt, ask.output_tokens
        )

    def _release_later(self, agent: str, request_id: str, *, unanswered: bool = False) -> None:
        task = asyncio.create_task(self._release(agent, request_id, unanswered=unanswered))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, ticket: Ticket, generated_tokens: int = 0) -> None:
        """`generated_tokens`: what the request generated by its engine's answer (0: not read), for
        the agent to learn its node's output lengths from and its tenant's service to settle on.
        Where the gate did not read it, the tenant is settled on what the agent settled the
        reservation on (its node's measured decode rate over the hold), not on the output budget the
        client declared: that is what a quota counts."""
        if self._limits is not None:
            self._limits.let_go(ticket.tenant, ticket.tokens)
        outcome = await self._release(ticket.agent, ticket.request_id, generated_tokens=generated_tokens)
        settled = outcome.settled_output_tokens if outcome is not None else 0
        output = generated_tokens or settled
        if self._fair is not None and output > 0:
            self._fair.settle(ticket.tenant, ticket.output_tokens, output)
        if self._limits is not None and output > 0:
            self._limits.settle(ticket.tenant, ticket.output_tokens - output, self._clock())
        prompt = ticket.tokens - ticket.output_tokens
        self._metrics.tenant_served(
            ticket.tenant, self._fairness.cost(prompt, output or ticket.output_tokens)
        )

    async def _release(
        self, agent: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome | None:
        assert self._long is not None, "a reservation exists only where a long pool granted it"
        if self.leases is not None:
            self.leases.let_go(agent, request_id)
        outcome = await giveback.release(
            self._long, agent, request_id, unanswered=unanswered, generated_tokens=generated_tokens
        )
        if outcome is not None and (self._fair is not None or self._limits is not None):
            # The answer settled the tenant's service in the view, and the agent sends this gate no
            # message for what its own Release changed (kvgate.agent.subscribers).
            self._observe_agents(self._long.snapshot())
        self._pulse()
        return outcome

    async def _pump_updates(self, source: HeadroomSource) -> None:
        while True:
            await source.wait_update(1.0)
            nodes = source.snapshot()
            self._observe_agents(nodes)
            self._pulse()
            for checked in self._retries.check(nodes):
                self._metrics.retry_checked(checked.basis.value, checked.error_s)

    def _observe_agents(self, nodes: Sequence[NodeView]) -> None:
        """The tenants' service and reserved tokens as the agents count them, for fair shares and quotas."""
        if self._fair is not None:
            self._observe_service(nodes)
        if self._limits is not None:
            self._limits.observe(agents_tokens(nodes), self._clock())

    def _observe_service(self, nodes: Sequence[NodeView]) -> None:
        """Fair shares across replicas: each tenant's service summed over the agents that say it; the
        line is sorted again, since another replica's grants may have moved a tenant."""
        assert self._fair is not None
        totals = agents_totals(nodes)
        if totals is not None:
            self._fair.observe(totals, agents_lifts(nodes), agents_heads(nodes))
            self._reorder()

    def _pulse(self) -> None:
        """Room may have freed: wake the head of the line, and each waiter behind it that fits beside
        the heads' slots by the latest messages."""
        if len(self._queue) <= 1 or self._long is None:
            self._queue.pulse()
            return
        nodes = self._long.snapshot()
        local = {n.agent: claim for n in nodes if (claim := self._local_claim(n, None)) is not None}

        def fits(place: Place) -> bool:
            since = self._named_wait(place.waiting_since_unix_ns, head=False)  # woken behind the head
            return any(
                fits_beside_heads(n, place.tokens, place.rank, since, local.get(n.agent)) for n in nodes
            )

        self._queue.pulse(fits)


def _node_gauges(node: NodeView) -> NodeGauges:
    if node.headroom is None:
        return NodeGauges(node.agent, None, None, node.fresh)
    return NodeGauges(node.agent, node.headroom.headroom_tokens, node.age_s, node.fresh)


class _Within:
    """A pool's agents as an endpoint picker's gateway allows them: only the nodes whose engine is in
    its subset hint are seen, so every placement and every wait stays inside it."""

    def __init__(self, source: HeadroomSource, subset: frozenset[str]) -> None:
        self._source = source
        self._subset = subset

    def snapshot(self) -> tuple[NodeView, ...]:
        return within(self._source.snapshot(), self._subset)

    async def reserve(
        self, node: str, request_id: str, tokens: int, prefix: PrefixChain | None = None, **asked: Any
    ) -> ReserveOutcome:
        return await self._source.reserve(node, request_id, tokens, prefix, **asked)

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        return await self._source.release(
            node, request_id, unanswered=unanswered, generated_tokens=generated_tokens
        )

    async def first_token(self, node: str, request_id: str) -> bool:
        return await self._source.first_token(node, request_id)

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]:
        return await self._source.renew(node, request_ids)

    async def wait_update(self, timeout_s: float) -> bool:
        return await self._source.wait_update(timeout_s)
