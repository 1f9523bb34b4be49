"""What shape a simulated node takes: the engine it speaks as and its parallelism (plain data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvgate.errors import ConfigError

EngineName = Literal["vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class Layout:
    """The engine a simulated node speaks as, and its parallelism as its /metrics page shows it.

    Data parallelism runs `data_parallel` engines of the configured KV capacity each behind one
    endpoint. Tensor and pipeline parallelism change no capacity (the ranks share one pool); they
    only add the per-rank series SGLang writes (vLLM's page does not show them).
    """

    engine: EngineName = "vllm"
    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("data_parallel", "tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Finished:
    """One request that ended, for the per-request histograms and counters."""

    engine: int  # DP rank that served it
    prompt_tokens: int
    output_tokens: int
    reason: Literal["stop", "length"]
    ttft_s: float
    e2e_s: float
