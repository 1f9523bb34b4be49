"""A peer router's stack: the baseline's nodes (fresh, one shared pool) behind smg or vllm-router, run as
they ship (`make peers`; kvgate.harness.peers) and given what each needs to be at its best:
- the nodes play vLLM, so both routers read them as vLLM (/version, /tokenize, the render endpoints,
  /metrics with KV usage); smg polls that /metrics every second (`--load-monitor-interval 1`);
- vllm-router `kv_aware` gets the nodes' KV-event feeds (each node publishes on a free port; its
  static `--kv-event-source` flags are read from the nodes' /kv_event_sources, since its HTTP discovery
  spawns no subscriber). Fresh nodes per run: a router that subscribes late misses earlier events.

What a router cannot do here is said, not hidden: `limits` gives the reasons the report records.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import get_args

from kvgate.demo.scenario import PeerRunName, Scenario
from kvgate.demo.scrape import Node
from kvgate.demo.stacks import Stack, start_nodes, wait_all
from kvgate.harness.peers import (
    POLICIES,
    PeerName,
    PeerRouter,
    find_peer,
    kv_event_flags,
    peer_argv,
    wait_ready,
)
from kvgate.harness.processes import ChildError, ProcessGroup
from kvgate.localports import free_ports

PEER_RUNS: tuple[PeerRunName, ...] = get_args(PeerRunName)
_ROUTERS: tuple[PeerName, ...] = ("vllm-router", "smg")  # longest name first: both are prefixes
_READY_S = 120.0

# What each router cannot use against vLLM-compatible nodes, as the phase that wired them found it
# (tests/test_peers.py shows each router at its best).
_ROUTER_LIMITS: dict[PeerName, tuple[str, ...]] = {
    "smg": (
        "smg 1.13 subscribes to KV events only on gRPC workers: over HTTP (vLLM's OpenAI server) it "
        "never sees what a node's prefix cache holds or evicts",
    ),
    "vllm-router": ("vllm-router 0.1.17 reads no engine metrics for routing (KV usage, waiting requests)",),
}
_POLICY_LIMITS: dict[tuple[PeerName, str], tuple[str, ...]] = {
    ("smg", "cache_aware"): (
        "cache_aware matches prompt text in its own character tree of what it routed, not the "
        "nodes' caches; its load balance reads the nodes' /metrics once a second",
    ),
    ("vllm-router", "power_of_two"): (
        "power_of_two polls SGLang's GET /get_load; a vLLM node answers 404 (as vLLM does), so it "
        "compares its own in-flight counts",
    ),
    ("vllm-router", "cache_aware"): (
        "cache_aware renders every request on every node (POST /v1/chat/completions/render) before "
        "it routes: that cost lands on the engines, outside the router's CPU",
    ),
    ("vllm-router", "kv_aware"): (
        "kv_aware: its HTTP discovery spawns no KV-event subscriber in 0.1.17; it is given each "
        "node's feed by its static --kv-event-source flags",
    ),
}


def peer_of(run: str) -> tuple[PeerName, str]:
    """(router, policy) of a run named peer_<router>_<policy>; ValueError for any other name."""
    rest = run.removeprefix("peer_")
    for router in _ROUTERS:
        if rest.startswith(router + "_") and rest[len(router) + 1 :] in POLICIES[router]:
            return router, rest[len(router) + 1 :]
    raise ValueError(f"{run!r} is not a peer run (peer_<router>_<policy>)")


def unavailable(run: str) -> str | None:
    """Why this peer run cannot start here (its router is not installed); None when it can."""
    return find_peer(peer_of(run)[0]).reason or None


def limits(run: str) -> list[str]:
    """What the run's router cannot do against these nodes, with the reason."""
    router, policy = peer_of(run)
    return [*_ROUTER_LIMITS[router], *_POLICY_LIMITS.get((router, policy), ())]


async def start_peer(group: ProcessGroup, scenario: Scenario, run: str, log_dir: Path) -> Stack:
    """Fresh nodes in one shared pool (the baseline's) and the run's router in front of them, ready."""
    router, policy = peer_of(run)
    lookup = find_peer(router)
    if lookup.path is None:
        raise ChildError(lookup.reason)
    count = scenario.layout.baseline_nodes
    ports = iter(free_ports(count + 2))
    nodes = [Node(f"shared-{i}", next(ports), "shared") for i in range(count)]
    kv_aware = policy == "kv_aware"
    extra = ("--kv-events-endpoint", "tcp://127.0.0.1:0") if kv_aware else ()
    start_nodes(group, scenario, nodes, {"shared": scenario.node.max_model_len}, extra)
    await wait_all(group, {n.name: n.port for n in nodes})
    workers = [f"http://{n.address}" for n in nodes]
    port, metrics_port = next(ports), next(ports)
    argv = peer_argv(lookup.path, router, policy, workers, port=port, metrics_port=metrics_port)
    if kv_aware:
        argv += await asyncio.to_thread(kv_event_flags, workers)
    service = group.start("router", argv, port=port, metrics_port=metrics_port, log_name=f"{router}-{policy}")
    peer = PeerRouter(router, policy, tuple(workers), service)
    await asyncio.to_thread(wait_ready, peer, _READY_S)
    names = tuple(n.name for n in nodes)
    return Stack(f"{peer.url}/v1/chat/completions", tuple(nodes), names, frozenset(), routing=("router",))
