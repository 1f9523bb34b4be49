"""Caps on one tenant's long requests, beside its fair share (fairness: in kvgate.yaml): a token quota
per window, and the most of the long pool's KV its reservations may hold while another tenant's long
requests wait.

Pure. A quota is a token bucket: it holds `tokens` and refills them over `window_s`. A request takes
its estimate (prompt + output budget) when it is admitted and gives it back if it is not; when it
ends, its output part is settled on what it generated: the count in its answer where the gate reads
it (an endpoint picker, kvgate.gate.picker), else what the agent settled the reservation on (its node's
measured decode rate over the hold, ReleaseOutcome.settled_output_tokens). So the quota counts what
ran, not the 4-100x over-declared `max_tokens` of reasoning models and agents. A request larger than the whole
quota is let through only on a full bucket, which it overdraws: refusing it would refuse it for ever
while its 429 said to come back. An over-quota request is told to come back when the bucket will hold
it again.

The share cap is work-conserving: it holds a tenant back only while another tenant's long request
waits (in this gate's line). It counts the tokens the tenant's live reservations hold against the
admissible KV of the long pool's nodes (kvgate.headroom.snapshot.admissible): as the agents publish
them (NodeHeadroom.tenant_held), so every gate replica's grants count, or this process's own where
that is more.

The quota is this gate process's own: with several gate replicas (or `server.workers`) each holds a
tenant to its quota of what it admits (docs/operations.md, "Fair shares").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.config import TokenQuotaConfig
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

    def take_quota(self, tenant: str, tokens: int, now: float) -> float | None:
        """Take `tokens` from `tenant`'s quota: None when taken (or it has none), else the seconds until
        its bucket holds them again."""
        quota = self._book.quota(tenant)
        if quota is None:
            return None
        bucket = self._refilled(tenant, quota, now)
        if bucket.tokens >= tokens or bucket.tokens >= quota.tokens:
            bucket.tokens -= tokens
            return None
        wanted = min(tokens, quota.tokens) - bucket.tokens
        return wanted / _refill_per_s(quota)

    def give_back(self, tenant: str, tokens: int, now: float) -> None:
        """A request that took `tokens` was not admitted, or ran `tokens` fewer than it took (negative:
        more)."""
        quota = self._book.quota(tenant)
        if quota is None or tenant not in self._buckets:
            return
        bucket = self._refilled(tenant, quota, now)
        bucket.tokens = min(float(quota.tokens), bucket.tokens + tokens)

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

    def _refilled(self, tenant: str, quota: TokenQuotaConfig, now: float) -> _Bucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= MAX_TENANTS:
                self._forget_full(now)
            bucket = self._buckets[tenant] = _Bucket(float(quota.tokens), now)
            return bucket
        bucket.tokens = min(float(quota.tokens), bucket.tokens + (now - bucket.at) * _refill_per_s(quota))
        bucket.at = now
        return bucket

    def _forget_full(self, now: float) -> None:
        """Forget the buckets that are full by now: a tenant that comes back starts on a full one."""
        for tenant, bucket in list(self._buckets.items()):
            quota = self._book.quota(tenant)
            if quota is None or bucket.tokens + (now - bucket.at) * _refill_per_s(quota) >= quota.tokens:
                del self._buckets[tenant]


def _refill_per_s(quota: TokenQuotaConfig) -> float:
    return quota.tokens / quota.window_s
