"""What a node's agent knows at one instant, as plain data, and the one headroom formula.

`NodeHeadroom` is the pure twin of the protobuf message the agent streams; `NodeView` is what the
gate's headroom view hands its policy; `ReserveOutcome` and `ReleaseOutcome` are the agent's answers,
the same type where the ledger gives them and where a gate reads them. All of them live here, free
of gRPC, so the policy can import them and stay pure. Values the agent does not know are None, never
zero.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

_N = TypeVar("_N", int, float)
_V = TypeVar("_V")


class CapacitySource(StrEnum):
    MANUAL = "manual"  # --capacity-tokens
    ENGINE = "engine"  # the engine's own KV pool size from its /metrics
    STATIC = "static"  # model shape over NVML free memory
    NONE = "none"


class UsageSource(StrEnum):
    ENGINE = "engine"  # the engine's own KV figures
    # No KV figure to read (TGI, llama.cpp, no engine metrics): the agent's reservations plus an
    # allowance for the requests the engine runs that hold none.
    RESERVATIONS = "reservations"
    NONE = "none"  # nothing known: the node admits nothing


@dataclass(frozen=True, slots=True)
class PrefixChain:
    """A prompt as prefix blocks (cut by kvgate.request.prefix): one chained 64-bit hash per full block,
    in prompt order, each standing for `block_tokens` estimated tokens. Block i's hash covers every byte
    before its end, so two prompts share block i exactly when they share blocks 0..i."""

    blocks: tuple[int, ...]
    block_tokens: int

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens


@dataclass(frozen=True, slots=True)
class PrefixSummary:
    """What a node's agent tells every gate of the prefixes its engine holds (kvgate.agent.prefix_blocks).

    `blocks` holds hashes of blocks the node holds, a sample of each chain (every few blocks, and its
    tip), so a gate finds how much of a request's chain the node holds within a few blocks.
    `generation` changes whenever the content does: a gate reuses the set it built when it does not.
    """

    blocks: frozenset[int] = frozenset()
    indexed_tokens: int = 0  # tokens of prefix blocks the agent believes the engine holds
    saved_tokens: int = 0  # tokens live reservations share instead of reserving each
    generation: int = 0

    def matched_blocks(self, chain: PrefixChain) -> int:
        """Leading blocks of `chain` the node holds, as far as the summary shows (never more)."""
        for index in range(len(chain.blocks) - 1, -1, -1):
            if chain.blocks[index] in self.blocks:
                return index + 1
        return 0


NO_PREFIXES = PrefixSummary()


@dataclass(frozen=True, slots=True)
class ExpectedRelease:
    """Live reservations a node's agent expects to end `after_s` after its sample, freeing `tokens`
    (kvgate.agent.releases)."""

    after_s: float
    tokens: int


class NodeRole(StrEnum):
    """A node's part in a soft pool (docs/operations.md, "Soft pools")."""

    LONG = "long"  # takes long requests only (chat goes elsewhere)
    INTERACTIVE = "interactive"  # serves chat; lends what chat leaves to long requests, within limits


@dataclass(frozen=True, slots=True)
class HeadClaim:
    """The waiter a node's agent holds room for: the first, in the one waiting order every gate and
    queue shares (rank, then its tenant's fair service, then waiting since), that found no room on the
    node (kvgate.agent.backfill). `slot_after_s`: when the node's expected releases first fit it (None:
    not within the forecast). `fair_service`: its tenant's weighted attained service as its caller
    ordered it (0 without fair shares)."""

    tokens: int
    waiting_since_unix_ns: int
    rank: int
    slot_after_s: float | None
    fair_service: float = 0.0


