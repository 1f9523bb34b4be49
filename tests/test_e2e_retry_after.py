"""Refusals that say when to come back, end to end: the official `openai` SDK's own retries against a
burst, through the real Envoy, the gate, two agents and two simulated vLLM nodes.

Each node holds two of the burst's requests (about 5,200 tokens each, 200 of them output at ~60 tokens
per second: some 3.5 s), so a burst of twelve has four running and eight refused after the gate's
0.5 s wait. The SDK (openai 3.57.0, its defaults: 2 retries) waits exactly what `retry-after-ms` says
(`_base_client.py`, `_parse_retry_after_header`, `_calculate_retry_timeout`: a server delay of up to
120 s is taken as is, with no jitter of its own).
- fixed (`admission.retry_after: fixed`, 2 s): every refused client comes back at the same instant,
  2.5 s in, while the nodes are still full, waits, is refused again, and comes back at 5 s, when four
  can run; the last four give up.
- forecast: each refused client is told when the capacity it will take frees (the first four when the
  running requests end, the next four when those four end), so all twelve complete, and the retries
  are spread over the burst instead of landing together.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest
from test_e2e_engines import ROOT, agent, until_healthy
from texts import text_with_tokens
from waiting import PATIENCE_S

from kvgate.demo.report import percentile
from kvgate.demo.retry_figures import RetryFigures, read_retry_figures
from kvgate.harness.client import chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service, sim_command
from kvgate.harness.stack import envoy_process, gate_process, started
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

pytestmark = pytest.mark.slow

BURST = 12
PROMPT_TOKENS = 4_996
MAX_TOKENS = 200
# Two requests fit a node (the gate charges each a little above its ~5,200 exact tokens), three do not.
ENGINE_TOKENS = 13_000
SIM_FLAGS = (
    *("--kv-capacity-tokens", str(ENGINE_TOKENS), "--max-model-len", "8192", "--model-name", "test-model"),
    *("--prefill-tokens-per-s", "50000", "--decode-tokens-per-s", "60"),
)


@dataclass(frozen=True)
class Burst:
    completed: int
    refused: int
    first_retries: list[float]  # seconds after the burst, when each client first came back
    retries: list[float]  # every retry
    retry: RetryFigures  # the gate's answers, checked against when their capacity freed

    @staticmethod
    def spread(times: list[float]) -> float:
        if not times:
            return 0.0
        return (percentile(times, 90) or 0.0) - (percentile(times, 10) or 0.0)

    def line(self, mode: str) -> str:
        r = self.retry
        return (
            f"{mode:>8}: {self.completed}/{BURST} completed, {self.refused} gave up; first retries "
            f"p90-p10 {self.spread(self.first_retries):.2f} s, all {len(self.retries)} retries "
            f"p90-p10 {self.spread(self.retries):.2f} s; {r.answers} Retry-After answers, {r.checked} "
            f"checked: within ±0.5 s {r.within_half_s}, ±1 s {r.within_1_s}, median <= {r.median_bound_s} s"
        )


def sim(stack: ExitStack, tmp: Path, name: str, sp_model: Path) -> Service:
    port = free_port()
    argv = sim_command("--listen", f"127.0.0.1:{port}", "--node-name", name, "--tokenizer", str(sp_model))
    service = started(Service(name, [*argv, *SIM_FLAGS], tmp, port=port), port)
    stack.callback(service.stop)
    return service


def gate_page(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        text: str = page.read().decode()
    return text


def wait_until_fresh(metrics_port: int, agents: int, timeout_s: float = 3 * PATIENCE_S) -> None:
    """Until the gate follows every agent (its headroom stream delivered)."""
    deadline = time.monotonic() + timeout_s
    fresh = re.compile(r"^kvgate_node_fresh\{[^}]*\} 1\.0$", re.MULTILINE)
    while len(fresh.findall(gate_page(metrics_port))) < agents:
        assert time.monotonic() < deadline, "the gate never saw its agents"
        time.sleep(0.2)


def settled_retry_figures(metrics_port: int) -> RetryFigures:
    """The gate's Retry-After figures once every answer was checked against when its capacity freed
    (or given up as unresolved); as they stand after PATIENCE_S if some never settle."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        figures = read_retry_figures(gate_page(metrics_port))
        if figures.checked + figures.unresolved >= figures.answers or time.monotonic() > deadline:
            return figures
        time.sleep(0.2)


