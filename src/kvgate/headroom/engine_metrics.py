"""Parse the KV-cache figures out of an inference engine's Prometheus text.

Only the handful of families the headroom needs are read: each is located with `str.find` instead of
tokenising the whole exposition, because a vLLM /metrics page is mostly histogram buckets (tens of
KB) and this runs every 100 ms. Several series of one family (vLLM data-parallel engines, one per
`engine` label) are summed; KV usage is their mean.

Text that holds none of the families, or a needed line that does not parse, raises HeadroomError
naming what was wrong.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from kvgate.errors import HeadroomError

# Possessive runs (`++`, `*+`) consume a label block a run of characters at a time rather than one
# per step: 3-4x faster on vLLM's long cache_config_info labels.
_LINE = re.compile(r'(\{(?:[^"}]++|"(?:[^"\\]++|\\.)*+")*+\})?[ \t]+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*+)="((?:[^"\\]++|\\.)*+)"')

VLLM_USAGE = "vllm:kv_cache_usage_perc"
VLLM_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # before vLLM 0.10
VLLM_CACHE_INFO = "vllm:cache_config_info"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"
SGLANG_USED = "sglang:num_used_tokens"
SGLANG_MAX = "sglang:max_total_num_tokens"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_WAITING = "sglang:num_queue_reqs"


@dataclass(frozen=True, slots=True)
class EngineStats:
    engine: Literal["vllm", "sglang"]
    capacity_tokens: int | None
    used_tokens: int | None
    kv_usage: float | None
    running: int | None
    waiting: int | None
    preemptions_total: int | None


@dataclass(frozen=True, slots=True)
class _Sample:
    labels: str
    value: float


def parse_engine_metrics(text: str) -> EngineStats:
    """EngineStats from a vLLM or SGLang /metrics page; HeadroomError when it holds neither."""
    usage = _samples(text, VLLM_USAGE) or _samples(text, VLLM_USAGE_OLD)
    if usage:
        return _vllm(text, usage)
    used = _samples(text, SGLANG_USED)
    if used:
        return _sglang(text, used)
    head = text[:80].replace("\n", "\\n")
    raise HeadroomError(
        f"engine metrics hold neither {VLLM_USAGE} nor {SGLANG_USED} ({len(text)} chars, starting {head!r})"
    )


def _vllm(text: str, usage: list[_Sample]) -> EngineStats:
    fraction = _mean(usage, VLLM_USAGE)
    if fraction > 1.0:
        raise HeadroomError(f"engine metrics: {VLLM_USAGE} is {fraction}, beyond 1 (a fraction, not percent)")
    capacity = None
    info = _samples(text, VLLM_CACHE_INFO)
    if info:
        capacity = sum(_blocks(sample) for sample in info)
    return EngineStats(
        engine="vllm",
        capacity_tokens=capacity,
        used_tokens=None if capacity is None else round(fraction * capacity),
        kv_usage=fraction,
        running=_total(text, VLLM_RUNNING),
        waiting=_total(text, VLLM_WAITING),
        preemptions_total=_total(text, VLLM_PREEMPTIONS),
    )


def _sglang(text: str, used_samples: list[_Sample]) -> EngineStats:
    used = _total(text, SGLANG_USED, used_samples)
    capacity = _total(text, SGLANG_MAX)
    usage = None
    if used is not None and capacity:
        usage = used / capacity
    return EngineStats(
        engine="sglang",
        capacity_tokens=capacity,
        used_tokens=used,
        kv_usage=usage,
        running=_total(text, SGLANG_RUNNING),
        waiting=_total(text, SGLANG_WAITING),
        preemptions_total=None,
    )


def _blocks(sample: _Sample) -> int:
    labels = dict(_LABEL.findall(sample.labels))
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError) as exc:
        raise HeadroomError(
            f"engine metrics: {VLLM_CACHE_INFO} needs integer num_gpu_blocks and block_size labels, "
            f"got {sample.labels[:200]!r}"
        ) from exc


def _mean(samples: list[_Sample], name: str) -> float:
    return sum(_checked(s.value, name) for s in samples) / len(samples)


def _total(text: str, name: str, samples: list[_Sample] | None = None) -> int | None:
    found = _samples(text, name) if samples is None else samples
    if not found:
        return None
    return round(sum(_checked(s.value, name) for s in found))


def _checked(value: float, name: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise HeadroomError(f"engine metrics: {name} is {value}, expected a finite value >= 0")
    return value


def _samples(text: str, name: str) -> list[_Sample]:
    """Every sample line of the family `name`, found by substring search rather than a full parse."""
    found: list[_Sample] = []
    start = text.find(name)
    while start != -1:
        end = start + len(name)
        at_line_start = start == 0 or text[start - 1] == "\n"
        if at_line_start and end < len(text) and text[end] in "{ \t":
            line_end = text.find("\n", end)
            line = text[end:] if line_end == -1 else text[end:line_end]
            found.append(_parse_line(name, line))
        start = text.find(name, end)
    return found


def _parse_line(name: str, rest: str) -> _Sample:
    match = _LINE.match(rest)
    try:
        if match is None:
            raise ValueError(rest)
        return _Sample(match.group(1) or "", float(match.group(2)))
    except ValueError as exc:
        raise HeadroomError(f"engine metrics: cannot parse the sample line {(name + rest)[:200]!r}") from exc