@dataclass(frozen=True, slots=True)
class GpuReading:
    uuid: str
    index: int
    name: str
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    # The driver's reserved memory; None with the v1 memory call or when not supported.
    reserved_bytes: int | None
    healthy: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class NvmlReading:
    """Every GPU of the node at one instant, and whether NVML itself is usable."""

    gpus: tuple[GpuReading, ...]
    healthy: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class NodeHeadroom:
    node: str
    endpoint: str
    seq: int
    sample_time_unix_ns: int
    capacity_tokens: int
    safety_ratio: float
    used_tokens: int | None
    reserved_tokens: int
    reservations: int
    headroom_tokens: int
    healthy: bool
    # Why the node is unhealthy; for a healthy node, what qualifies its figures (idle engine,
    # reservation-only); empty otherwise.
    reason: str
    capacity_source: CapacitySource
    kv_usage: float | None
    running: int | None
    waiting: int | None
    preemptions_total: int | None
    gpus: tuple[GpuReading, ...]
    period_ms: int
    engine_kind: str = ""  # kvgate.agent.sources.engines.EngineKind values; "" without engine metrics
    engines: tuple[str, ...] = ()  # the engines and ranks the page showed
    capacity_rule: str = ""  # how capacity_tokens was found
    usage_source: UsageSource = UsageSource.NONE
    # Reservation-only: tokens charged for the engine's requests that hold no reservation.
    unreserved_tokens: int | None = None
    engine_sample_age_ms: int | None = None  # since the last good scrape of the engine
    prefix: PrefixSummary = NO_PREFIXES
    # Output tokens per second per running request, measured from the engine's counters.
    decode_tokens_per_s: float | None = None
    # When live reservations are expected to end, soonest first (what a refused request waits for).
    releases: tuple[ExpectedRelease, ...] = ()
    freed_tokens_total: int = 0  # tokens freed by ended reservations since the agent started
    prefix_source: str = ""  # where the prefix index comes from (the engine's KV events, guesses)
    # The longest gap between two messages (the agent sends on change and at least this often); 0 for
    # an agent that sends every period.
    heartbeat_ms: int = 0
    role: NodeRole = NodeRole.LONG
    # Interactive nodes: what a long request may take now (None: the node does not lend), and the
    # largest uncached prompt it takes from one (0: no cap).
    lend_tokens: int | None = None
    lend_max_prompt_tokens: int = 0
    head: HeadClaim | None = None  # the waiter the agent holds room for, if any
    # The longest request (prompt + output) the engine serves, from its /v1/models; 0: not known.
    max_model_len: int = 0
    # Uncached prompt tokens of granted reservations the engine has yet to prefill, as of the sample,
    # and the rate they drain at (kvgate.agent.prefill_backlog; 0: an agent that does not say).
    prefill_backlog_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    # Fair shares across replicas: each tenant's service attained on this node's grants since the agent
    # started, in cost units (kvgate.agent.tenant_service).
    tenant_service: Mapping[str, float] = field(default_factory=dict)
    # Tenant caps across replicas: the tokens each tenant's live reservations here were charged.
    tenant_held: Mapping[str, int] = field(default_factory=dict)
    # Tenant quotas across replicas: the tokens each tenant's grants here reserved since the agent
    # started, settled on what ran; `publishes_tenant_tokens` False: an agent that does not say.
    tenant_tokens: Mapping[str, int] = field(default_factory=dict)
    publishes_tenant_tokens: bool = False
    # Fair shares across replicas: the largest lift a grant here carried for each tenant, in cost units.
    tenant_lift: Mapping[str, float] = field(default_factory=dict)

    @property
    def admissible_tokens(self) -> int:
        """The most tokens the agent grants on this node when it is idle."""
        return admissible(self.capacity_tokens, self.safety_ratio)


@dataclass(frozen=True, slots=True)
class NodeView:
    """One agent as the gate sees it (see kvgate.headroom.view)."""

    agent: str  # host:port of the agent: the key for reserve() and release()
    headroom: NodeHeadroom | None  # None until the first message
    age_s: float  # since the latest message arrived, by the gate's monotonic clock; inf before the first
    connected: bool  # a Subscribe stream is open and has delivered
    fresh: bool  # age_s <= headroom.stale_after_s
    healthy: bool  # the agent's own verdict in its latest message

    @classmethod
    def seen(
        cls,
        agent: str,
        headroom: NodeHeadroom | None,
        received_at: float,
        *,
        now: float,
        connected: bool,
        stale_after_s: float,
    ) -> NodeView:
        """The agent as of `now`, its latest message (None before the first) having arrived at
        `received_at` (-inf before the first) on the same clock: what every view of agents answers."""
        age = now - received_at
        healthy = headroom is not None and headroom.healthy
        return cls(agent, headroom, age, connected, age <= stale_after_s, healthy)

    @property
    def usable(self) -> bool:
        """Whether the node's agent may be asked for a reservation: it has reported, its stream is up
        and it says it is healthy. Fresh or stale: what a stale one gets is the stale policy's call."""
        return self.headroom is not None and self.connected and self.healthy

    @property
    def prefill_backlog_tokens(self) -> float:
        """The node's prefill backlog now: its latest message's, drained at its rate for the message's
        age (kvgate.agent.prefill_backlog)."""
        if self.headroom is None:
            return 0.0
        h = self.headroom
        return prefill_left(h.prefill_backlog_tokens, self.age_s, h.prefill_tokens_per_s)


