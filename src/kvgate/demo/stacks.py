"""The stacks the demo compares, started in a ProcessGroup on free 127.0.0.1 ports.

- baseline: simulated nodes in one shared pool behind a plain round-robin Envoy.
- kvgate: an interactive pool, a long-context pool with one `kvgate agent` per node, an optional
  async pool, the gate (prefix-aware placement off, its default, or on), and Envoy with the
  repository's config. With `layout.interactive_lends` (soft pools), each interactive node has the
  long nodes' engine configuration and an agent with --role interactive, which lends long requests
  what chat leaves (docs/operations.md, "Soft pools").
- a peer router over the baseline's nodes: kvgate.demo.peers.
All use the same node profile and the same number of nodes for the interactive and long traffic.
A stack names the processes of its routing layer (`routing`), whose CPU the demo reports.
The nodes are one kind of upstream (`NodeKind`): simulated nodes (`kvgate sim`, SimNodes), or, when
the scenario names an `engine`, real engines (kvgate.demo.engines); the stacks around them are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from kvgate.demo.envoy_config import baseline_bootstrap, gate_replicas, rate_limited, write_yaml
from kvgate.demo.scenario import Scenario, lender_agent_flags, lender_engine_flags
from kvgate.demo.scrape import Node, NodeMetrics, parse_sim_metrics
from kvgate.demo.tenants import fair_request_rate, identities, verifying
from kvgate.demo.tokenizer import tokenizer_file
from kvgate.harness import postgres
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import ProcessGroup, find_envoy, kvgate_command, sim_command
from kvgate.localports import free_ports


@dataclass(frozen=True, slots=True)
class Stack:
    url: str
    nodes: tuple[Node, ...]
    # Nodes whose served requests count as long-pool goodput and capacity.
    long_pool: tuple[str, ...]
    async_nodes: frozenset[str]
    gate_metrics_url: str | None = None  # the gate's /metrics (kvgate runs)
    # The ProcessGroup names of the processes that route (Envoy, the gate, agents, the queue; a peer
    # router): what the routing layer costs is their CPU.
    routing: tuple[str, ...] = ()
    # How the nodes' /metrics pages read (the simulator's, or a real engine's).
    parse_page: Callable[[str], NodeMetrics] = parse_sim_metrics
    # Each agent's /metrics, by the node it serves (kvgate runs): its per-class figures.
    agent_metrics: Mapping[str, str] = field(default_factory=dict)
    # The port each ProcessGroup name listens on (kvgate runs): where a restarted process is awaited.
    listens: Mapping[str, int] = field(default_factory=dict)
    # Each tenant's bearer token, where this stack's Envoy verifies them (kvgate.demo.tenants).
    credentials: Mapping[str, str] = field(default_factory=dict)
    # Every gate replica's /metrics, by its ProcessGroup name (kvgate runs; the first is gate_metrics_url).
    gate_replicas: Mapping[str, str] = field(default_factory=dict)


class NodeKind(Protocol):
    """What the nodes of a stack are: how they start and how their /metrics page reads."""

    def parse_page(self, text: str) -> NodeMetrics: ...

    async def start(
        self, group: ProcessGroup, scenario: Scenario, nodes: list[Node], max_model_len: dict[str, int]
    ) -> None:
        """Start one node per `nodes` entry in `group`, under the node's name, on its port."""
        ...


def _sim_command(
    scenario: Scenario, node: Node, max_model_len: int, seed: int, extra: Sequence[str] = ()
) -> list[str]:
    profile = scenario.node
    return [
        *sim_command(),
        "--listen", node.address,
        "--kv-capacity-tokens", str(profile.kv_capacity_tokens),
        "--max-model-len", str(max_model_len),
        "--prefill-tokens-per-s", str(profile.prefill_tokens_per_s),
        "--decode-tokens-per-s", str(profile.decode_tokens_per_s),
        # The async tier is a batch engine: it queues and preempts (vLLM's own behaviour), it is not
        # where the demo shows what an unguarded node does.
        "--on-exhaustion", "preempt" if node.pool == "async" else profile.on_exhaustion,
        "--restart-s", str(profile.restart_s),
        "--seed", str(seed),
        "--model-name", scenario.model,
        "--node-name", node.name,
        "--stream-interval", str(profile.stream_interval),
        *_tokenizer_flag(scenario),
        *lender_engine_flags(scenario, node.pool),
        *extra,
    ]  # fmt: skip


