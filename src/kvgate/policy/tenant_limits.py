"""Caps on one tenant's long requests, beside its fair share (fairness: in kvgate.yaml): a token quota
per window, and the most of the long pool's KV its reservations may hold while another tenant's long
requests wait.

Pure. A quota is a token bucket: it holds `tokens` and refills them over `window_s`. A request takes
its estimate (prompt + output budget) when it is admitted and gives it back if it is not; when it
ends, its output part is settled on what it generated: the count in its answer where the gate reads it
(an endpoint picker, kvgate.gate.picker), else what the agent settled the reservation on (its node's
measured decode rate over the hold, ReleaseOutcome.settled_output_tokens). So the quota counts what
ran, not the over-declared `max_tokens` of reasoning models and agents. A request larger than the
whole quota is let through only on a full bucket, which it overdraws: refusing it would refuse it for
ever while its 429 said to come back. An over-quota request is told to come back when the bucket will
hold it again.

Across replicas. Every long request passes one agent's Reserve, and the agents publish what each
tenant's grants reserved, settled on what ran (NodeHeadroom.tenant_tokens). Where they do (`observe`),
every replica's bucket takes what the tenant's sum over the agents grew by: the grants of every gate
replica and of `kvgate queue`, and their settlements. A replica's own grant is taken at once, and its
view of the agents' figures counts it at once too (kvgate.headroom.view), so a message sampled before
the grant does not give it back; a request still waiting for its grant holds its
estimate against the bucket here (`pending`), so two of a tenant's requests cannot both pass on one
bucket's room. Two replicas may each let one request through on the same room in the time it takes an
agent's message to reach the other (about a period, 100 ms): the quota slips by at most that. An
agent restart forgets what its node counted, which refills its tenants' buckets by as much; a gate
restart starts every bucket full. Without the agents' figures, each gate holds a tenant to the whole
quota of what it admits itself.

The share cap is work-conserving: it holds a tenant back only while another tenant's long request
waits (in this gate's line). It counts the tokens the tenant's live reservations hold against the
admissible KV of the long pool's nodes (kvgate.headroom.snapshot.admissible): as the agents publish
them (NodeHeadroom.tenant_held), so every gate replica's grants count, or this process's own where
that is more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvgate.config import TokenQuotaConfig
from kvgate.headroom.snapshot import NodeView, combined_over_agents
from kvgate.policy.tenant_book import TenantBook

# Quota buckets remembered; past this, the full ones are forgotten (they hold nothing to remember).
MAX_TENANTS = 10_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class TenantLimits:
    def __init__(self, book: TenantBook) -> None:
        self._book = book
        self._buckets: dict[str, _Bucket] = {}
        self._held: dict[str, int] = {}  # tokens held by this gate's live reservations, by tenant
        # With the agents' figures: each bucket's tenant's tokens summed over them as last counted, the
        # latest sums, and the estimates of requests that took quota and wait for their grant.
        self._shared = False
        self._seen: dict[str, int] = {}
        self._latest: Mapping[str, int] = {}
        self._pending: dict[str, int] = {}

    def observe(self, totals: Mapping[str, int] | None, now: float) -> None:
        """What each tenant's grants reserved, summed over the agents (None: no agent says): every
        bucket takes what its tenant's sum grew by since it was last counted (gives back what it fell
        by: settlements)."""
        self._shared = totals is not None
        if totals is None:
            return
        self._latest = totals
        for tenant, bucket in self._buckets.items():
            total = totals.get(tenant, 0)
            seen = self._seen.get(tenant, total)
            self._seen[tenant] = total
            quota = self._book.quota(tenant)
            if total != seen and quota is not None:
                self._refill(bucket, quota, now)
                bucket.tokens = min(float(quota.tokens), bucket.tokens - (total - seen))

    def take_quota(self, tenant: str, tokens: int, now: float) -> float | None:
        """Take `tokens` from `tenant`'s quota: None when taken (or it has none), else the seconds until
        its bucket holds them again."""
        quota = self._book.quota(tenant)
        if quota is None:
            return None
        bucket = self._refilled(tenant, quota, now)
        room = bucket.tokens - self._pending.get(tenant, 0)
        if room >= tokens or room >= quota.tokens:
            if self._shared:
                self._pending[tenant] = self._pending.get(tenant, 0) + tokens
            else:
                bucket.tokens -= tokens
            return None
        wanted = min(tokens, quota.tokens) - room
        return wanted / _refill_per_s(quota)

    def granted(self, tenant: str, tokens: int) -> None:
        """A request that took `tokens` of quota was granted: with the agents' figures, it is taken from
        the bucket now, and counted as seen (their next figures show it)."""
        if not self._shared or self._unpend(tenant, tokens) == 0:
            return
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.tokens -= tokens
            self._seen[tenant] = self._seen.get(tenant, 0) + tokens

    def give_back(self, tenant: str, tokens: int, now: float) -> None:
        """A request that took `tokens` was not admitted."""
        if self._shared and self._unpend(tenant, tokens):
            return
        self._put_back(tenant, tokens, now)

    def settle(self, tenant: str, tokens: int, now: float) -> None:
        """An admitted request ran `tokens` fewer than it took (negative: more). With the agents'
        figures their settlement comes with their next message instead."""
        if not self._shared:
            self._put_back(tenant, tokens, now)

    def share_passed(
        self, tenant: str, tokens: int, admissible_tokens: int, others_wait: bool, shared_held: int = 0
    ) -> float | None:
        """The most share of the pool's admissible KV that `tokens` more would take `tenant` past while
        another tenant's request waits; None when they would not. `shared_held`: what the agents say
        the tenant's live reservations hold, every replica's grants included; this process's own count
        stands in where it is more (agents that do not say, a grant their next message will show)."""
        share = self._book.max_kv_share(tenant)
        if share is None or not others_wait or admissible_tokens <= 0:
            return None
        held = max(shared_held, self._held.get(tenant, 0))
        return share if held + tokens > share * admissible_tokens else None

    def hold(self, tenant: str, tokens: int) -> None:
        self._held[tenant] = self._held.get(tenant, 0) + tokens

    def let_go(self, tenant: str, tokens: int) -> None:
        left = self._held.get(tenant, 0) - tokens
        if left > 0:
            self._held[tenant] = left
        else:
            self._held.pop(tenant, None)

    def _unpend(self, tenant: str, tokens: int) -> int:
        """Take up to `tokens` off `tenant`'s pending estimates; what was there."""
        pending = self._pending.get(tenant, 0)
        taken = min(pending, tokens)
        if pending - taken > 0:
            self._pending[tenant] = pending - taken
        else:
            self._pending.pop(tenant, None)
        return taken

    def _put_back(self, tenant: str, tokens: int, now: float) -> None:
        quota = self._book.quota(tenant)
        if quota is None or tenant not in self._buckets:
            return
        bucket = self._refilled(tenant, quota, now)
        bucket.tokens = min(float(quota.tokens), bucket.tokens + tokens)

    def _refilled(self, tenant: str, quota: TokenQuotaConfig, now: float) -> _Bucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= MAX_TENANTS:
                self._forget_full(now)
            bucket = self._buckets[tenant] = _Bucket(float(quota.tokens), now)
            # What the agents counted before this bucket existed is not taken from it.
            self._seen[tenant] = self._latest.get(tenant, 0)
            return bucket
        self._refill(bucket, quota, now)
        return bucket

    @staticmethod
    def _refill(bucket: _Bucket, quota: TokenQuotaConfig, now: float) -> None:
        bucket.tokens = min(float(quota.tokens), bucket.tokens + (now - bucket.at) * _refill_per_s(quota))
        bucket.at = now

    def _forget_full(self, now: float) -> None:
        """Forget the buckets that are full by now (and nothing of theirs pending): a tenant that comes
        back starts on a full one."""
        for tenant, bucket in list(self._buckets.items()):
            quota = self._book.quota(tenant)
            full = quota is None or bucket.tokens + (now - bucket.at) * _refill_per_s(quota) >= quota.tokens
            if full and tenant not in self._pending:
                del self._buckets[tenant]
                self._seen.pop(tenant, None)


def agents_tokens(nodes: Sequence[NodeView]) -> dict[str, int] | None:
    """Each tenant's reserved tokens summed over the agents' latest messages (NodeHeadroom.tenant_tokens);
    None when no agent publishes them."""
    return combined_over_agents(
        nodes, lambda headroom: headroom.tenant_tokens if headroom.publishes_tenant_tokens else None
    )


def _refill_per_s(quota: TokenQuotaConfig) -> float:
    return quota.tokens / quota.window_s
