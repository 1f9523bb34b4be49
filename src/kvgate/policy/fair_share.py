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

A request is charged its estimate when admitted (the output budget it reserved) and settled on what
its engine's answer says it generated, where the gate reads the answer (an endpoint picker,
kvgate.gate.picker): the counter then holds what ran, not what was guessed.

Counters live in one gate process: with several gate replicas, or workers (`server.workers`), each
keeps its own, so the bound holds per process (docs/operations.md, "Fair shares").
"""

from __future__ import annotations

from collections import Counter

from kvgate.config import FairnessConfig

# Tenants remembered. Past this, the tenant with the least counter that waits for nothing is
# forgotten: were it to come back, it is lifted to the others' least counter anyway.
MAX_TENANTS = 10_000


class FairShare:
    def __init__(self, config: FairnessConfig, max_tenants: int = MAX_TENANTS) -> None:
        self._config = config
        self._max_tenants = max_tenants
        self._counters: dict[str, float] = {}
        self._waiting: Counter[str] = Counter()  # waiters per tenant: a tenant here is backlogged
        self._last_served = 0.0

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """A request's cost in tokens, before its tenant's weight."""
        return prompt_tokens + self._config.output_weight * output_tokens

    def counter(self, tenant: str) -> float:
        """The weighted service `tenant` attained: the fair order's key, least first."""
        return self._counters.get(tenant, 0.0)

    def waits(self, tenant: str) -> None:
        """A request of `tenant` starts waiting; the first of them lifts the tenant's counter."""
        if self._waiting[tenant] == 0:
            others = [self._counters.get(t, 0.0) for t, n in self._waiting.items() if n > 0]
            floor = min(others) if others else self._last_served
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), floor)
            self._forget_beyond_bound()
        self._waiting[tenant] += 1

    def done_waiting(self, tenant: str) -> None:
        """A waiter of `tenant` left the line: admitted, timed out or gone."""
        left = self._waiting[tenant] - 1
        if left > 0:
            self._waiting[tenant] = left
        else:
            del self._waiting[tenant]

    def charge(self, tenant: str, cost: float) -> None:
        """A request of `tenant` was admitted at `cost` (its estimate)."""
        counter = self._counters.get(tenant, 0.0) + cost / self._config.weight(tenant)
        self._counters[tenant] = counter
        self._last_served = counter
        self._forget_beyond_bound()

    def settle(self, tenant: str, charged_output_tokens: int, generated_tokens: int) -> None:
        """A request charged `charged_output_tokens` of output generated `generated_tokens`."""
        if tenant not in self._counters:
            return
        delta = self._config.output_weight * (generated_tokens - charged_output_tokens)
        self._counters[tenant] = max(0.0, self._counters[tenant] + delta / self._config.weight(tenant))

    def standing(self) -> list[tuple[str, float, int]]:
        """Every tenant remembered: its counter and its requests waiting."""
        return [(tenant, counter, self._waiting[tenant]) for tenant, counter in self._counters.items()]

    def _forget_beyond_bound(self) -> None:
        while len(self._counters) > self._max_tenants:
            idle = [t for t in self._counters if self._waiting[t] == 0]
            if not idle:
                return
            del self._counters[min(idle, key=self._counters.__getitem__)]