def prefill_left(tokens: float, elapsed_s: float, tokens_per_s: float) -> float:
    """What a prefill backlog of `tokens` has left after `elapsed_s` at `tokens_per_s`: the one drain
    rule the agent counts by and the gate ages its messages by."""
    return max(0.0, tokens - elapsed_s * tokens_per_s)


@dataclass(frozen=True, slots=True)
class TenantCharge:
    """Fair shares across replicas: the tenant a reservation is charged to, and its cost (prompt +
    output_weight x output tokens), which the agent adds to the tenant's service."""

    tenant: str
    cost: float
    output_weight: float = 0.0  # what an output token of `cost` counts: its settlement's rate
    # What the caller's fair order lifted the tenant's service by (kvgate.policy.fair_share), which the
    # agent passes on to every replica (NodeHeadroom.tenant_lift).
    lift: float = 0.0


class ReserveReason(StrEnum):
    GRANTED = "granted"
    # A retried Reserve for a live reservation: granted, not charged twice.
    ALREADY_RESERVED = "already_reserved"
    INSUFFICIENT_HEADROOM = "insufficient_headroom"
    UNHEALTHY = "unhealthy"
    NO_CAPACITY = "no_capacity"
    # The request_id is live with a different token count, or held by another holder.
    REQUEST_ID_CONFLICT = "request_id_conflict"
    # Its Release came first: the caller got no answer in time and gave the grant back unseen
    # (kvgate.headroom.giveback), so this Reserve, arriving late, must not hold room for good.
    RELEASED_FIRST = "released_first"
    # The holder's live reservations would be charged more than the agent lets one holder have.
    HOLDER_CAP = "holder_cap"
    # It would take room the agent holds for an earlier waiter in the one waiting order
    # (kvgate.agent.backfill): it fits now, but not beside that waiter's slot.
    HELD_FOR_HEAD = "held_for_head"
    # An interactive node lends a long request only what chat leaves, within its limits
    # (kvgate.agent.lending).
    LEND_LIMIT = "lend_limit"


@dataclass(frozen=True, slots=True)
class TenantStanding:
    """One tenant's entries in a node's NodeHeadroom.tenant_service, tenant_held and tenant_tokens
    after a call that charged or settled it. A Release settles its tenant's service on what ran
    (kvgate.agent.tenant_service), which its caller cannot work out alone."""

    tenant: str
    service: float | None  # None: the node keeps no total for the tenant (forgotten past its bound)
    held: int
    tokens: int | None  # as `service`

    def onto(self, headroom: NodeHeadroom) -> NodeHeadroom:
        return replace(
            headroom,
            tenant_service=_with(headroom.tenant_service, self.tenant, self.service),
            tenant_held=_with(headroom.tenant_held, self.tenant, self.held or None),
            tenant_tokens=_with(headroom.tenant_tokens, self.tenant, self.tokens),
        )


def _with(entries: Mapping[str, _V], key: str, value: _V | None) -> dict[str, _V]:
    """`entries` with `key` set to `value`, or without it where `value` is None."""
    updated = dict(entries)
    if value is None:
        updated.pop(key, None)
    else:
        updated[key] = value
    return updated


