"""Prefix-aware placement: repeats of a document go to the node that holds it, within a bounded load,
by the pure rule and through admission, and two gate replicas agree through the agents' streams."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from test_water import node

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.agent.sources.fake_engine import FakeEngineMetrics
from kvgate.agent.sources.scrape import EngineScraper
from kvgate.config import AdmissionConfig, ModelConfig
from kvgate.config.headroom import HeadroomSettings
from kvgate.gate.admission import Admission, Admitted
from kvgate.headroom.snapshot import NodeView, PrefixChain, PrefixSummary
from kvgate.headroom.view import HeadroomView
from kvgate.policy import Reason, Route
from kvgate.policy.nodes import Affinity, Placement, choose_nodes

T = TypeVar("T")
MODEL = ModelConfig()
DOC = tuple(range(1, 101))  # a document of 100 blocks
BOUND = 1.5


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), 20))


def asking(n: int, document: tuple[int, ...] = DOC) -> Affinity:
    """Question `n` on `document`: its blocks, then one of its own (250 tokens each)."""
    return Affinity(PrefixChain((*document, 10_000 + n), 250), BOUND)


def holding(view: NodeView, blocks: tuple[int, ...], reservations: int = 0) -> NodeView:
    assert view.headroom is not None
    summary = PrefixSummary(frozenset(b for i, b in enumerate(blocks) if i % 4 == 3))
    headroom = dataclasses.replace(view.headroom, prefix=summary, reservations=reservations)
    return dataclasses.replace(view, headroom=headroom)


def test_the_node_holding_the_prefix_goes_first_even_with_less_headroom() -> None:
    nodes = [node("a", 30_000), holding(node("b", 10_000), DOC), node("c", 20_000)]
    choice = choose_nodes(nodes, 26_000, "probe", asking(1))
    # b holds 25k of the 26k: it asks only for the rest, which fits; then the rest by headroom.
    assert [n.agent for n in choice.candidates] == ["b:9100", "a:9100"]
    assert choice.cached_tokens == (25_000, 0)
    assert choice.placement is Placement.AFFINITY
    assert [n.agent for n in choose_nodes(nodes, 26_000, "probe").candidates] == ["a:9100"]


def test_the_node_holding_more_of_the_prompt_goes_first() -> None:
    nodes = [holding(node("a", 30_000), DOC[:40]), holding(node("b", 30_000), DOC)]
    choice = choose_nodes(nodes, 26_000, "probe", asking(1))
    assert [n.agent for n in choice.candidates] == ["b:9100", "a:9100"]
    assert choice.cached_tokens == (25_000, 10_000)


def loaded(view: NodeView, reservations: int) -> NodeView:
    assert view.headroom is not None
    return dataclasses.replace(view, headroom=dataclasses.replace(view.headroom, reservations=reservations))


def test_a_node_past_the_load_bound_is_tried_after_the_others() -> None:
    # Mean load (1 + 7 + 1) / 3 = 3: the bound is 1.5 x 3 + 1 = 5.5 requests in flight.
    nodes = [loaded(node("a", 40_000), 1), holding(node("b", 30_000), DOC, 7), loaded(node("c", 35_000), 1)]
    choice = choose_nodes(nodes, 26_000, "probe", asking(1))
    assert [n.agent for n in choice.candidates] == ["a:9100", "c:9100", "b:9100"]
    assert choice.placement is Placement.BOUNDED
    within = [loaded(node("a", 40_000), 1), holding(node("b", 30_000), DOC, 4), loaded(node("c", 35_000), 1)]
    assert choose_nodes(within, 26_000, "probe", asking(1)).candidates[0].agent == "b:9100"


def test_no_node_holding_the_prefix_places_by_headroom_as_without_affinity() -> None:
    nodes = [node("a", 30_000), node("b", 40_000)]
    choice = choose_nodes(nodes, 26_000, "probe", asking(1))
    assert [n.agent for n in choice.candidates] == ["b:9100", "a:9100"]
    assert choice.placement is Placement.COLD


def setup(*nodes: tuple[str, int]) -> tuple[FakeHeadroom, Admission]:
    clock = ManualClock()
    source = FakeHeadroom(clock)
    for name, capacity in nodes:
        source.add_node(name, capacity)
    return source, Admission(AdmissionConfig(max_wait_s=0.0), source, clock=clock)


async def admit(
    admission: Admission, request_id: str, affinity: Affinity | None, tokens: int = 26_000
) -> Admitted:
    return await admission.admit(
        Route("long", Reason.LONG, tokens), MODEL, None, request_id, affinity=affinity
    )


def placed_on(admitted: Admitted) -> str:
    assert admitted.ticket is not None, admitted.decision
    return admitted.ticket.agent


def test_repeats_go_where_the_document_is_and_share_it() -> None:
    async def scenario() -> None:
        source, admission = setup(("a", 60_000), ("b", 80_000))
        first = await admit(admission, "q1", asking(1))
        assert placed_on(first) == "b", "cold: most headroom"
        second = await admit(admission, "q2", asking(2))
        assert placed_on(second) == "b", "b holds the document, though a now has more headroom"
        assert second.ticket is not None and second.ticket.charged_tokens == 1_000
        assert second.ticket.cached_tokens == 25_000
        assert source.reserved_tokens("b") == 27_000
        without = await admit(admission, "q3", None)
        assert placed_on(without) == "a", "without affinity: most headroom"

    run(scenario)


def test_an_evicted_prefix_is_placed_cold_and_charged_in_full() -> None:
    async def scenario() -> None:
        source, admission = setup(("a", 60_000), ("b", 80_000))
        first = await admit(admission, "q1", asking(1))
        assert first.ticket is not None
        await admission.release(first.ticket)
        source.evict_prefixes("b")
        source.update("a", used_tokens=0)
        again = await admit(admission, "q2", asking(2))
        assert again.ticket is not None
        assert again.ticket.cached_tokens == 0 and again.ticket.charged_tokens == 26_000

    run(scenario)


def test_the_load_bound_holds_under_a_flood_of_one_document() -> None:
    async def scenario() -> None:
        source, admission = setup(("a", 400_000), ("b", 400_000), ("c", 400_000))
        per_node: dict[str, int] = {"a": 0, "b": 0, "c": 0}
        for i in range(60):
            admitted = await admit(admission, f"q{i}", asking(i))
            mean_before = sum(per_node.values()) / 3
            where = placed_on(admitted)
            assert per_node[where] <= BOUND * mean_before + 1, f"request {i} piled onto {where}: {per_node}"
            per_node[where] += 1
        assert max(per_node.values()) <= BOUND * 20 + 1
        assert sum(1 for count in per_node.values() if count) >= 2, "the document spread"
        # Each node holds the document once, shared by every question it runs.
        for name, count in per_node.items():
            assert source.reserved_tokens(name) == (25_000 + count * 1_000 if count else 0)

    run(scenario)


def agent_settings(name: str, **settings: Any) -> NodeSettings:
    return NodeSettings(name, f"{name}.engine:8000", period_s=0.05, safety_ratio=1.0, **settings)


@contextlib.asynccontextmanager
async def two_replicas(
    **settings: Any,
) -> AsyncIterator[tuple[list[str], list[HeadroomView], list[Admission]]]:
    """Two vLLM engines (prefix caching on) of 100k and 90k tokens, each behind its agent (`settings`
    for both), and two gate replicas following both: the agents' addresses, the views and admissions,
    once every node is fresh in both views."""
    engines = [FakeEngineMetrics(num_gpu_blocks=6250), FakeEngineMetrics(num_gpu_blocks=5625)]
    agents = [
        Agent(agent_settings(name, **settings), EngineScraper(await engine.start(), 0.025))
        for name, engine in zip("ab", engines, strict=True)
    ]
    addresses = [f"127.0.0.1:{await agent.start('127.0.0.1:0')}" for agent in agents]
    fast: dict[str, Any] = {"stale_after_s": 0.5, "reconnect_initial_s": 0.05, "reconnect_max_s": 0.2}
    # The agents name their engines a.engine and b.engine: off their own host, so allowed by name.
    allowed = ("a.engine", "b.engine")
    views = [
        HeadroomView(
            HeadroomSettings(agents=tuple(addresses), allowed_endpoints=allowed, **fast),
            subscriber=f"gate-{i}",
        )
        for i in range(2)
    ]
    gates = [Admission(AdmissionConfig(max_wait_s=0.5), view) for view in views]
    for view in views:
        await view.start()
    try:
        for view in views:
            async with asyncio.timeout(3):
                while not all(n.fresh for n in view.snapshot()):
                    await view.wait_update(0.05)
        yield addresses, views, gates
    finally:
        for view in views:
            await view.stop()
        for agent in agents:
            await agent.stop(grace_s=0)
        for engine in engines:
            await engine.stop()


def test_two_gate_replicas_place_repeats_on_the_same_node() -> None:
    async def scenario() -> None:
        async with two_replicas() as (addresses, views, gates):
            first = await admit(gates[0], "q1", asking(1))
            home = placed_on(first)
            assert home == addresses[0], "cold: most headroom"
            # The other replica learns it from the agent's stream within a period or two.
            async with asyncio.timeout(3):
                while not any(n.headroom and n.headroom.prefix.blocks for n in views[1].snapshot()):
                    await views[1].wait_update(0.05)
            second = await admit(gates[1], "q2", asking(2))
            assert placed_on(second) == home
            assert second.ticket is not None and second.ticket.charged_tokens == 1_000
            # A different document from the second replica goes by headroom, to the other node.
            other = await admit(gates[1], "d1", asking(1, tuple(range(500, 600))))
            assert placed_on(other) == addresses[1]

    run(scenario)
