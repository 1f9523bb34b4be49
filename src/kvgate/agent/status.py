"""What an agent sees, for operators and tests: `kvgate status` renders one streamed NodeHeadroom.

Pure: the command (registered by kvgate.agent.cli) fetches the message over the agent's gRPC
Subscribe stream and hands it here with its age. Unknown figures print as "unknown" (null in JSON),
never as zero.
"""

from __future__ import annotations

from typing import Any

from kvgate.headroom.snapshot import NodeHeadroom


def status_json(h: NodeHeadroom, agent: str, age_s: float) -> dict[str, Any]:
    return {
        "agent": agent,
        "node": h.node,
        "endpoint": h.endpoint,
        "healthy": h.healthy,
        "reason": h.reason,
        "age_s": round(age_s, 3),
        "engine": {
            "kind": h.engine_kind or None,
            "engines": list(h.engines),
            "sample_age_ms": h.engine_sample_age_ms,
        },
        "capacity": {
            "tokens": h.capacity_tokens,
            "source": h.capacity_source.value,
            "rule": h.capacity_rule,
            "safety_ratio": h.safety_ratio,
            "admissible_tokens": h.admissible_tokens,
        },
        "used": {
            "tokens": h.used_tokens,
            "source": h.usage_source.value,
            "unreserved_tokens": h.unreserved_tokens,
            "kv_usage": h.kv_usage,
        },
        "reserved": {"tokens": h.reserved_tokens, "reservations": h.reservations},
        "headroom_tokens": h.headroom_tokens,
        "max_model_len": h.max_model_len or None,
        "requests": {"running": h.running, "waiting": h.waiting, "preemptions_total": h.preemptions_total},
        "prefill": {"backlog_tokens": h.prefill_backlog_tokens, "tokens_per_s": h.prefill_tokens_per_s},
        "prefix": {
            "source": h.prefix_source or None,
            "indexed_tokens": h.prefix.indexed_tokens,
            "saved_tokens": h.prefix.saved_tokens,
        },
        "forecast": {
            "decode_tokens_per_s": h.decode_tokens_per_s,
            "releases": [{"after_s": r.after_s, "tokens": r.tokens} for r in h.releases],
            "freed_tokens_total": h.freed_tokens_total,
        },
        "gpus": [
            {"uuid": g.uuid, "name": g.name, "healthy": g.healthy, "used_bytes": g.used_bytes} for g in h.gpus
        ],
        "period_ms": h.period_ms,
        "seq": h.seq,
        "role": {
            "role": h.role.value,
            "lend_tokens": h.lend_tokens,
            "lend_max_prompt_tokens": h.lend_max_prompt_tokens,
        },
    }


def status_text(h: NodeHeadroom, agent: str, age_s: float) -> str:
    health = "healthy" if h.healthy else "UNHEALTHY"
    engine = "none (no --engine-metrics)"
    if h.engine_kind:
        engine = h.engine_kind + (f": {'; '.join(h.engines)}" if h.engines else "")
    rule = f", {h.capacity_rule}" if h.capacity_rule else ""
    used = "unknown"
    if h.used_tokens is not None:
        used = f"{h.used_tokens:,} tokens, from {h.usage_source.value}"
        if h.unreserved_tokens is not None:
            used += f" ({h.unreserved_tokens:,} for unreserved requests)"
        if h.kv_usage is not None:
            used += f", {h.kv_usage:.1%} of capacity"
    scraped = "" if h.engine_sample_age_ms is None else f"; engine scraped {h.engine_sample_age_ms} ms before"
    lines = [
        f"agent     {agent}  node {h.node}  endpoint {h.endpoint}",
        f"health    {health}" + (f": {h.reason}" if h.reason else ""),
        f"engine    {engine}",
        f"capacity  {h.capacity_tokens:,} tokens from {h.capacity_source.value}{rule}; "
        f"x {h.safety_ratio:g} safety = {h.admissible_tokens:,} admissible",
        f"used      {used}",
        f"reserved  {h.reserved_tokens:,} tokens in {h.reservations} reservation{_plural(h.reservations)}",
        f"headroom  {h.headroom_tokens:,} tokens",
        f"longest   {f'{h.max_model_len:,} tokens a request' if h.max_model_len else 'unknown'} "
        "(the engine's max_model_len, from its /v1/models)",
        f"requests  {_count(h.running)} running, {_count(h.waiting)} waiting, "
        f"{_count(h.preemptions_total)} preempted since start",
        f"prefill   {h.prefill_backlog_tokens:,} granted prompt tokens still to prefill at "
        f"{h.prefill_tokens_per_s:,.0f} tokens/s",
        f"age       {age_s:.3f} s since the agent's sample{scraped}",
    ]
    if h.prefix_source:
        lines.append(
            f"prefixes  {h.prefix.indexed_tokens:,} tokens indexed, {h.prefix.saved_tokens:,} shared; "
            f"{h.prefix_source}"
        )
    if h.decode_tokens_per_s is not None:
        ends = ""
        if h.releases:
            ends = f"; {len(h.releases)} reservations expected to end in {h.releases[0].after_s:.1f}"
            ends += f"-{h.releases[-1].after_s:.1f} s" if len(h.releases) > 1 else " s"
        lines.append(f"decode    {h.decode_tokens_per_s:.1f} tokens/s per running request{ends}")
    if h.lend_tokens is not None:
        lines.append(
            f"role      {h.role.value}: lends long requests {h.lend_tokens:,} tokens now, an uncached prompt "
            f"of at most {h.lend_max_prompt_tokens:,}"
        )
    else:
        lines.append(f"role      {h.role.value}")
    if h.gpus:
        sick = [g.uuid for g in h.gpus if not g.healthy]
        lines.append(
            f"gpus      {len(h.gpus)}" + (f", unhealthy: {', '.join(sick)}" if sick else ", all healthy")
        )
    return "\n".join(lines)


def _plural(count: int) -> str:
    return "" if count == 1 else "s"


def _count(value: int | None) -> str:
    return "unknown" if value is None else str(value)


def tls_hint(agent_speaks_tls: bool | None, with_ca: bool, with_cert: bool) -> str | None:
    """What to change when the agent could not be read for a TLS mismatch, from whether its port speaks
    TLS (None: unknown) and the client's flags (--tls-ca, --tls-cert); None when TLS is not the cause."""
    if agent_speaks_tls is None:
        return None
    if agent_speaks_tls and not with_ca:
        return (
            "the agent speaks TLS (it was started with --tls-cert): pass --tls-ca, the CA that signed its "
            "certificate, and for an agent started with --tls-client-ca also --tls-cert and --tls-key, a "
            "client certificate from that CA (docs/tls.md)"
        )
    if agent_speaks_tls and not with_cert:
        return (
            "an agent started with --tls-client-ca takes only clients with a certificate from that CA: "
            "pass --tls-cert and --tls-key (docs/tls.md)"
        )
    if not agent_speaks_tls and with_ca:
        return "the agent does not speak TLS (it was started without --tls-cert): leave out the --tls-* flags"
    return None
