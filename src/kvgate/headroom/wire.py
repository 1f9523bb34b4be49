"""Conversions between the plain headroom dataclasses and the generated protobuf messages: each
contract type (kvgate.headroom.snapshot) to its message and back, the agent's answers included.

The only module besides the gRPC adapters (`agent`, `client`) that imports generated code. Unknown
values travel as unset optional fields, never as zero.
"""

from __future__ import annotations

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.headroom.snapshot import (
    NO_PREFIXES,
    CapacitySource,
    ExpectedRelease,
    GpuReading,
    HeadClaim,
    LedgerFigures,
    NodeHeadroom,
    NodeRole,
    PrefixChain,
    PrefixSummary,
    ReleaseOutcome,
    ReserveOutcome,
    TenantCharge,
    TenantStanding,
    UsageSource,
)


class HeadroomEncoder:
    """Each NodeHeadroom to its serialized message, once for every subscriber.

    The GPU list and the prefix blocks are encoded again only when they changed: the NVML sampler hands
    back the same tuple while the figures stay the same, a prefix summary keeps its generation while
    its blocks do, and each encoded part is appended to the rest of the message as it is.
    Concatenated protobuf messages parse as their merge, and the first part leaves them unset.
    """

    def __init__(self) -> None:
        self._gpus: tuple[GpuReading, ...] = ()
        self._encoded_gpus = b""
        self._prefix: PrefixSummary = NO_PREFIXES
        self._encoded_prefix = b""

    def encode(self, h: NodeHeadroom) -> bytes:
        if h.gpus is not self._gpus:
            self._gpus = h.gpus
            self._encoded_gpus = pb.NodeHeadroom(gpus=[_gpu_to_proto(g) for g in h.gpus]).SerializeToString()
        if h.prefix != self._prefix:
            self._prefix = h.prefix
            self._encoded_prefix = pb.NodeHeadroom(prefix=_prefix_to_proto(h.prefix)).SerializeToString()
        scalars: bytes = _scalars_to_proto(h).SerializeToString()
        return scalars + self._encoded_gpus + self._encoded_prefix


def _scalars_to_proto(h: NodeHeadroom) -> pb.NodeHeadroom:
    return pb.NodeHeadroom(
        node=h.node,
        endpoint=h.endpoint,
        seq=h.seq,
        sample_time_unix_ns=h.sample_time_unix_ns,
        capacity_tokens=h.capacity_tokens,
        safety_ratio=h.safety_ratio,
        used_tokens=h.used_tokens,
        reserved_tokens=h.reserved_tokens,
        reservations=h.reservations,
        headroom_tokens=h.headroom_tokens,
        healthy=h.healthy,
        reason=h.reason,
        capacity_source=h.capacity_source.value,
        kv_usage=h.kv_usage,
        running=h.running,
        waiting=h.waiting,
        preemptions_total=h.preemptions_total,
        period_ms=h.period_ms,
        engine_kind=h.engine_kind,
        engines=h.engines,
        capacity_rule=h.capacity_rule,
        usage_source=h.usage_source.value,
        unreserved_tokens=h.unreserved_tokens,
        engine_sample_age_ms=h.engine_sample_age_ms,
        decode_tokens_per_s=h.decode_tokens_per_s,
        releases=[pb.ExpectedRelease(after_ms=round(r.after_s * 1000), tokens=r.tokens) for r in h.releases],
        freed_tokens_total=h.freed_tokens_total,
        prefix_source=h.prefix_source,
        heartbeat_ms=h.heartbeat_ms,
        role=h.role.value,
        lend_tokens=h.lend_tokens,
        lend_max_prompt_tokens=h.lend_max_prompt_tokens,
        head=_head_to_proto(h.head) if h.head is not None else None,
        max_model_len=h.max_model_len,
        prefill_backlog_tokens=h.prefill_backlog_tokens,
        prefill_tokens_per_s=h.prefill_tokens_per_s,
        tenant_service=h.tenant_service,
        tenant_held=h.tenant_held,
        tenant_tokens=h.tenant_tokens,
        publishes_tenant_tokens=h.publishes_tenant_tokens,
        tenant_lift=h.tenant_lift,
    )


def _head_to_proto(c: HeadClaim) -> pb.HeadClaim:
    slot_ms = 0 if c.slot_after_s is None else max(1, round(c.slot_after_s * 1000))
    return pb.HeadClaim(
        tokens=c.tokens,
        waiting_since_unix_ns=c.waiting_since_unix_ns,
        rank=c.rank,
        slot_after_ms=slot_ms,
        fair_service=c.fair_service,
    )


def _head_from_proto(m: pb.HeadClaim) -> HeadClaim:
    slot = m.slot_after_ms / 1000 if m.slot_after_ms else None
    return HeadClaim(m.tokens, m.waiting_since_unix_ns, m.rank, slot, m.fair_service)


