"""What a kvgate run's soft pools did (docs/operations.md, "Soft pools"): the KV token-seconds and
prefill seconds each class of traffic used, summed over the agents' nodes from their per-class
counters (kvgate.agent.class_usage), and how many long requests the interactive nodes served, lent:
by the node each answer names (the simulator's x-kvgate-sim-node), else, where the engines name no
node (real vLLM), by the reservations the interactive nodes' agents granted: only a long request
reserves there, so on the simulator the two agree (1,044 and 1,044 on the Mooncake replay,
2026-12-06).

Read from every agent's /metrics once the run's traffic is over, before its processes stop; kept in
the run's summary under `soft_pools`, and printed under the demo's table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.agent.sources.engines import promtext
from kvgate.demo.load import Result
from kvgate.demo.scrape import fetch_page

KV = "kvgate_agent_class_kv_token_seconds_total"
PREFILL = "kvgate_agent_class_prefill_seconds_total"
PREFILL_TOKENS = "kvgate_agent_class_prefill_tokens_total"
RESERVATIONS = "kvgate_agent_reservations_total"


async def agent_pages(agent_metrics: Mapping[str, str]) -> dict[str, str]:
    """Each agent's /metrics page, by its node (agents that did not answer left out)."""
    names = list(agent_metrics)
    pages = await asyncio.gather(*(fetch_page(agent_metrics[name]) for name in names))
    return {name: page for name, page in zip(names, pages, strict=True) if page is not None}


def soft_pool_figures(
    pages: Mapping[str, str], results: Sequence[Result], pools: Mapping[str, str]
) -> dict[str, Any]:
    """Per class (chat, long): KV token-seconds, prefill tokens and prefill seconds over every node
    whose agent answered, and per pool; and the long requests the interactive nodes served."""
    figures: dict[str, Any] = {}
    for family, key in ((KV, "kv_token_s"), (PREFILL_TOKENS, "prefill_tokens"), (PREFILL, "prefill_s")):
        by_pool: dict[str, dict[str, float]] = {}
        for node, page in pages.items():
            for sample in promtext.samples(page, family):
                kind = promtext.label(sample, "class") or "?"
                pool = by_pool.setdefault(pools.get(node, "?"), {})
                pool[kind] = round(pool.get(kind, 0.0) + promtext.finite(sample, family), 1)
        figures[key] = by_pool
    figures["long_served_by_interactive"] = _lent(pages, results, pools)
    return figures


def _lent(pages: Mapping[str, str], results: Sequence[Result], pools: Mapping[str, str]) -> int:
    if any(r.node for r in results):
        return sum(r.planned.kind == "long" and pools.get(r.node or "") == "interactive" for r in results)
    grants = (
        promtext.finite(sample, RESERVATIONS)
        for node, page in pages.items()
        if pools.get(node) == "interactive"
        for sample in promtext.samples(page, RESERVATIONS)
        if promtext.label(sample, "event") == "granted"
    )
    return round(sum(grants))


def soft_pool_lines(report: Mapping[str, Mapping[str, Any]]) -> str:
    """A few lines per run that has soft-pool figures, for under the demo's table ("" for none)."""
    lines = []
    for run, summary in report.items():
        figures = summary.get("soft_pools") if isinstance(summary, Mapping) else None
        if not figures:
            continue
        lent = figures["long_served_by_interactive"]
        lines.append(f"{run}: long requests served by interactive nodes: {lent}")
        for pool in sorted(figures["kv_token_s"]):
            kv = figures["kv_token_s"][pool]
            prefill = figures["prefill_s"].get(pool, {})
            lines.append(
                f"  {pool} nodes: KV token-s chat {kv.get('chat', 0):,.0f} long {kv.get('long', 0):,.0f}; "
                f"prefill s chat {prefill.get('chat', 0):,.1f} long {prefill.get('long', 0):,.1f}"
            )
    return "\n".join(lines)
