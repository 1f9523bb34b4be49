"""What the demo reads from the simulated nodes' /metrics: KV usage over time, crashes, preemptions.

A scrape that fails means the node is down (a crashed engine answers nothing): the timeline records
it as such, and the final figures wait out a restart before reading the counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class NodeMetrics:
    kv_usage: float
    running: int
    waiting: int
    preemptions: int
    oom_crashes: int
    peak_kv_tokens: int
    capacity_tokens: int
    prefix_hit_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    # Engine time the simulator's host lost running its steps late (a busy CPU); 0 for a real engine.
    stalled_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    metrics: NodeMetrics | None  # None: the node did not answer (down)


def parse_sim_metrics(text: str) -> NodeMetrics:
    values = {name: float(value) for name, value in _SAMPLE.findall(text)}
    try:
        return NodeMetrics(
            kv_usage=values["vllm:kv_cache_usage_perc"],
            running=int(values["vllm:num_requests_running"]),
            waiting=int(values["vllm:num_requests_waiting"]),
            preemptions=int(values["vllm:num_preemptions_total"]),
            oom_crashes=int(values["kvgate_sim_oom_crashes_total"]),
            peak_kv_tokens=int(values["kvgate_sim_peak_kv_tokens"]),
            capacity_tokens=int(values["kvgate_sim_kv_capacity_tokens"]),
            prefix_hit_tokens=int(values["vllm:prefix_cache_hits_total"]),
            stalled_s=values.get("kvgate_sim_stalled_seconds_total", 0.0),
        )
    except KeyError as exc:
        raise ValueError(f"not a kvgate sim /metrics page: {exc} missing") from exc


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    port: int
    pool: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address}/metrics"


# How a node's /metrics page reads: the simulator's (parse_sim_metrics) or a real engine's.
PageParser = Callable[[str], NodeMetrics]


async def scrape(
    session: aiohttp.ClientSession, node: Node, parse: PageParser = parse_sim_metrics
) -> NodeMetrics | None:
    try:
        async with session.get(node.metrics_url) as response:
            if response.status != 200:
                return None
            return parse(await response.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


_DOWN_AFTER_S = 2.0


class Sampler:
    """Scrapes every node at a fixed interval while the load runs."""

    def __init__(
        self,
        nodes: Sequence[Node],
        interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        parse: PageParser = parse_sim_metrics,
    ) -> None:
        self.nodes = tuple(nodes)
        self.timeline: dict[str, list[Sample]] = {n.name: [] for n in nodes}
        self._interval = interval_s
        self._clock = clock
        self._parse = parse

    async def run(self, start: float) -> None:
        """Sample until cancelled; `start` is the clock value that timelines count from."""
        # A node that has not answered in 2 s is down: a real engine under load takes hundreds of ms
        # to render its page (vLLM on 2 busy cores: 70-550 ms), and is not down for it.
        timeout = aiohttp.ClientTimeout(total=max(self._interval * 2, _DOWN_AFTER_S))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                now = self._clock() - start
                found = await asyncio.gather(*(scrape(session, n, self._parse) for n in self.nodes))
                for node, metrics in zip(self.nodes, found, strict=True):
                    self.timeline[node.name].append(Sample(now, metrics))
                await asyncio.sleep(self._interval)


async def fetch_page(url: str, timeout_s: float = 2.0) -> str | None:
    """A /metrics page as text; None when it cannot be read."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url) as response,
        ):
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def final_metrics(
    nodes: Sequence[Node], wait_s: float, parse: PageParser = parse_sim_metrics
) -> dict[str, NodeMetrics | None]:
    """Each node's counters, waiting up to `wait_s` for nodes that are restarting after a crash."""
    deadline = time.monotonic() + wait_s
    result: dict[str, NodeMetrics | None] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        for node in nodes:
            metrics = await scrape(session, node, parse)
            while metrics is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                metrics = await scrape(session, node, parse)
            result[node.name] = metrics
    return result


def with_sampled_peaks(
    final: Mapping[str, NodeMetrics | None], timeline: Mapping[str, Sequence[Sample]]
) -> dict[str, NodeMetrics | None]:
    """`final` with each node's peak KV raised to the highest usage sampled on its timeline: an engine
    that keeps no peak of its own (vLLM) has its peak read from the samples; the simulator's own peak,
    taken at every step, is never below them."""
    result: dict[str, NodeMetrics | None] = {}
    for name, metrics in final.items():
        sampled = [s.metrics for s in timeline.get(name, ()) if s.metrics is not None]
        if metrics is None or not sampled:
            result[name] = metrics
            continue
        peak = max(round(m.kv_usage * m.capacity_tokens) for m in sampled)
        result[name] = dataclasses.replace(metrics, peak_kv_tokens=max(metrics.peak_kv_tokens, peak))
    return result