def _prefix_to_proto(p: PrefixSummary) -> pb.PrefixSummary:
    return pb.PrefixSummary(
        blocks=sorted(p.blocks),
        indexed_tokens=p.indexed_tokens,
        saved_tokens=p.saved_tokens,
        generation=p.generation,
    )


def prefix_from_proto(m: pb.PrefixSummary, previous: PrefixSummary = NO_PREFIXES) -> PrefixSummary:
    """The summary; `previous`'s block set when the generation says the blocks did not change."""
    unchanged = m.generation and m.generation == previous.generation
    blocks = previous.blocks if unchanged else frozenset(m.blocks)
    return PrefixSummary(blocks, m.indexed_tokens, m.saved_tokens, m.generation)


def reserve_request(
    request_id: str,
    tokens: int,
    lease_s: float,
    holder: str,
    prefix: PrefixChain | None,
    *,
    output_tokens: int = 0,
    waiting_since_unix_ns: int = 0,
    rank: int = 0,
    fair_service: float = 0.0,
    hold_slot: bool = False,
    charge: TenantCharge | None = None,
    reports_first_token: bool = False,
) -> pb.ReserveRequest:
    request = pb.ReserveRequest(
        request_id=request_id,
        tokens=tokens,
        lease_s=lease_s,
        holder=holder,
        output_tokens=output_tokens,
        waiting_since_unix_ns=waiting_since_unix_ns,
        rank=rank,
        fair_service=fair_service,
        hold_slot=hold_slot,
        reports_first_token=reports_first_token,
    )
    if charge is not None:
        request.tenant, request.cost, request.output_weight = charge.tenant, charge.cost, charge.output_weight
        request.lift = charge.lift
    if prefix is not None:
        request.prefix_blocks.extend(prefix.blocks)
        request.prefix_block_tokens = prefix.block_tokens
    return request


def charge_from_proto(m: pb.ReserveRequest) -> TenantCharge | None:
    return TenantCharge(m.tenant, m.cost, m.output_weight, m.lift) if m.tenant else None


def chain_from_proto(m: pb.ReserveRequest) -> PrefixChain | None:
    if not m.prefix_blocks:
        return None
    return PrefixChain(tuple(m.prefix_blocks), m.prefix_block_tokens)


def reserve_to_proto(o: ReserveOutcome) -> pb.ReserveResponse:
    return pb.ReserveResponse(
        granted=o.granted,
        reason=o.reason,
        headroom_tokens=o.headroom_tokens,
        reserved_tokens=o.reserved_tokens,
        lease_s=o.lease_s,
        charged_tokens=o.charged_tokens,
        cached_tokens=o.cached_tokens,
        reservations=o.reservations,
        after=_figures_to_proto(o.after),
    )


def _figures_to_proto(f: LedgerFigures | None) -> pb.LedgerFigures | None:
    if f is None:
        return None
    return pb.LedgerFigures(
        headroom_tokens=f.headroom_tokens,
        reserved_tokens=f.reserved_tokens,
        reservations=f.reservations,
        freed_tokens_total=f.freed_tokens_total,
        releases=[pb.ExpectedRelease(after_ms=round(r.after_s * 1000), tokens=r.tokens) for r in f.releases],
        seq=f.seq,
        tenant=_standing_to_proto(f.tenant),
    )


def _standing_to_proto(t: TenantStanding | None) -> pb.TenantStanding | None:
    if t is None:
        return None
    return pb.TenantStanding(tenant=t.tenant, service=t.service, held=t.held, tokens=t.tokens)


def _standing_from_proto(f: pb.LedgerFigures) -> TenantStanding | None:
    if not f.HasField("tenant"):
        return None
    t = f.tenant
    service = t.service if t.HasField("service") else None
    return TenantStanding(t.tenant, service, t.held, t.tokens if t.HasField("tokens") else None)


def _figures_from_proto(m: pb.ReserveResponse | pb.ReleaseResponse) -> LedgerFigures | None:
    if not m.HasField("after"):
        return None
    f = m.after
    return LedgerFigures(
        f.headroom_tokens,
        f.reserved_tokens,
        f.reservations,
        f.freed_tokens_total,
        tuple(ExpectedRelease(r.after_ms / 1000, r.tokens) for r in f.releases),
        f.seq,
        _standing_from_proto(f),
    )


def reserve_from_proto(m: pb.ReserveResponse) -> ReserveOutcome:
    return ReserveOutcome(
        granted=m.granted,
        reason=m.reason,
        headroom_tokens=m.headroom_tokens,
        reserved_tokens=m.reserved_tokens,
        lease_s=m.lease_s,
        charged_tokens=m.charged_tokens,
        cached_tokens=m.cached_tokens,
        reservations=m.reservations,
        after=_figures_from_proto(m),
    )


