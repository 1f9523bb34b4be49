"""Real engines' pages end to end: a simulated vLLM node with two data-parallel engines and a simulated
SGLang node with four TP ranks, each behind its agent, behind the gate and Envoy.

Read as the engines write them, the nodes hold 2 x 26,000 and 26,000 tokens. Summing every series
(each vLLM engine carries the DP-summed block count, each SGLang TP rank repeats the pool) reads
104,000 for both, and a burst of ten requests the gate sizes at about 12.8k tokens would all be
admitted onto engines that hold two each. Six must be admitted, four refused, and no simulated
engine may have run short of blocks.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from texts import text_with_tokens
from waiting import PATIENCE_S

from kvgate.config.headroom import HeadroomSettings
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service, kvgate_command, sim_command
from kvgate.harness.stack import agent_process, envoy_process, gate_process, started
from kvgate.harness.upstreams import Upstreams
from kvgate.headroom.snapshot import NodeHeadroom
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
ENGINE_TOKENS = 26_000  # --kv-capacity-tokens, 1,625 blocks of 16
BLOCK_TOKENS = 16
# An idle SGLang first writes its usage gauges this long after it started (kvgate.sim.sglang_page).
SGLANG_IDLE_WRITE_S = 30.0
SIM_FLAGS = (
    *("--kv-capacity-tokens", "26000", "--max-model-len", "16384", "--model-name", "test-model"),
    # About 4 s per admitted request: long enough to look at the agents while they hold them.
    *("--prefill-tokens-per-s", "200000", "--decode-tokens-per-s", "250"),
)


def sim(stack: ExitStack, tmp: Path, name: str, sp_model: Path, *layout: str) -> Service:
    port = free_port()
    argv = sim_command("--listen", f"127.0.0.1:{port}", "--node-name", name, "--tokenizer", str(sp_model))
    service = started(Service(name, [*argv, *SIM_FLAGS, *layout], tmp, port=port), port)
    stack.callback(service.stop)
    return service


def agent(stack: ExitStack, tmp: Path, name: str, engine: Service) -> Service:
    endpoint = f"127.0.0.1:{engine.port}"
    flags = ["--engine-metrics", f"http://{endpoint}/metrics", "--safety-ratio", "1.0"]
    service = agent_process(tmp, name, free_port(), endpoint, flags)
    stack.callback(service.stop)
    return service


def status(agent_port: int) -> dict[str, Any]:
    done = subprocess.run(
        kvgate_command("status", "--agent", f"127.0.0.1:{agent_port}", "--json"),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    seen: dict[str, Any] = json.loads(done.stdout)
    return seen


async def held_at_once(agent_ports: list[int], reservations: int) -> tuple[NodeHeadroom, ...] | None:
    """Each agent's headroom, in `agent_ports` order, the first time they hold `reservations` between
    them (None if they never do within PATIENCE_S)."""
    agents = tuple(f"127.0.0.1:{port}" for port in agent_ports)
    view = HeadroomView(HeadroomSettings(agents=agents))
    await view.start()
    try:
        async with asyncio.timeout(PATIENCE_S):
            while True:
                nodes = {node.agent: node.headroom for node in view.snapshot()}
                seen = tuple(nodes.get(agent) for agent in agents)
                if all(seen) and sum(n.reservations for n in seen if n) >= reservations:
                    return tuple(n for n in seen if n)
                await view.wait_update(1.0)
    except TimeoutError:
        return None
    finally:
        await view.stop()


def until_healthy(agent_port: int, timeout_s: float = 3 * PATIENCE_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not (seen := status(agent_port))["healthy"]:
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    return seen


def sim_series(port: int, name: str) -> dict[str, float]:
    """The series of family `name` on a simulator's page: label block -> value."""
    text = post(port, "/metrics", None).body.decode()
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            found[labels] = float(value)
    return found


def test_a_burst_fits_the_true_capacity_of_dp_and_tp_nodes(
    tmp_path: Path, sp_model_path: Path, pools: tuple[dict[str, int], Upstreams]
) -> None:
    with ExitStack() as stack:
        burst_through(stack, tmp_path, sp_model_path, pools[0])