def _tokenizer_flag(scenario: Scenario) -> list[str]:
    if scenario.tokenizer is None:
        return []
    return ["--tokenizer", str(tokenizer_file(scenario.tokenizer))]


def _start_envoy(group: ProcessGroup, config_path: Path) -> None:
    argv = [str(find_envoy()), "-c", str(config_path), "--disable-hot-restart", "--concurrency", "1"]
    group.start("envoy", [*argv, "--log-level", "warn"])


async def wait_all(group: ProcessGroup, ports: dict[str, int]) -> None:
    """Until each named process listens on its port."""
    await asyncio.gather(*(group[name].listening(port) for name, port in ports.items()))


def start_nodes(
    group: ProcessGroup,
    scenario: Scenario,
    nodes: list[Node],
    max_model_len: dict[str, int],
    extra: Sequence[str] = (),
) -> None:
    """One simulated node per `nodes` entry (`extra`: more `kvgate sim` flags for each)."""
    for i, node in enumerate(nodes):
        argv = _sim_command(scenario, node, max_model_len[node.pool], scenario.seed + i, extra)
        group.start(node.name, argv)


class SimNodes:
    """Simulated nodes (`kvgate sim`), each ready once it listens."""

    def parse_page(self, text: str) -> NodeMetrics:
        return parse_sim_metrics(text)

    async def start(
        self, group: ProcessGroup, scenario: Scenario, nodes: list[Node], max_model_len: dict[str, int]
    ) -> None:
        start_nodes(group, scenario, nodes, max_model_len)


def node_kind(scenario: Scenario) -> NodeKind:
    """The scenario's nodes: simulated, or the real engines it names."""
    if scenario.engine is None:
        return SimNodes()
    from kvgate.demo.engines import EngineNodes  # the engines' machinery only when a scenario asks

    return EngineNodes(scenario.engine)


async def start_baseline(
    group: ProcessGroup, scenario: Scenario, work_dir: Path, *, tenant_rate_limit: bool = False
) -> Stack:
    """A plain round-robin Envoy over one shared pool. With `tenant_rate_limit`, Envoy verifies each
    tenant's token (kvgate.demo.tenants) and holds it to a sixth of what the nodes serve in requests a
    second (`fair_request_rate`) with its local rate limit."""
    count = scenario.layout.baseline_nodes
    ports = iter(free_ports(count + 2))
    nodes = [Node(f"shared-{i}", next(ports), "shared") for i in range(count)]
    kind = node_kind(scenario)
    await kind.start(group, scenario, nodes, {"shared": scenario.node.max_model_len})
    listen, admin = next(ports), next(ports)
    bootstrap = baseline_bootstrap(listen, admin, [n.port for n in nodes])
    credentials: Mapping[str, str] = {}
    if tenant_rate_limit:
        rate = fair_request_rate(scenario)
        bootstrap = rate_limited(bootstrap, {t.name: rate for t in scenario.tenants})
    rendered = write_yaml(bootstrap, work_dir / "envoy-baseline.yaml")
    if tenant_rate_limit:
        tenants = identities(scenario, work_dir)
        verifying(rendered, tenants.jwks)
        credentials = tenants.tokens
    _start_envoy(group, rendered)
    await wait_all(group, {**{n.name: n.port for n in nodes}, "envoy": listen})
    url = f"http://127.0.0.1:{listen}/v1/chat/completions"
    return Stack(
        url,
        tuple(nodes),
        tuple(n.name for n in nodes),
        frozenset(),
        routing=("envoy",),
        parse_page=kind.parse_page,
        credentials=credentials,
    )