def release_to_proto(o: ReleaseOutcome) -> pb.ReleaseResponse:
    return pb.ReleaseResponse(
        released=o.released,
        headroom_tokens=o.headroom_tokens,
        reserved_tokens=o.reserved_tokens,
        settled_output_tokens=o.settled_output_tokens,
        after=_figures_to_proto(o.after),
    )


def release_from_proto(m: pb.ReleaseResponse) -> ReleaseOutcome:
    return ReleaseOutcome(
        m.released, m.headroom_tokens, m.reserved_tokens, m.settled_output_tokens, _figures_from_proto(m)
    )


def headroom_from_proto(m: pb.NodeHeadroom, previous: PrefixSummary = NO_PREFIXES) -> NodeHeadroom:
    try:
        source = CapacitySource(m.capacity_source)
    except ValueError:
        source = CapacitySource.NONE
    try:
        usage = UsageSource(m.usage_source)
    except ValueError:
        usage = UsageSource.NONE
    try:
        role = NodeRole(m.role or NodeRole.LONG)
    except ValueError:
        role = NodeRole.LONG  # a newer agent's role this gate does not know: lends nothing it can use
    return NodeHeadroom(
        node=m.node,
        endpoint=m.endpoint,
        seq=m.seq,
        sample_time_unix_ns=m.sample_time_unix_ns,
        capacity_tokens=m.capacity_tokens,
        safety_ratio=m.safety_ratio,
        used_tokens=m.used_tokens if m.HasField("used_tokens") else None,
        reserved_tokens=m.reserved_tokens,
        reservations=m.reservations,
        headroom_tokens=m.headroom_tokens,
        healthy=m.healthy,
        reason=m.reason,
        capacity_source=source,
        kv_usage=m.kv_usage if m.HasField("kv_usage") else None,
        running=m.running if m.HasField("running") else None,
        waiting=m.waiting if m.HasField("waiting") else None,
        preemptions_total=m.preemptions_total if m.HasField("preemptions_total") else None,
        gpus=tuple(_gpu_from_proto(g) for g in m.gpus),
        period_ms=m.period_ms,
        engine_kind=m.engine_kind,
        engines=tuple(m.engines),
        capacity_rule=m.capacity_rule,
        usage_source=usage,
        unreserved_tokens=m.unreserved_tokens if m.HasField("unreserved_tokens") else None,
        engine_sample_age_ms=m.engine_sample_age_ms if m.HasField("engine_sample_age_ms") else None,
        prefix=prefix_from_proto(m.prefix, previous) if m.HasField("prefix") else NO_PREFIXES,
        decode_tokens_per_s=m.decode_tokens_per_s if m.HasField("decode_tokens_per_s") else None,
        releases=tuple(ExpectedRelease(r.after_ms / 1000, r.tokens) for r in m.releases),
        freed_tokens_total=m.freed_tokens_total,
        prefix_source=m.prefix_source,
        heartbeat_ms=m.heartbeat_ms,
        role=role,
        lend_tokens=m.lend_tokens if m.HasField("lend_tokens") else None,
        lend_max_prompt_tokens=m.lend_max_prompt_tokens,
        head=_head_from_proto(m.head) if m.HasField("head") else None,
        max_model_len=m.max_model_len,
        prefill_backlog_tokens=m.prefill_backlog_tokens,
        prefill_tokens_per_s=m.prefill_tokens_per_s,
        tenant_service=dict(m.tenant_service),
        tenant_held=dict(m.tenant_held),
        tenant_tokens=dict(m.tenant_tokens),
        publishes_tenant_tokens=m.publishes_tenant_tokens,
        tenant_lift=dict(m.tenant_lift),
    )


def _gpu_to_proto(g: GpuReading) -> pb.GpuInfo:
    return pb.GpuInfo(
        uuid=g.uuid,
        index=g.index,
        name=g.name,
        total_bytes=g.total_bytes,
        used_bytes=g.used_bytes,
        free_bytes=g.free_bytes,
        reserved_bytes=g.reserved_bytes,
        healthy=g.healthy,
        reason=g.reason,
    )


def _gpu_from_proto(m: pb.GpuInfo) -> GpuReading:
    return GpuReading(
        uuid=m.uuid,
        index=m.index,
        name=m.name,
        total_bytes=m.total_bytes if m.HasField("total_bytes") else None,
        used_bytes=m.used_bytes if m.HasField("used_bytes") else None,
        free_bytes=m.free_bytes if m.HasField("free_bytes") else None,
        reserved_bytes=m.reserved_bytes if m.HasField("reserved_bytes") else None,
        healthy=m.healthy,
        reason=m.reason,
    )
