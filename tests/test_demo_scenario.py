"""Demo scenarios: strict YAML, built-in files, and a deterministic request plan."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvgate.agent.lending import Lending, LendLimits
from kvgate.demo.capacity import node_capacity_tokens_per_s
from kvgate.demo.cli import DEMO_ENVOY
from kvgate.demo.scenario import (
    DEMO_ENVOY_MESSAGE_TIMEOUT_S,
    builtin_scenario,
    lender_agent_flags,
    lender_engine_flags,
    load_scenario,
    long_shape,
    parse_scenario,
    plan,
)
from kvgate.errors import ConfigError
from kvgate.headroom.snapshot import admissible


@pytest.mark.parametrize("name", ["burst", "smoke", "fairness", "fairness-vllm"])
def test_builtin_scenarios_load(name: str) -> None:
    scenario = load_scenario(builtin_scenario(name))
    assert scenario.name == name


def test_burst_scenario_is_the_field_report_case() -> None:
    scenario = load_scenario(builtin_scenario("burst"))
    assert (scenario.short.prompt_tokens_min, scenario.short.prompt_tokens_max) == (500, 1000)
    assert scenario.bursts.prompt_tokens == 32000
    assert (scenario.bursts.size_min, scenario.bursts.size_max) == (3, 5)
    assert scenario.bursts.spread_s <= 1.0
    per_long = scenario.bursts.prompt_tokens + scenario.bursts.max_tokens
    # Two long sequences fit a node, three do not: a burst landing on one node overflows it.
    assert 2 * per_long <= scenario.node.kv_capacity_tokens < 3 * per_long


def test_unknown_keys_and_wrong_types_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"bursts\.sise_max: unknown key"):
        parse_scenario("bursts: {sise_max: 4}")
    with pytest.raises(ConfigError, match=r"short\.rate_per_s: expected a number"):
        parse_scenario("short: {rate_per_s: fast}")
    with pytest.raises(ConfigError, match=r"node\.on_exhaustion: must be one of crash, preempt"):
        parse_scenario("node: {on_exhaustion: explode}")


def test_requests_that_cannot_fit_their_pool_are_rejected() -> None:
    with pytest.raises(ConfigError, match="interactive_max_model_len"):
        parse_scenario("short: {prompt_tokens_max: 4000, max_tokens: 200}")
    with pytest.raises(ConfigError, match=r"node\.max_model_len"):
        parse_scenario("bursts: {prompt_tokens: 41000}")


def test_a_wait_past_the_demo_envoys_message_timeout_is_refused() -> None:
    too_long = r"admission_max_wait_s \(10\) is too long .* 5 s ext_proc message_timeout"
    with pytest.raises(ConfigError, match=too_long):
        parse_scenario("gate: {admission_max_wait_s: 10}")
    assert parse_scenario("gate: {admission_max_wait_s: 9}").gate.admission_max_wait_s == 9


def test_the_demo_envoys_message_timeout_is_the_one_scenarios_are_checked_against() -> None:
    envoy = (Path(__file__).parents[1] / "envoy" / DEMO_ENVOY).read_text()
    timeouts = re.findall(r"^\s*message_timeout: (\d+)s$", envoy, re.MULTILINE)
    assert [float(t) for t in timeouts] == [DEMO_ENVOY_MESSAGE_TIMEOUT_S]


def test_the_real_vllm_fairness_scenario_contends_its_one_long_engine() -> None:
    scenario = load_scenario(builtin_scenario("fairness-vllm"))
    assert scenario.engine is not None
    sizes = [t.prompt_tokens + t.declared_tokens for t in scenario.tenants]
    # Every tenant's request is long, and two of the flood's fit the long engine's pool, three do not.
    assert min(sizes) > scenario.node.interactive_max_model_len
    assert 2 * max(sizes) <= scenario.node.kv_capacity_tokens < 3 * max(sizes)
    # A random-weight model writes to its budget: declared and generated are the same.
    assert all(t.over_declare == 1 for t in scenario.tenants)


def test_the_real_vllm_lender_prefills_one_lent_prompt_at_a_time_beside_chat() -> None:
    """Its engine's step of 2,048 tokens, less the largest chat prompt (700), holds one chunk of 1,024 of
    a lent prompt: a second lent prompt's chunk would leave chat none."""
    scenario = load_scenario(builtin_scenario("real-vllm"))
    engine = lender_engine_flags(scenario, "interactive")
    assert engine[engine.index("--long-prefill-token-threshold") + 1] == "1024"
    assert engine[engine.index("--max-num-batched-tokens") + 1] == "2048"
    agent = lender_agent_flags(scenario)
    assert agent[agent.index("--lend-max-prefills") + 1] == "1"
    assert lender_engine_flags(scenario, "long") == []
    burst = load_scenario(builtin_scenario("burst"))
    assert lender_agent_flags(burst) == [], "long prefills not chunked: the prefill budget alone"


