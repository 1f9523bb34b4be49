"""A request trace replayed by the demo: read, windowed, planned, and what an infinite cache would hit.

The format is Mooncake's (kvcache-ai/Mooncake, FAST'25 traces), one JSON object a line:
`{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`, one hash id
per 512-token prompt block in order (the last block may be partial); equal ids are a shared prefix.
A line that breaks the format is an error naming the file and the line.

The replay sends each request of the window at (its time - the window's start) / speed, asking for
exactly its output length. Compressing time by `speed` also makes the simulated nodes `speed` times
faster (prefill and decode rates, restart time: `compressed`), so queues, KV occupancy and the share of
time a node spends prefilling stay what the trace would cause at its own pace; only what does not
scale (the routers' own latency, their polling periods, the host's CPU) weighs `speed` times more.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate.demo.prompts import BLOCK_TOKENS
from kvgate.demo.scenario import Planned, Scenario
from kvgate.errors import ConfigError

# TTFT classes by prompt tokens: (name, largest prompt of the class).
CLASSES: tuple[tuple[str, float], ...] = (("le_4k", 4096), ("4k_16k", 16384), ("gt_16k", math.inf))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int  # 1-based line of the trace file
    at_s: float  # arrival, seconds from the trace's start
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Window:
    """Seconds of the trace to replay: [start_s, end_s)."""

    start_s: float = 0.0
    end_s: float = math.inf

    def __str__(self) -> str:
        end = "" if math.isinf(self.end_s) else f"{self.end_s:g}"
        return f"{self.start_s:g}:{end}"


def parse_window(text: str) -> Window:
    """`START:END` in trace seconds; either side may be left out (`:600`, `300:`)."""
    start, sep, end = text.partition(":")
    try:
        window = Window(float(start) if start else 0.0, float(end) if end else math.inf)
    except ValueError:
        window = Window(-1.0)
    if not sep or window.start_s < 0 or window.end_s <= window.start_s:
        raise ConfigError(f"--window must be START:END in trace seconds with 0 <= START < END, got {text!r}")
    return window


def _field(row: dict[str, object], key: str, where: str, least: int) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}: {key} must be a whole number >= {least}, got {value!r}")
    return value


def parse_line(text: str, where: str, line: int) -> TraceRequest:
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: not a JSON object: {exc}") from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: not a JSON object")
    input_tokens = _field(row, "input_length", where, 1)
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where}: hash_ids must be a list of whole numbers")
    if len(ids) != -(-input_tokens // BLOCK_TOKENS):
        raise ConfigError(
            f"{where}: {input_tokens} input tokens are {-(-input_tokens // BLOCK_TOKENS)} blocks of "
            f"{BLOCK_TOKENS}, but hash_ids has {len(ids)}"
        )
    return TraceRequest(
        line,
        _field(row, "timestamp", where, 0) / 1000,
        input_tokens,
        _field(row, "output_length", where, 1),
        tuple(ids),
    )


SHIPPED_TRACES = Path(__file__).parent / "traces"


def trace_file(name_or_path: str) -> Path:
    """A trace file named on the command line: a path, or the name of one this package ships
    (`mooncake_conversation_first_half`, src/kvgate/demo/traces/README.md)."""
    given = Path(name_or_path)
    if given.exists() or given.parent != Path("."):
        return given
    shipped = SHIPPED_TRACES / f"{given.name.removesuffix('.jsonl')}.jsonl"
    if shipped.exists():
        return shipped
    known = ", ".join(sorted(p.stem for p in SHIPPED_TRACES.glob("*.jsonl")))
    raise ConfigError(f"trace {name_or_path}: no such file, nor a shipped trace (shipped: {known})")


def read_trace(path: Path, window: Window = Window()) -> list[TraceRequest]:
    """The requests of `path` that arrive within `window`, in arrival order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from exc
    requests = [
        parse_line(text, f"{path}:{number}", number)
        for number, text in enumerate(lines, start=1)
        if text.strip()
    ]
    if not requests:
        raise ConfigError(f"trace {path} has no requests")
    chosen = [r for r in requests if window.start_s <= r.at_s < window.end_s]
    return sorted(chosen, key=lambda r: r.at_s)


def plan_trace(
    requests: Sequence[TraceRequest], window: Window, speed: float, interactive_max_tokens: int
) -> list[Planned]:
    """The replay: each request at its trace time from the window's start, divided by `speed`. A
    request is `short` when its prompt and output fit the interactive limit, `long` otherwise."""
    return [
        Planned(
            at_s=(r.at_s - window.start_s) / speed,
            kind="short" if r.total_tokens <= interactive_max_tokens else "long",
            prompt_tokens=r.input_tokens,
            max_tokens=r.output_tokens,
            index=index,
            label=f"line {r.line}",
            blocks=r.hash_ids,
        )
        for index, r in enumerate(requests)
    ]


def prefix_bound(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, the prompt tokens an infinite prefix cache would already hold when it arrives: its
    leading blocks seen before, each as far as it was seen (a partial block seen shorter ends the run)."""
    seen: dict[int, int] = {}  # id -> most tokens of its block any earlier prompt held
    bound: list[int] = []
    for r in requests:
        hit = 0
        for index, block in enumerate(r.hash_ids):
            tokens = min(BLOCK_TOKENS, r.input_tokens - index * BLOCK_TOKENS)
            held = min(seen.get(block, 0), tokens)
            hit += held
            if held < tokens:
                break
        bound.append(hit)
        for index, block in enumerate(r.hash_ids):
            tokens = min(BLOCK_TOKENS, r.input_tokens - index * BLOCK_TOKENS)
            seen[block] = max(seen.get(block, 0), tokens)
    return bound


def prompt_class(prompt_tokens: int) -> str:
    return next(name for name, largest in CLASSES if prompt_tokens <= largest)


def compressed(scenario: Scenario, speed: float) -> Scenario:
    """The scenario with its nodes `speed` times faster, for a replay `speed` times faster."""
    node = scenario.node
    faster = dataclasses.replace(
        node,
        prefill_tokens_per_s=node.prefill_tokens_per_s * speed,
        decode_tokens_per_s=node.decode_tokens_per_s * speed,
        restart_s=node.restart_s / speed,
    )
    return dataclasses.replace(scenario, node=faster)


def misfits(requests: Sequence[TraceRequest], scenario: Scenario) -> str | None:
    """Why the scenario's nodes cannot serve the trace as it is (a request past max_model_len); None
    when they can: a real trace must not be refused as malformed."""
    longest = max(requests, key=lambda r: r.total_tokens)
    if longest.total_tokens <= scenario.node.max_model_len:
        return None
    return (
        f"line {longest.line} needs {longest.total_tokens} tokens (prompt + output), more than the "
        f"scenario's node.max_model_len of {scenario.node.max_model_len}: raise it (and "
        f"node.kv_capacity_tokens) or choose a --window without it"
    )
