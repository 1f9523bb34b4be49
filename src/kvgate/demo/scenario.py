"""Demo scenarios: the YAML a user writes, and the deterministic request plan replayed from it.

A scenario names the simulated node (one hardware profile for both runs), how the baseline and the
kvgate layouts split the nodes, the steady short traffic and the bursts of long requests. Unknown
keys are errors naming the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvgate.config import parse_yaml_as
from kvgate.errors import ConfigError


@dataclass(frozen=True, slots=True)
class NodeProfile:
    kv_capacity_tokens: int = 81920
    max_model_len: int = 40960
    interactive_max_model_len: int = 4096
    prefill_tokens_per_s: float = 40000.0
    decode_tokens_per_s: float = 50.0
    on_exhaustion: Literal["crash", "preempt"] = "crash"
    restart_s: float = 8.0


@dataclass(frozen=True, slots=True)
class Layout:
    baseline_nodes: int = 3
    interactive_nodes: int = 1
    long_nodes: int = 2
    async_nodes: int = 0


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
class GateSettings:
    # How long the gate holds a long request that fits no node yet. It must stay well under Envoy's
    # ext_proc message_timeout (5 s in envoy/envoy.yaml), or Envoy gives up on the gate and fails open.
    admission_max_wait_s: float = 3.5


@dataclass(frozen=True, slots=True)
class Timing:
    burst_phase_s: float = 28.0
    no_burst_phase_s: float = 20.0
    drain_s: float = 20.0
    request_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    max_in_flight: int = 256


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str = "scenario"
    seed: int = 1
    model: str = "kvgate-sim"
    node: NodeProfile = NodeProfile()
    layout: Layout = Layout()
    short: ShortTraffic = ShortTraffic()
    bursts: Bursts = Bursts()
    gate: GateSettings = GateSettings()
    timing: Timing = Timing()


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of the replay: when it is sent and what it asks for."""

    at_s: float
    kind: Literal["short", "long"]
    prompt_tokens: int
    max_tokens: int
    index: int


def _check(s: Scenario) -> None:
    problems = []
    if s.short.prompt_tokens_min > s.short.prompt_tokens_max or s.bursts.size_min > s.bursts.size_max:
        problems.append("a *_min is larger than its *_max")
    if s.short.prompt_tokens_max + s.short.max_tokens > s.node.interactive_max_model_len:
        problems.append("short requests must fit node.interactive_max_model_len")
    if s.bursts.prompt_tokens + s.bursts.max_tokens > s.node.max_model_len:
        problems.append("long requests must fit node.max_model_len")
    if s.node.max_model_len > s.node.kv_capacity_tokens:
        problems.append("node.max_model_len cannot exceed node.kv_capacity_tokens")
    if min(s.layout.baseline_nodes, s.layout.interactive_nodes, s.layout.long_nodes) < 1:
        problems.append("every pool needs at least one node")
    if s.bursts.every_s <= 0 or s.short.rate_per_s <= 0:
        problems.append("bursts.every_s and short.rate_per_s must be > 0")
    if problems:
        raise ConfigError(f"scenario {s.name}: " + "; ".join(problems))


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


def plan(scenario: Scenario, duration_s: float, with_bursts: bool) -> list[Planned]:
    """Every request of one phase, sorted by send time; the same seed gives the same short traffic
    with and without bursts, so the no-burst phase is the burst phase minus its long requests."""
    short_rng = random.Random(f"{scenario.seed}/short")
    items: list[tuple[float, Literal["short", "long"], int, int]] = []
    t = short_rng.expovariate(scenario.short.rate_per_s)
    while t < duration_s:
        tokens = short_rng.randint(scenario.short.prompt_tokens_min, scenario.short.prompt_tokens_max)
        items.append((t, "short", tokens, scenario.short.max_tokens))
        t += short_rng.expovariate(scenario.short.rate_per_s)
    if with_bursts:
        burst_rng = random.Random(f"{scenario.seed}/bursts")
        b = scenario.bursts
        start = b.first_at_s
        while start < duration_s:
            for _ in range(burst_rng.randint(b.size_min, b.size_max)):
                items.append(
                    (start + burst_rng.uniform(0, b.spread_s), "long", b.prompt_tokens, b.max_tokens)
                )
            start += b.every_s
    items.sort(key=lambda item: item[0])
    return [Planned(at, kind, tokens, out, i) for i, (at, kind, tokens, out) in enumerate(items)]