def burst_through(stack: ExitStack, tmp_path: Path, sp_model_path: Path, pool_ports: dict[str, int]) -> None:
    vllm = sim(stack, tmp_path, "vllm-dp2", sp_model_path, "--engine", "vllm", "--data-parallel", "2")
    sglang_started = time.monotonic()
    sglang = sim(stack, tmp_path, "sglang-tp4", sp_model_path, "--engine", "sglang", "--tensor-parallel", "4")
    agents = [agent(stack, tmp_path, "vllm-agent", vllm), agent(stack, tmp_path, "sglang-agent", sglang)]

    seen_vllm, seen_sglang = (until_healthy(a.port) for a in agents)
    assert (seen_vllm["engine"]["kind"], seen_vllm["engine"]["engines"]) == ("vllm", ["engine 0", "engine 1"])
    # Each vLLM engine keeps one block of its pool as its null block (kvgate.agent.sources.engines.vllm).
    assert seen_vllm["capacity"]["tokens"] == 2 * (ENGINE_TOKENS - BLOCK_TOKENS)
    assert seen_vllm["capacity"]["rule"] == (
        f"kv_cache_size_tokens {ENGINE_TOKENS} x 1624 of 1625 blocks (one is vLLM's null block) x 2 engines"
    )
    assert (seen_sglang["engine"]["kind"], seen_sglang["engine"]["engines"]) == ("sglang", ["tp 0-3, pp 0"])
    assert seen_sglang["capacity"]["tokens"] == ENGINE_TOKENS
    # A fresh SGLang has published no usage yet: healthy, used 0, and it says so; until its first
    # request or SGLANG_IDLE_WRITE_S of idling (which a busy machine can take to get this far).
    assert seen_sglang["used"]["tokens"] == 0
    if time.monotonic() - sglang_started < SGLANG_IDLE_WRITE_S:
        assert seen_sglang["reason"].startswith("engine idle, usage not yet published")

    ports = dict(pool_ports, listener=free_port(), gate=free_port(), admin=free_port())
    envoy_config = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp_path / "envoy.yaml", ports)
    envoy = envoy_process(envoy_config, tmp_path, ports["admin"], ports["listener"])
    stack.callback(envoy.stop)
    agent_list = ", ".join(f"127.0.0.1:{a.port}" for a in agents)
    config = (
        f"default_model: {{tokenizer: {sp_model_path}}}\n"
        f"headroom: {{agents: [{agent_list}]}}\n"
        "admission: {max_wait_s: 0.3}\n"
    )
    stack.enter_context(gate_process(config, tmp_path, ports["gate"]))
    # 10,996 prompt tokens + 1,000 output (the gate charges about 12.8k): two fit one engine.
    body = chat(text_with_tokens(sp_model_path, 10_996), max_tokens=1000)
    deadline = time.monotonic() + 3 * PATIENCE_S
    while post(ports["listener"], CHAT, chat("hello", max_tokens=5)).status != 200:
        assert time.monotonic() < deadline, "the gate never routed a short request"
        time.sleep(0.2)

    replies: list[Reply] = []
    lock = threading.Lock()

    def one() -> None:
        reply = post(ports["listener"], CHAT, body, timeout=60)
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=one) for _ in range(10)]
    with ThreadPoolExecutor(1) as watcher:
        # Followed on the agents' own streams from before the burst: the admitted requests are decoding.
        holding = watcher.submit(asyncio.run, held_at_once([a.port for a in agents], 6))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        during = holding.result()

    statuses = sorted(r.status for r in replies)
    assert statuses == [200] * 6 + [429] * 4, [(r.status, r.body[:120]) for r in replies]
    served = sorted(r.headers.get("x-kvgate-sim-node", "") for r in replies if r.status == 200)
    assert served == ["sglang-tp4"] * 2 + ["vllm-dp2"] * 4
    assert during is not None, "the agents never held the six admitted requests' reservations at once"
    for seen in during:
        assert seen.reserved_tokens <= seen.capacity_tokens, seen
    assert [seen.reservations for seen in during] == [4, 2]
    # The engines' own counters: no engine ever wanted more blocks than it had, none preempted.
    for engine, preempted in (
        (vllm, "vllm:num_preemptions_total"),
        (sglang, "sglang:num_retracted_requests_total"),
    ):
        peaks = sim_series(engine.port, "kvgate_sim_peak_kv_tokens")
        assert peaks and max(peaks.values()) <= ENGINE_TOKENS, peaks
        assert sum(sim_series(engine.port, preempted).values()) == 0
    finished = sim_series(vllm.port, "vllm:request_success_total")
    assert [sum(v for k, v in finished.items() if f'engine="{e}"' in k) for e in (0, 1)] == [2, 2]
