"""Fair shares across gate replicas: the service each tenant's reservations attained on this node.

Pure. Every long request passes one agent's Reserve, so the agents see all the service every gate
replica and `kvgate queue` hand out, where each replica alone sees its own. A grant that names its
tenant and cost (prompt + output_weight x output tokens, the gate's VTC charge) adds the cost to the
tenant's total; its Release settles the output part on what the request generated: what the gate
read in the answer, else what the node's engine was measured to generate over the request's hold
(kvgate.agent.ledger `output_generated`). The totals go out in the
stream (NodeHeadroom.tenant_service), and each gate adds them up over the agents
(kvgate.policy.fair_share), so every replica orders its line by the same counters.

Totals are kept for at most `max_tenants` tenants: past that the least served is forgotten (a tenant
that comes back is lifted to the others' least counter by the gates anyway).

It also counts the tokens each tenant's live reservations were charged (NodeHeadroom.tenant_held), which
the gates add up to hold a tenant to its most share of the pool (fairness max_kv_share) whatever replica
admitted its requests, and the tokens each tenant's grants reserved (prompt + output budget), settled
on what ran as the service is (NodeHeadroom.tenant_tokens), which the gates count quotas from
(kvgate.policy.tenant_limits).

And the largest lift a grant carried for each tenant (NodeHeadroom.tenant_lift): what a replica's fair
order added to the tenant's service when it came back from idle. Lifts are VTC's, and each replica
computes its own from what waits in its line; shared, a tenant lifted on its return to one replica is
lifted in all (kvgate.policy.fair_share).
"""

from __future__ import annotations

from kvgate.headroom.snapshot import TenantCharge, TenantStanding

MAX_TENANTS = 256


class TenantService:
    def __init__(self, max_tenants: int = MAX_TENANTS) -> None:
        self._max_tenants = max_tenants
        self._totals: dict[str, float] = {}
        self._tokens: dict[str, int] = {}
        # By request id: what each live reservation was charged, the output budget in it, the tokens
        # the node charged for it, and the tokens it reserved.
        self._live: dict[str, tuple[TenantCharge, int, int, int]] = {}
        self._held: dict[str, int] = {}
        self._lifts: dict[str, float] = {}

    def granted(
        self, request_id: str, charge: TenantCharge, output_tokens: int, tokens: int = 0, *, reserved: int = 0
    ) -> None:
        """`tokens`: what the node charged the reservation (its held KV); `reserved`: what the request
        reserved (prompt + output budget)."""
        tenant = charge.tenant
        self._live[request_id] = (charge, output_tokens, tokens, reserved)
        self._held[tenant] = self._held.get(tenant, 0) + tokens
        self._totals[tenant] = self._totals.get(tenant, 0.0) + charge.cost
        self._tokens[tenant] = self._tokens.get(tenant, 0) + reserved
        if charge.lift > self._lifts.get(tenant, 0.0):
            self._lifts[tenant] = charge.lift
        if len(self._totals) > self._max_tenants:
            least = min(self._totals, key=self._totals.__getitem__)
            del self._totals[least]
            self._tokens.pop(least, None)
            self._lifts.pop(least, None)

    def ended(self, request_id: str, generated_tokens: int = 0, *, ran: bool = True) -> None:
        """The reservation ended (released, or its lease ran out); `generated_tokens`, what it generated
        (read or measured), settles its output part (0: unknown, as charged). `ran` False: nothing ran
        under it (its Reserve's answer was lost, or its holder lost the job to another replica), so
        its whole charge is taken back."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        charge, output_tokens, tokens, reserved = live
        tenant = charge.tenant
        held = self._held.get(tenant, 0) - tokens
        if held > 0:
            self._held[tenant] = held
        else:
            self._held.pop(tenant, None)
        if tenant not in self._totals:
            return
        if not ran:
            self._totals[tenant] = max(0.0, self._totals[tenant] - charge.cost)
            self._tokens[tenant] = max(0, self._tokens.get(tenant, 0) - reserved)
            return
        if generated_tokens <= 0:
            return
        delta = charge.output_weight * (generated_tokens - output_tokens)
        self._totals[tenant] = max(0.0, self._totals[tenant] + delta)
        if reserved:
            self._tokens[tenant] = max(0, self._tokens.get(tenant, 0) + generated_tokens - output_tokens)

    def tenant_of(self, request_id: str) -> str | None:
        """The tenant a live reservation was charged to (None: it named none, or is not live)."""
        live = self._live.get(request_id)
        return live[0].tenant if live is not None else None

    def standing(self, tenant: str) -> TenantStanding:
        """`tenant`'s entries in totals(), held() and tokens() as they are now."""
        return TenantStanding(
            tenant, self._totals.get(tenant), self._held.get(tenant, 0), self._tokens.get(tenant)
        )

    def totals(self) -> dict[str, float]:
        return dict(self._totals)

    def held(self) -> dict[str, int]:
        return dict(self._held)

    def tokens(self) -> dict[str, int]:
        return dict(self._tokens)

    def lifts(self) -> dict[str, float]:
        return dict(self._lifts)
