"""Placement by prefill backlog: a long request goes where the fewest granted prompt tokens wait for
their prefill, by the agent's count, the gate's view of it between messages, and across replicas."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from test_prefix_placement import DOC, admit, asking, holding, placed_on, two_replicas
from test_soft_pools import Clock, reading
from test_water import node

from kvgate._proto.headroom.v1 import headroom_pb2 as pb
from kvgate.agent.lending import LendLimits
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.prefill_backlog import PrefillBacklog
from kvgate.headroom.snapshot import NodeView
from kvgate.headroom.wire import HeadroomEncoder, headroom_from_proto
from kvgate.policy.nodes import Placement, choose_nodes


def test_the_backlog_drains_at_the_prefill_rate_and_a_grant_queues_behind_what_is_left() -> None:
    backlog = PrefillBacklog(10_000)
    assert backlog.tokens(5.0) == 0
    backlog.granted(10.0, 8_000)
    assert backlog.tokens(10.5) == 3_000
    backlog.granted(10.5, 4_000)
    assert backlog.tokens(10.5) == 7_000
    assert backlog.tokens(11.3) == 0
    with pytest.raises(ValueError, match="prefill rate"):
        PrefillBacklog(0)


def test_the_backlog_counts_the_prompts_still_being_prefilled_first_come_first_served() -> None:
    backlog = PrefillBacklog(1_000)
    assert backlog.prompts(0.0) == 0
    backlog.granted(0.0, 8_000)
    backlog.granted(0.0, 8_000)
    backlog.granted(0.0, 0)  # all of it cached: nothing to prefill
    assert backlog.prompts(0.0) == 2
    assert backlog.prompts(7.9) == 2
    assert backlog.prompts(8.0) == 1, "the first is prefilled once 8,000 have drained"
    backlog.follow(8.0, 2_000)
    assert backlog.prompts(11.9) == 1
    assert backlog.prompts(12.0) == 0, "the second's 8,000 at the new rate"
    backlog.granted(20.0, 500)
    assert backlog.prompts(20.0) == 1


def backlogged(view: NodeView, tokens: int, rate: float = 100_000.0, age_s: float = 0.0) -> NodeView:
    assert view.headroom is not None
    headroom = dataclasses.replace(view.headroom, prefill_backlog_tokens=tokens, prefill_tokens_per_s=rate)
    return dataclasses.replace(view, headroom=headroom, age_s=age_s)


def order(nodes: list[NodeView], tokens: int = 10_000) -> list[str]:
    return [n.agent for n in choose_nodes(nodes, tokens, "probe").candidates]


def test_the_node_with_least_prompt_to_prefill_goes_first_and_headroom_breaks_ties() -> None:
    a, b, c = node("a", 30_000), node("b", 20_000), node("c", 25_000)
    assert order([a, b, c]) == ["a:9100", "c:9100", "b:9100"], "at rest: most headroom first"
    busy = [backlogged(a, 40_000), backlogged(b, 0), backlogged(c, 8_000)]
    assert order(busy) == ["b:9100", "c:9100", "a:9100"]
    # The view drains a message's backlog by its age: 40k at 100k/s is gone after 0.4 s.
    aged = [backlogged(a, 40_000, age_s=0.5), backlogged(b, 0), backlogged(c, 8_000)]
    assert aged[0].prefill_backlog_tokens == 0
    assert order(aged) == ["a:9100", "b:9100", "c:9100"]
    # Backlog never makes a node fit that does not.
    assert order([backlogged(a, 50_000), backlogged(b, 0)], tokens=25_000) == ["a:9100"]


def test_with_affinity_a_holder_goes_first_unless_it_has_twice_as_much_prompt_queued_as_it_holds() -> None:
    # b holds 25k of the 26k prompt (DOC); a and c hold nothing.
    a, b, c = node("a", 30_000), holding(node("b", 30_000), DOC), node("c", 28_000)
    choice = choose_nodes(
        [backlogged(a, 0), backlogged(b, 40_000), backlogged(c, 0)], 26_000, "probe", asking(1)
    )
    assert choice.candidates[0].agent == "b:9100", "40k queued, 25k of it held (counted twice): b first"
    assert choice.placement is Placement.AFFINITY
    busy = choose_nodes(
        [backlogged(a, 0), backlogged(b, 60_000), backlogged(c, 4_000)], 26_000, "probe", asking(1)
    )
    assert [n.agent for n in busy.candidates] == ["a:9100", "c:9100", "b:9100"], (
        "b: 60k queued - 2 x 25k held"
    )
    assert busy.placement is Placement.BOUNDED
    assert busy.cached_tokens == (0, 0, 25_000)


def test_the_agent_counts_the_uncached_prompt_of_each_grant_and_publishes_it() -> None:
    clock = Clock()
    settings = NodeSettings("n", "n.engine:8000", lending=LendLimits(prefill_tokens_per_s=20_000))
    state = NodeState(settings, clock, uses_engine=True, uses_nvml=False)
    state.observe_engine(reading(0))
    assert state.reserve("a", 12_000, 300.0, "gate", output_tokens=2_000).granted
    first = state.snapshot(0)
    assert (first.prefill_backlog_tokens, first.prefill_tokens_per_s) == (10_000, 20_000)
    clock.now += 0.25
    assert state.reserve("b", 7_000, 300.0, "gate", output_tokens=1_000).granted
    assert state.snapshot(0).prefill_backlog_tokens == 5_000 + 6_000
    decoded = headroom_from_proto(pb.NodeHeadroom.FromString(HeadroomEncoder().encode(state.snapshot(0))))
    assert (decoded.prefill_backlog_tokens, decoded.prefill_tokens_per_s) == (11_000, 20_000)


def run(scenario: Any) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_gate_counts_its_own_grant_at_once_and_the_other_replica_from_the_stream() -> None:
    async def scenario() -> None:
        # A slow prefill rate (1k tokens a second) keeps what is granted queued for the whole test.
        async with two_replicas(lending=LendLimits(prefill_tokens_per_s=1_000)) as (addresses, views, gates):
            first = await admit(gates[0], "r1", None, tokens=9_000)
            assert placed_on(first) == addresses[0], "cold and at rest: most headroom"
            # a has 91k left and b 90k, but a still prefills r1, by this gate's own count.
            second = await admit(gates[0], "r2", None, tokens=1_000)
            assert placed_on(second) == addresses[1]
            # The other replica learns both backlogs from the agents' streams.
            async with asyncio.timeout(3):
                while not all(n.prefill_backlog_tokens > 0 for n in views[1].snapshot()):
                    await views[1].wait_update(0.05)
            third = await admit(gates[1], "r3", None, tokens=1_000)
            assert placed_on(third) == addresses[1]

    run(scenario)