def test_the_real_vllm_lender_lends_the_burst_its_third_request_beside_chat() -> None:
    """The long engine holds three of the burst's six requests: the lender takes the other three, one
    after another, so the sixth does not wait for any of the first five to end. With the agent's
    default chat reserve floor (a quarter of the node) it lent two."""
    scenario = load_scenario(builtin_scenario("real-vllm"))
    agent = lender_agent_flags(scenario)
    floor = float(agent[agent.index("--chat-reserve-min-share") + 1])
    capacity = scenario.node.kv_capacity_tokens - 128  # vLLM keeps one block of 128 as its null block
    request = scenario.bursts.prompt_tokens + scenario.bursts.max_tokens
    assert 3 * request <= admissible(capacity, 0.9) < 4 * request, "the long engine holds three"

    def lent_after_two(limits: LendLimits) -> int:
        lending = Lending(limits)
        # Chat's use as the no-burst phase shows it: one request of the largest size at a time.
        for second in range(30):
            lending.observe_chat(second, scenario.short.prompt_tokens_max + scenario.short.max_tokens)
        return lending.offer(admissible(capacity, 0.9), capacity, 2 * request, 0).tokens

    assert lent_after_two(LendLimits(min_share=floor, max_prefills=1)) >= request
    assert lent_after_two(LendLimits(max_prefills=1)) < request


def test_plan_is_deterministic_and_the_no_burst_phase_is_the_same_short_traffic() -> None:
    scenario = parse_scenario("seed: 5\nshort: {rate_per_s: 10}\nbursts: {first_at_s: 1, every_s: 4}")
    with_bursts = plan(scenario, 10.0, with_bursts=True)
    assert with_bursts == plan(scenario, 10.0, with_bursts=True)
    shorts = [(p.at_s, p.prompt_tokens) for p in with_bursts if p.kind == "short"]
    assert shorts == [(p.at_s, p.prompt_tokens) for p in plan(scenario, 10.0, with_bursts=False)]
    assert 60 < len(shorts) < 140
    assert all(500 <= tokens <= 1000 for _, tokens in shorts)
    longs = [p for p in with_bursts if p.kind == "long"]
    burst_starts = {int(p.at_s) for p in longs}
    assert burst_starts == {1, 5, 9}
    assert all(3 <= sum(1 for p in longs if int(p.at_s) == s) <= 5 for s in burst_starts)
    assert [p.at_s for p in with_bursts] == sorted(p.at_s for p in with_bursts)
    assert [p.index for p in with_bursts] == list(range(len(with_bursts)))


def test_the_queue_and_separate_async_nodes_are_alternatives() -> None:
    with pytest.raises(ConfigError, match=r"layout\.queue and layout\.async_nodes are alternatives"):
        parse_scenario("layout: {async_nodes: 1}")
    assert parse_scenario("layout: {async_nodes: 1, queue: false}").layout.async_nodes == 1
    no_queue = parse_scenario("runs: [kvgate, kvgate_no_queue]")
    assert no_queue.runs == ("kvgate", "kvgate_no_queue")


def test_the_capacity_planning_figures_of_operations_md_follow_from_its_scenario() -> None:
    """docs/operations.md quotes the figures of its capacity.yaml that do not depend on a run: the
    planned traffic and the long pool's capacity, computed here as the demo computes them."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    block = re.search(r"```yaml\n(# Will two long-context.*?)```", doc, re.DOTALL)
    assert block is not None
    scenario = parse_scenario(block[1])
    requests = plan(scenario, scenario.timing.burst_phase_s, with_bursts=True)
    quoted = re.search(r"`requests_total` and `long_requests`: (\d+) and (\d+) in both runs", doc)
    assert quoted is not None
    assert (len(requests), sum(r.kind == "long" for r in requests)) == (int(quoted[1]), int(quoted[2]))
    per_node = node_capacity_tokens_per_s(scenario.node, *long_shape(scenario))
    quoted = re.search(r"([\d,]+) tokens/s with two nodes, ([\d,]+) with three", doc)
    assert quoted is not None
    assert (f"{2 * per_node:,.0f}", f"{3 * per_node:,.0f}") == (quoted[1], quoted[2])
    assert scenario.layout.long_nodes == 2 and scenario.layout.queue
