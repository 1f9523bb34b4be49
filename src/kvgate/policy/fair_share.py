"""Token-weighted fair shares between tenants: the Virtual Token Counter (VTC) of Sheng et al.,
"Fairness in Serving Large Language Models" (OSDI'24), over the long requests a gate admits.

Pure. Each tenant has a counter of the service it attained, in weighted tokens: an admitted request
adds its cost (prompt + `output_weight` x output tokens; VTC's input + 2 x output) divided by the
tenant's weight. Where requests wait for KV, the waiter whose tenant has the least counter goes first
(priority still comes first: kvgate.gate.waitqueue). A tenant that starts waiting after waiting for
nothing is lifted to the least counter of the tenants that wait (to the last one served when none
waits): idling banks no credit, so a tenant that comes back cannot starve the others with what it did
not use. Between two tenants that keep waiting, the weighted service each attains then differs by at
most the largest request's weighted cost, twice (VTC's bound, 2 x max(w_in x L_in, w_out x M)).

Backfill keeps to that bound: a request that would go ahead of the line (it fits where the head does
not, or it arrives while others wait) may do so only while its tenant's counter, with its own cost,
stays within the largest weighted cost of the least counter of the other tenants waiting
(`may_pass`). Otherwise it waits its turn: a tenant's small requests cannot take what frees around a
big head until their tenant is far ahead. The other tenants waiting are this replica's and the heads
of the others' lines: each node's agent publishes the first waiter it holds room for, with the
counter it waits at (kvgate.headroom.snapshot.HeadClaim), and the gate passes those in.

With several replicas (gates, and `kvgate queue`'s), a tenant's requests wait in several lines, and
one line emptying does not make the tenant idle. VTC lifts a tenant whose one queue went from empty to
waiting, to the least counter in that queue. Here the queue is every replica's line, and a replica
sees its own line and, of the others, the heads the agents publish (each the first waiter of the one
waiting order that found no room on its node, with its counter). So a lift's floor is the least
counter of this replica's waiters and of those heads, and nothing else: a tenant that was served
but waits nowhere is no floor. Such tenants were floors until 2026-12-05, and at the start of the
one-gate fairness runs that let the largest service gap past VTC's bound: the empty pool granted A
two of its largest requests at once, C was lifted only to the counters of tenants served beside them
and waiting for nothing, and C's repayment of A's lead, counted while both waited, set the run's
largest gap (24,494-30,484 against a bound of 24,512; docs/operations.md, "Fair shares").

A replica that lifted a tenant missing from its own line all the way took away the lead its requests
waiting elsewhere had earned: measured with two gates, A's flood always waiting on the first, that
gate lifted every other tenant to A's counter each time one of them came back to its line, so A's
requests led its line while the others were served 0.7-0.9x their share. So a tenant served within
`ACTIVE_S` (by any replica, as the agents' totals show) is lifted only to within the largest
weighted cost of the floor: it keeps a lead of up to one request. An idle one is lifted all the way,
as VTC does. Lifting all the way a tenant that only this replica served, as VTC would, was tried
(2026-12-05): a light tenant's second request of a pair then waited behind every tenant at the floor,
and B, at half its fair share, was refused four times in each of two runs against none to two. The
service gap was no smaller (24,335 and 28,604): it is measured from first tokens, so a request
admitted and not yet started still counts as waiting.

Priority stays above tenants, and so do the lifts and the backfill bound: a tenant that waits at a
lower priority (a larger rank) than a request's is left out of that request's floor and of what it
may pass. Its counter lags by design, since it is owed only what the others leave, and
counting it let idling bank credit after all: on the fairness scenario the batch tenant's counter sat
at a fifth of the others', every lift went to it, so a tenant back from 60 s off kept its whole lead
and took 64k weighted tokens to a flooding tenant's 12k in the next 10 s (a service gap of 41k
against a bound of 24.5k, 2026-12-04), and small requests could never pass the line.

A request is charged its estimate when admitted (the output budget it reserved) and settled on what
its engine's answer says it generated, where the gate reads the answer (an endpoint picker,
kvgate.gate.picker): the counter then holds what ran, not what was guessed.

Across gate replicas (or workers, `server.workers`): every long request passes one agent's Reserve, and
each Reserve carries its tenant and cost, so the agents keep each tenant's service and publish it in the
stream (kvgate.agent.tenant_service). Once those totals arrive (`observe`), a gate's counters are their
sum over the agents, the same in every replica. Lifts travel the same way: each grant's Reserve carries
what lifts added to its tenant's counter (`lift_cost`), each agent publishes the largest it saw, and a
replica's lift is the larger of its own and the agents' (`observe`). A lift is computed from the
replica's own line, so a tenant lifted only where it waited lagged everywhere else by every lift: a
light tenant, lifted level on each return to the gate it used, was the queue's floor at its bare
service, and a tenant back from idle was lifted there only to it. A gate restart loses nothing of
anyone's share; an agent restart forgets what its node served (docs/operations.md, "Fair shares").
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvgate.config import FairnessConfig
from kvgate.headroom.snapshot import NodeView, combined_over_agents
from kvgate.policy.tenant_book import TenantBook

# Tenants remembered. Past this, the tenant with the least counter that waits for nothing is
# forgotten: were it to come back, it is lifted to the others' least counter anyway.
MAX_TENANTS = 10_000
# A tenant served (by any replica, as the agents' totals show) within this long is active. Each tenant
# that waits is served every few seconds under the fair order, one that is far ahead within a few
# tens of seconds; a tenant ahead of the others is not lifted anyway, so only a tenant behind that went
# unserved this long counts as idle.
ACTIVE_S = 10.0


def agents_totals(nodes: Sequence[NodeView]) -> dict[str, float] | None:
    """Each tenant's service summed over the agents' latest messages (NodeHeadroom.tenant_service);
    None when no agent publishes any."""
    return combined_over_agents(nodes, lambda headroom: headroom.tenant_service or None)


def agents_lifts(nodes: Sequence[NodeView]) -> dict[str, float]:
    """Each tenant's largest lift over the agents' latest messages (NodeHeadroom.tenant_lift): a lift
    is a level the tenant's counter was raised to, not service to add up."""
    return combined_over_agents(nodes, lambda headroom: headroom.tenant_lift, max) or {}