def gate_config(
    scenario: Scenario,
    gate_port: int,
    agent_ports: list[int],
    prefix_affinity: bool = False,
    queue: bool = False,
    *,
    interactive_agent_ports: Sequence[int] = (),
    picker: bool = False,
    fairness: bool | None = None,
) -> dict[str, Any]:
    """The gate's YAML for this run (the queue reads it too): pool limits from the node profile, one
    agent per long node, and one per interactive node that lends (its long requests borrow there) or,
    for an endpoint picker (`picker`), that it picks. `fairness`: fair shares on or off, with the
    scenario's tenants' weights (None: the default config)."""
    placement = {"placement": {"prefix_affinity": True}} if prefix_affinity else {}
    protocol = {"protocol": "endpoint-picker"} if picker else {}
    tokenizer = {} if scenario.tokenizer is None else {"tokenizer": str(tokenizer_file(scenario.tokenizer))}
    return {
        "server": {"listen": f"127.0.0.1:{gate_port}", "workers": 1, **protocol},
        "default_model": {
            "interactive_max_tokens": scenario.node.interactive_max_model_len,
            "max_total_tokens": scenario.node.max_model_len,
            **tokenizer,
        },
        # With an async pool, a long request that finds no room is handed to it instead of a 429.
        "admission": {
            "max_wait_s": scenario.gate.admission_max_wait_s,
            "async_fallback": not picker and (queue or scenario.layout.async_nodes > 0),
        },
        "headroom": {"agents": [f"127.0.0.1:{port}" for port in agent_ports], **_headroom_timing(scenario)},
        **_interactive_headroom(scenario, interactive_agent_ports),
        **placement,
        **({} if fairness is None else {"fairness": _fairness(scenario, fairness)}),
        **_queue_hold(scenario),
    }


def _queue_hold(scenario: Scenario) -> dict[str, Any]:
    hold = scenario.gate.queue_max_hold_s
    return {} if hold is None else {"queue": {"max_hold_s": hold}}


def _fairness(scenario: Scenario, enabled: bool) -> dict[str, Any]:
    return {"enabled": enabled, "tenants": {t.name: {"weight": t.weight} for t in scenario.tenants}}


def _interactive_headroom(scenario: Scenario, ports: Sequence[int]) -> dict[str, Any]:
    if not ports:
        return {}
    agents = [f"127.0.0.1:{port}" for port in ports]
    return {"interactive_headroom": {"agents": agents, **_headroom_timing(scenario)}}


def _prefill_rate_flags(scenario: Scenario) -> list[str]:
    """A simulated node's prefill rate, for its agent's per-class prefill seconds and, on a node that
    lends, how fast its lent prefill drains (a real engine's is the agent's default)."""
    if scenario.engine is not None:
        return []
    return ["--prefill-tokens-per-s", str(scenario.node.prefill_tokens_per_s)]


def _headroom_timing(scenario: Scenario) -> dict[str, float]:
    """The gate's headroom timing the scenario sets (none: kvgate's defaults)."""
    gate = scenario.gate
    timing = {"stale_after_s": gate.headroom_stale_after_s, "reserve_timeout_s": gate.reserve_timeout_s}
    return {key: value for key, value in timing.items() if value is not None}


def _agent_flags(scenario: Scenario) -> list[str]:
    """The agent flags the scenario sets (none: the agent's defaults)."""
    agent = scenario.agent
    flags = {"--period-ms": agent.period_ms, "--engine-stale-after-s": agent.engine_stale_after_s}
    return [part for flag, value in flags.items() if value is not None for part in (flag, str(value))]