async def burst(listener: int, sp_model: Path) -> tuple[int, int, list[float], list[float]]:
    """Twelve requests at once, each with the SDK's default retries; (completed, refused, first
    retries, all retries), retry times in seconds after the burst started."""
    attempts: list[tuple[float, int]] = []

    async def record(request: httpx2.Request) -> None:
        attempts.append((time.monotonic(), int(request.headers.get("x-stainless-retry-count", "0"))))

    text = text_with_tokens(sp_model, PROMPT_TOKENS)
    async with httpx2.AsyncClient(event_hooks={"request": [record]}, timeout=60) as http:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{listener}/v1", api_key="unused", http_client=http
        )

        async def one(i: int) -> bool:
            try:
                # A different first word: no two prompts share a prefix block in the engines' caches.
                await client.chat.completions.create(
                    model="test-model",
                    messages=[{"role": "user", "content": f"{i} {text}"}],
                    max_tokens=MAX_TOKENS,
                )
            except openai.RateLimitError:
                return False
            return True

        start = time.monotonic()
        outcomes = await asyncio.gather(*(one(i) for i in range(BURST)))
    first = [t - start for t, retry in attempts if retry == 1]
    every = [t - start for t, retry in attempts if retry >= 1]
    return sum(outcomes), outcomes.count(False), first, every


def run_burst(tmp: Path, mode: str, pool_ports: dict[str, int], agents: list[int], sp_model: Path) -> Burst:
    sub = tmp / mode
    sub.mkdir()
    ports = dict(pool_ports, listener=free_port(), gate=free_port(), admin=free_port())
    agent_list = ", ".join(f"127.0.0.1:{port}" for port in agents)
    config = (
        f"default_model: {{tokenizer: {sp_model}}}\n"
        f"headroom: {{agents: [{agent_list}]}}\n"
        f"admission: {{max_wait_s: 0.5, retry_after: {mode}, retry_after_s: 2}}\n"
    )
    with ExitStack() as stack:
        envoy_config = render_envoy(ROOT / "envoy" / "envoy.yaml", sub / "envoy.yaml", ports)
        envoy = envoy_process(envoy_config, sub, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        gate = stack.enter_context(gate_process(config, sub, ports["gate"]))
        assert gate.metrics_port is not None
        deadline = time.monotonic() + 3 * PATIENCE_S
        while post(ports["listener"], "/v1/chat/completions", chat("hello", max_tokens=5)).status != 200:
            assert time.monotonic() < deadline, "the gate never routed a short request"
            time.sleep(0.2)
        wait_until_fresh(gate.metrics_port, len(agents))
        completed, refused, first, every = asyncio.run(burst(ports["listener"], sp_model))
        # The last answers are checked once their capacity frees: within a few agent messages.
        retry = settled_retry_figures(gate.metrics_port)
    return Burst(completed, refused, first, every, retry)


def test_forecast_retry_after_completes_more_of_a_burst_and_spreads_its_retries(
    tmp_path: Path, sp_model_path: Path, pools: tuple[dict[str, int], Upstreams]
) -> None:
    with ExitStack() as stack:
        nodes = [sim(stack, tmp_path, name, sp_model_path) for name in ("node-a", "node-b")]
        agents = [agent(stack, tmp_path, f"agent-{n.name}", n) for n in nodes]
        for a in agents:
            until_healthy(a.port)
        results = {}
        for mode in ("fixed", "forecast"):
            results[mode] = run_burst(tmp_path, mode, pools[0], [a.port for a in agents], sp_model_path)
            for a in agents:  # every reservation of the run released before the next one starts
                deadline = time.monotonic() + 3 * PATIENCE_S
                while until_healthy(a.port)["reserved"]["tokens"]:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
    for mode, result in results.items():
        print(result.line(mode))
    fixed, forecast = results["fixed"], results["forecast"]
    assert forecast.completed > fixed.completed, results
    assert forecast.completed == BURST, results
    assert Burst.spread(forecast.first_retries) >= 0.5, results
    assert forecast.retry.checked > 0, results