def agents_heads(nodes: Sequence[NodeView]) -> list[tuple[int, float]]:
    """The rank and counter of each head the agents hold room for (NodeHeadroom.head): the first waiter
    of the one waiting order that found no room on each node, whichever replica's line it waits in."""
    return [
        (head.rank, head.fair_service)
        for node in nodes
        if node.headroom is not None and (head := node.headroom.head) is not None
    ]


def heads_elsewhere(nodes: Sequence[NodeView], rank: int) -> list[float]:
    """The counters the agents' heads wait at, of `rank` or a more important one, for
    `FairShare.may_pass`."""
    return [counter for head_rank, counter in agents_heads(nodes) if head_rank <= rank]


class FairShare:
    def __init__(
        self,
        config: FairnessConfig,
        max_tenants: int = MAX_TENANTS,
        clock: Callable[[], float] = time.monotonic,
        book: TenantBook | None = None,
    ) -> None:
        """`book`: each tenant's weight, where a route's class sets it (kvgate.policy.tenant_book)."""
        self._config = config
        self._book = book if book is not None else TenantBook(config)
        self._max_tenants = max_tenants
        self._clock = clock
        self._served_at: dict[str, float] = {}  # when each tenant's service last rose, any replica's
        # Each tenant's attained service: what this process charged (weighted), or, once the agents
        # publish it, their summed totals (raw cost: weighted when read).
        self._charged: dict[str, float] = {}
        self._shared: dict[str, float] | None = None
        # What lifts added to a tenant's counter when it started waiting (idle time banks nothing):
        # this process's own, weighted, and the largest any replica's grants carried (raw cost).
        self._lift: dict[str, float] = {}
        self._shared_lift: dict[str, float] = {}
        # Waiters per tenant and rank: a tenant here is backlogged.
        self._waiting: Counter[tuple[str, int]] = Counter()
        # The rank and counter of each head the agents hold room for, from any replica's line.
        self._heads: list[tuple[int, float]] = []
        self._last_served = 0.0
        self._largest = 0.0  # the largest weighted cost charged: the slack backfill is allowed

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """A request's cost in tokens, before its tenant's weight."""
        return self._config.cost(prompt_tokens, output_tokens)

    def counter(self, tenant: str) -> float:
        """The weighted service `tenant` attained, lifts included: the fair order's key, least first."""
        return self._attained(tenant) + self._lifted(tenant)

    def order(self, tenant: str) -> tuple[float, float]:
        """`tenant`'s place in the fair order, least first: its counter, then, among equal counters,
        the service it attained in fact. A tenant that starts waiting is lifted to the least counter
        of those waiting, level with the tenant that has it; of the two, the one that was served less
        (the returning one, whose counter the lift raised) goes first rather than after every waiter
        of the other, so a light tenant waits for one admission less."""
        return self.counter(tenant), self._attained(tenant)

    def observe(
        self,
        totals: Mapping[str, float],
        lifts: Mapping[str, float] | None = None,
        heads: Sequence[tuple[int, float]] = (),
    ) -> None:
        """The service each tenant attained across every replica, summed over the agents' messages
        (raw cost): from now on the counters follow it rather than this process's own charges. `lifts`:
        the largest lift of each tenant any replica's grants carried (raw cost, agents_lifts). `heads`:
        the rank and counter of the waiters the agents hold room for (agents_heads), floors of a lift."""
        now = self._clock()
        before = self._shared or {}
        for tenant, total in totals.items():
            if total > before.get(tenant, 0.0):
                self._served_at[tenant] = now
        self._shared = dict(totals)
        if lifts is not None:
            self._shared_lift = dict(lifts)
        self._heads = list(heads)

    def lift_cost(self, tenant: str) -> float:
        """What lifts added to `tenant`'s counter, in raw cost (before its weight): what its grants carry
        to the agents (TenantCharge.lift), so that every replica lifts it as this one did."""
        return self._lifted(tenant) * self._book.weight(tenant)

    def waits(self, tenant: str, rank: int = 0) -> None:
        """A request of `tenant` at `rank` starts waiting; the first of its tenant's lifts the tenant's
        counter: to the least counter of the others of that rank or a more important one that wait
        here, and of the heads the agents hold room for (to the last one served when none waits), to
        within the largest cost of it where the tenant was served lately (its requests may wait in
        another replica's line)."""
        if not self._waits(tenant):
            floors = [self.counter(t) for t in self._waiting_at(rank) if t != tenant]
            floors.extend(counter for head_rank, counter in self._heads if head_rank <= rank)
            floor = min(floors) if floors else self._last_served
            if self._active(tenant):
                floor -= self._largest
            lift = floor - self._attained(tenant)
            if lift > self._lifted(tenant):
                self._lift[tenant] = lift
            self._forget_beyond_bound()
        self._waiting[tenant, rank] += 1

    def done_waiting(self, tenant: str, rank: int = 0) -> None:
        """A waiter of `tenant` at `rank` left the line: admitted, timed out or gone."""
        left = self._waiting[tenant, rank] - 1
        if left > 0:
            self._waiting[tenant, rank] = left
        else:
            del self._waiting[tenant, rank]

    def may_pass(self, tenant: str, cost: float, rank: int = 0, elsewhere: Iterable[float] = ()) -> bool:
        """Whether a request of `tenant` at `rank` costing `cost` may go ahead of the other tenants'
        waiters of its rank or a more important one: none waits, or its tenant's counter with it stays
        within the largest weighted cost of theirs. `elsewhere`: the counters the heads of other
        replicas' lines wait at (of that rank or a more important one), as the agents publish them."""
        others = [self.counter(t) for t in self._waiting_at(rank) if t != tenant]
        others.extend(elsewhere)
        if not others:
            return True
        weighted = cost / self._book.weight(tenant)
        return self.counter(tenant) + weighted <= min(others) + max(self._largest, weighted)

    def charge(self, tenant: str, cost: float) -> None:
        """A request of `tenant` was admitted at `cost` (its estimate)."""
        self._largest = max(self._largest, cost / self._book.weight(tenant))
        self._charged[tenant] = self._charged.get(tenant, 0.0) + cost / self._book.weight(tenant)
        if self._shared is not None:
            # Counted at once; the agents' next totals include it.
            self._shared[tenant] = self._shared.get(tenant, 0.0) + cost
        self._last_served = self.counter(tenant)
        self._served_at[tenant] = self._clock()
        self._forget_beyond_bound()

    def settle(self, tenant: str, charged_output_tokens: int, generated_tokens: int) -> None:
        """A request charged `charged_output_tokens` of output generated `generated_tokens` (with
        shared totals, its agent settles it from its Release)."""
        if tenant not in self._charged:
            return
        delta = self._config.output_weight * (generated_tokens - charged_output_tokens)
        self._charged[tenant] = max(0.0, self._charged[tenant] + delta / self._book.weight(tenant))

    def standing(self) -> list[tuple[str, float, int]]:
        """Every tenant known: its counter and its requests waiting."""
        known = {*self._charged, *self._lift, *self._shared_lift, *(self._shared or ())}
        waiting: Counter[str] = Counter()
        for (tenant, _), n in self._waiting.items():
            waiting[tenant] += n
        return [(tenant, self.counter(tenant), waiting[tenant]) for tenant in known]

    def _waits(self, tenant: str) -> bool:
        return any(t == tenant for t, _ in self._waiting)

    def _waiting_at(self, rank: int) -> set[str]:
        """The tenants with a waiter here of `rank` or a more important one."""
        return {t for t, r in self._waiting if r <= rank}

    def _active(self, tenant: str) -> bool:
        served_at = self._served_at.get(tenant)
        return served_at is not None and self._clock() - served_at <= ACTIVE_S

    def _lifted(self, tenant: str) -> float:
        own = self._lift.get(tenant, 0.0)
        shared = self._shared_lift.get(tenant)
        return own if shared is None else max(own, shared / self._book.weight(tenant))

    def _attained(self, tenant: str) -> float:
        if self._shared is not None:
            return self._shared.get(tenant, 0.0) / self._book.weight(tenant)
        return self._charged.get(tenant, 0.0)

    def _forget_beyond_bound(self) -> None:
        # Called on every charge and lift: the union is built only once a table outgrows the bound.
        if max(len(self._charged), len(self._lift), len(self._served_at)) <= self._max_tenants:
            return
        known = {*self._charged, *self._lift, *self._served_at}
        while len(known) > self._max_tenants:
            idle = [t for t in known if not self._waits(t)]
            if not idle:
                return
            gone = min(idle, key=self.counter)
            known.discard(gone)
            self._charged.pop(gone, None)
            self._lift.pop(gone, None)
            self._served_at.pop(gone, None)
