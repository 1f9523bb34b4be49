"""The demo's soft-pool figures: how many long requests the interactive nodes served, whether the
engines name themselves in their answers (the simulator) or not (real vLLM)."""

from __future__ import annotations

from typing import Literal

from kvgate.demo.load import Result
from kvgate.demo.scenario import Planned
from kvgate.demo.soft_pools import soft_pool_figures

POOLS = {"interactive-0": "interactive", "long-0": "long"}


def agent_page(granted: int) -> str:
    return (
        "# TYPE kvgate_agent_reservations_total counter\n"
        f'kvgate_agent_reservations_total{{event="granted",reason="granted"}} {granted}.0\n'
        'kvgate_agent_reservations_total{event="released",reason=""} 7.0\n'
        'kvgate_agent_reservations_total{event="refused",reason="lend_limit"} 5.0\n'
    )


def result(kind: Literal["short", "long"], node: str | None) -> Result:
    planned = Planned(at_s=0.0, kind=kind, prompt_tokens=8_000, max_tokens=300, index=0)
    return Result(planned=planned, sent_s=0.0, outcome="ok", status=200, node=node)


PAGES = {"interactive-0": agent_page(2), "long-0": agent_page(4)}


def test_lent_requests_are_counted_by_the_node_each_answer_names() -> None:
    results = [result("long", "interactive-0"), result("long", "long-0"), result("short", "interactive-0")]
    assert soft_pool_figures(PAGES, results, POOLS)["long_served_by_interactive"] == 1


def test_lent_requests_are_the_interactive_agents_grants_where_engines_name_no_node() -> None:
    results = [result("long", None), result("long", None), result("short", None)]
    assert soft_pool_figures(PAGES, results, POOLS)["long_served_by_interactive"] == 2