@dataclass(frozen=True, slots=True)
class LedgerFigures:
    """What a Reserve or Release changed of the figures a NodeHeadroom carries, as of its answer: the
    caller takes them into its view at once, and the agent sends it no stream message for them
    (kvgate.agent.subscribers). `releases` count from the answer."""

    headroom_tokens: int
    reserved_tokens: int
    reservations: int
    freed_tokens_total: int
    releases: tuple[ExpectedRelease, ...]
    # The agent's last sample when it answered: a message of this seq or lower predates the call.
    seq: int = 0
    # The tenant the call charged or settled (None: it named none, or the reservation was unknown).
    tenant: TenantStanding | None = None

    def onto(self, headroom: NodeHeadroom, age_s: float) -> NodeHeadroom:
        """`headroom` with these figures in it, for a message `age_s` old at the answer: its forecast
        counts from its sample, so this one's is shifted by that age."""
        told = replace(
            headroom,
            headroom_tokens=self.headroom_tokens,
            reserved_tokens=self.reserved_tokens,
            reservations=self.reservations,
            freed_tokens_total=self.freed_tokens_total,
            releases=tuple(ExpectedRelease(r.after_s + age_s, r.tokens) for r in self.releases),
        )
        return self.tenant.onto(told) if self.tenant is not None else told


@dataclass(frozen=True, slots=True)
class ReserveOutcome:
    """The agent's answer to a Reserve, as its ledger gives it (kvgate.agent.ledger) and as a gate
    reads it off the wire (kvgate.headroom.wire). A refusal (`granted` False, with `reason`) is an
    answer, not an error."""

    granted: bool
    reason: str  # a ReserveReason; from the wire, whatever the agent said (a newer one may say more)
    headroom_tokens: int  # after this decision
    reserved_tokens: int
    lease_s: float
    # Of the tokens asked, those this reservation added to the node's reserved tokens: prefix blocks
    # that live reservations there already hold are charged once. Equal to the tokens asked without a
    # prefix chain; 0 for a refusal.
    charged_tokens: int = 0
    # Tokens of the chain's prefix the agent expects the engine to find in its prefix cache.
    cached_tokens: int = 0
    reservations: int = 0  # live reservations on the node after this decision
    after: LedgerFigures | None = None  # None: from an agent that does not tell them


@dataclass(frozen=True, slots=True)
class ReleaseOutcome:
    """The agent's answer to a Release, on both ends of the wire as ReserveOutcome is."""

    released: bool  # False when the reservation was already gone (released twice, or expired)
    headroom_tokens: int
    reserved_tokens: int
    # What the agent settled the reservation's output on (read, else measured); 0: unknown.
    settled_output_tokens: int = 0
    after: LedgerFigures | None = None  # as ReserveOutcome.after


def admissible(capacity: int, safety_ratio: float) -> int:
    """The tokens an agent grants against: capacity x safety ratio, rounded down. The one place this
    is computed; read it as `NodeHeadroom.admissible_tokens`."""
    return math.floor(capacity * safety_ratio)


def headroom_tokens(capacity: int, safety_ratio: float, observed: int | None, reserved: int) -> int:
    """admissible tokens - max(observed, Σ live reservations).

    The max, not the sum: an admitted request shows up in the engine's usage as its prefill runs, so
    its reservation and its observed tokens are the same tokens counted twice. Negative when the node
    holds more than its limit.
    """
    committed = reserved if observed is None else max(observed, reserved)
    return admissible(capacity, safety_ratio) - committed


def combined_over_agents(
    nodes: Sequence[NodeView],
    per_tenant: Callable[[NodeHeadroom], Mapping[str, _N] | None],
    combine: Callable[[_N, _N], _N] = operator.add,
) -> dict[str, _N] | None:
    """Each tenant's figure over the agents' latest messages, summed (or combined by `combine`: `max`
    for a level, not an amount), `per_tenant` reading it from one (None: an agent that does not
    publish it); None when no agent does."""
    totals: dict[str, _N] = {}
    published = False
    for node in nodes:
        figures = per_tenant(node.headroom) if node.headroom is not None else None
        if figures is None:
            continue
        published = True
        for tenant, figure in figures.items():
            totals[tenant] = combine(totals[tenant], figure) if tenant in totals else figure
    return totals if published else None
