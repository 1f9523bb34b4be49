"""A run of the demo by name: which stack it starts over which nodes, and when that stack is ready.

- `baseline`: a plain round-robin Envoy over one shared pool (kvgate.demo.stacks);
- `ratelimit`: the same Envoy verifying the scenario's tenants and holding each to a sixth of
  what the nodes serve with its local rate limit (the fairness scenario's comparison);
- `kvgate`, `kvgate_prefix_off`, `kvgate_prefix_on`, `kvgate_no_queue`: kvgate's pools, agents, gate and
  Envoy, prefix-aware placement on only in `kvgate_prefix_on`, the queue unless `kvgate_no_queue`;
- `kvgate_inferencepool`: kvgate as an InferencePool's endpoint picker (docs/picker.md) behind Envoy
  configured as the pool's gateway (envoy/envoy-inferencepool.yaml), without the queue;
- `kvgate_nofair`, `kvgate_fair`: kvgate with the scenario's tenants identified by verified tokens
  (kvgate.demo.tenants), fair shares off and on;
- `kvgate_fair_2x`: fair shares on two gate replicas and two `kvgate queue` replicas on one PostgreSQL,
  the first tenant's requests on the first gate alone; `kvgate_fair_2x_kill`: the same, with the second
  gate and the second queue killed (SIGKILL, not restarted) halfway through the tenants' traffic;
- `peer_<router>_<policy>`: a peer router over the baseline's nodes (kvgate.demo.peers).
Every run starts fresh nodes.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from kvgate.demo.peers import start_peer
from kvgate.demo.scenario import RunName, Scenario
from kvgate.demo.scrape import fetch_page
from kvgate.demo.stacks import Stack, start_baseline, start_kvgate
from kvgate.harness.processes import ChildError, ProcessGroup, checkout_path

INFERENCEPOOL_ENVOY = "envoy/envoy-inferencepool.yaml"
_FRESH = re.compile(r"^kvgate_node_fresh\{[^}]*\} 1\.0$", re.MULTILINE)


async def start_stack(
    name: RunName, group: ProcessGroup, scenario: Scenario, work_dir: Path, envoy_config: Path
) -> Stack:
    if name in ("baseline", "ratelimit"):
        return await start_baseline(group, scenario, work_dir, tenant_rate_limit=name == "ratelimit")
    if name.startswith("peer_"):
        return await start_peer(group, scenario, name, group.log_dir)
    if name == "kvgate_inferencepool":
        picker_yaml = checkout_path(INFERENCEPOOL_ENVOY)
        return await start_kvgate(group, scenario, work_dir, picker_yaml, picker=True)
    if name in ("kvgate_fair_2x", "kvgate_fair_2x_kill"):
        return await start_kvgate(
            group, scenario, work_dir, envoy_config, queue=True, fairness=True, replicas=2
        )
    return await start_kvgate(
        group,
        scenario,
        work_dir,
        envoy_config,
        prefix_affinity=name == "kvgate_prefix_on",
        queue=scenario.layout.queue and name != "kvgate_no_queue",
        fairness={"kvgate_fair": True, "kvgate_nofair": False}.get(name),
    )


def killed_mid_run(name: RunName) -> tuple[str, ...]:
    """The processes a run kills halfway through its long traffic (ProcessGroup names)."""
    return ("gate-1", "queue-1") if name == "kvgate_fair_2x_kill" else ()


async def gate_follows_agents(stack: Stack, timeout_s: float = 30.0) -> None:
    """Until the gate has a fresh headroom view of every long node (its agents' streams arrived), so
    that the first long request is placed rather than refused; at once for a stack without a gate."""
    if stack.gate_metrics_url is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        page = await fetch_page(stack.gate_metrics_url)
        if page is not None and len(_FRESH.findall(page)) >= len(stack.long_pool):
            return
        if time.monotonic() > deadline:
            raise ChildError(f"the gate saw no fresh headroom from its {len(stack.long_pool)} agents")
        await asyncio.sleep(0.2)