def _start_agents(
    group: ProcessGroup,
    nodes: list[Node],
    ports: Iterator[int],
    flags: Sequence[str] = (),
    metrics: dict[str, str] | None = None,
) -> dict[str, int]:
    """One agent per node, reading that node's /metrics; returns name -> port, and puts each one's
    own /metrics URL in `metrics`, by node."""
    agents: dict[str, int] = {}
    for node in nodes:
        name, port, metrics_port = f"agent-{node.name}", next(ports), next(ports)
        agents[name] = port
        if metrics is not None:
            metrics[node.name] = f"http://127.0.0.1:{metrics_port}/metrics"
        group.start(
            name,
            kvgate_command(
                "agent", "--listen", f"127.0.0.1:{port}", "--endpoint", node.address,
                "--engine-metrics", node.metrics_url, "--nvml", "off", "--node-name", node.name,
                "--metrics-listen", f"127.0.0.1:{metrics_port}", *flags,
            ),
        )  # fmt: skip
    return agents


async def start_kvgate(
    group: ProcessGroup,
    scenario: Scenario,
    work_dir: Path,
    envoy_config: Path,
    *,
    prefix_affinity: bool = False,
    queue: bool = False,
    picker: bool = False,
    fairness: bool | None = None,
    replicas: int = 1,
) -> Stack:
    """kvgate's stack; with `queue`, `kvgate queue` is the async pool and runs overflow on the long
    nodes, as soon as one of their agents reserves for it. With `picker`, the gate is the endpoint
    picker of one pool of every node (envoy_config is then envoy-inferencepool.yaml): every
    interactive node has an agent, and there is no async pool. With `fairness` (on or off) the
    scenario's tenants are identified by tokens Envoy verifies (kvgate.demo.tenants). With `replicas`
    above 1, as many gates (and queues, on one PostgreSQL) run behind Envoy, the scenario's first
    tenant on the first gate alone (kvgate.demo.envoy_config.gate_replicas); the first of each keeps
    its one-replica name (`gate`, `queue`), the others are `gate-1`, `queue-1`, ...."""
    layout = scenario.layout
    async_size = 0 if picker else layout.async_nodes
    sizes = {"interactive": layout.interactive_nodes, "long": layout.long_nodes, "async": async_size}
    lenders = layout.interactive_nodes if layout.interactive_lends else 0
    watched = layout.interactive_nodes if picker else lenders
    # Nodes, agents (and their metrics), then each gate and its metrics, Envoy's listener and admin,
    # each queue, PostgreSQL.
    ports = iter(free_ports(sum(sizes.values()) + 2 * (layout.long_nodes + watched) + 3 * replicas + 3))
    nodes = [Node(f"{pool}-{i}", next(ports), pool) for pool, size in sizes.items() for i in range(size)]
    model_len = {
        # A node that lends serves long requests too: the long nodes' engine configuration. The gate's
        # interactive_max_tokens still decides what is chat.
        "interactive": (scenario.node.max_model_len if lenders else scenario.node.interactive_max_model_len),
        "long": scenario.node.max_model_len,
        "async": scenario.node.max_model_len,
    }
    kind = node_kind(scenario)
    await kind.start(group, scenario, nodes, model_len)
    long_nodes = [n for n in nodes if n.pool == "long"]
    agent_metrics: dict[str, str] = {}
    agent_flags = [*_agent_flags(scenario), *_prefill_rate_flags(scenario)]
    agents = _start_agents(group, long_nodes, ports, agent_flags, agent_metrics)
    lending = [n for n in nodes if n.pool == "interactive"] if watched else []
    flags = [*agent_flags, *(("--role", "interactive", *lender_agent_flags(scenario)) if lenders else ())]
    lending_agents = _start_agents(group, lending, ports, flags, agent_metrics)
    gates = {_replica("gate", i): next(ports) for i in range(replicas)}
    gate_metrics: list[str] = []
    for name, gate_port in gates.items():
        gate_yaml = write_yaml(
            gate_config(
                scenario,
                gate_port,
                list(agents.values()),
                prefix_affinity,
                queue,
                interactive_agent_ports=list(lending_agents.values()),
                picker=picker,
                fairness=fairness,
            ),
            work_dir / f"kvgate-{name}.yaml",
        )
        # A port of its own for the gate's /metrics: the default one may be taken by another gate.
        gate_metrics.append(f"127.0.0.1:{next(ports)}")
        group.start(
            name, kvgate_command("gate", "--config", str(gate_yaml), "--metrics-listen", gate_metrics[-1])
        )
    listen, admin = next(ports), next(ports)
    envoy_ports: dict[str, int | list[int]] = {
        "listener": listen,
        "admin": admin,
        "gate": list(gates.values()),
    }
    routed = ("interactive", "long") if picker else ("interactive", "long", "async")
    envoy_ports |= {pool: [n.port for n in nodes if n.pool == pool] for pool in routed}
    ready = {n.name: n.port for n in nodes} | agents | lending_agents | gates | {"envoy": listen}
    queues = {_replica("queue", i): next(ports) for i in range(replicas)} if queue else {}
    if queues:
        envoy_ports["async"] = list(queues.values())
        store = await _queue_store(group, work_dir, next(ports), replicas)
        await _start_queues(group, queues, store, gate_yaml)
        ready |= queues
    rendered = render_envoy(envoy_config, work_dir / "envoy-kvgate.yaml", envoy_ports)
    credentials: Mapping[str, str] = {}
    if fairness is not None:
        tenants = identities(scenario, work_dir)
        verifying(rendered, tenants.jwks)
        credentials = tenants.tokens
    if replicas > 1:
        _pin_first_tenant(rendered, scenario, gates["gate"], verified=fairness is not None)
    _start_envoy(group, rendered)
    await wait_all(group, ready)
    url = f"http://127.0.0.1:{listen}/v1/chat/completions"
    async_nodes = frozenset(n.name for n in nodes if n.pool == "async")
    routing = ("envoy", *gates, *agents, *lending_agents, *queues)
    return Stack(
        url,
        tuple(nodes),
        tuple(n.name for n in long_nodes),
        async_nodes,
        f"http://{gate_metrics[0]}/metrics",
        routing,
        kind.parse_page,
        agent_metrics,
        ready,
        credentials,
        {name: f"http://{listen_at}/metrics" for name, listen_at in zip(gates, gate_metrics, strict=True)},
    )


def _pin_first_tenant(rendered: Path, scenario: Scenario, gate_port: int, *, verified: bool) -> None:
    """The rendered Envoy config in front of several gate replicas, the scenario's first tenant's
    requests all on the gate at `gate_port` (kvgate.demo.envoy_config.gate_replicas)."""
    if not verified or not scenario.tenants:
        raise ValueError("gate replicas pin a verified tenant to one gate: they need tenants and fairness")
    config = yaml.safe_load(rendered.read_text(encoding="utf-8"))
    write_yaml(gate_replicas(config, scenario.tenants[0].name, gate_port), rendered)


def _replica(name: str, index: int) -> str:
    return name if index == 0 else f"{name}-{index}"


async def _queue_store(group: ProcessGroup, work_dir: Path, port: int, replicas: int) -> str:
    """One queue's SQLite file, or, for several replicas, a PostgreSQL server they share."""
    if replicas == 1:
        return f"sqlite:///{work_dir / 'queue.db'}"
    command = await asyncio.to_thread(postgres.foreground_server, work_dir, port)
    server = group.start("postgres", command)
    await server.listening(port)
    return postgres.url(port)


async def _start_queues(group: ProcessGroup, queues: Mapping[str, int], store: str, gate_yaml: Path) -> None:
    """Each queue replica, one after the other: the first creates the store's tables."""
    for name, port in queues.items():
        group.start(
            name,
            kvgate_command(
                "queue", "--listen", f"127.0.0.1:{port}", "--store", store,
                "--config", str(gate_yaml), "--metrics-listen", "off",
            ),
        )  # fmt: skip
        await group[name].listening(port)
