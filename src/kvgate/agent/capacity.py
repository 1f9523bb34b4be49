"""KV-cache capacity from a model's shape, for engines that do not report their KV pool.

Bytes per token: 2 * layers * kv_heads * head_dim * dtype_bytes for standard attention
(one K and one V per KV head); layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes for MLA
(DeepSeek), which caches one compressed latent plus the rotary key per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.errors import ConfigError
from kvgate.headroom.snapshot import GpuReading

DTYPE_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "fp16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0}


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    dtype_bytes: float = 2.0
    kv_heads: int = 0
    head_dim: int = 0
    # MLA: set both and leave kv_heads/head_dim at 0.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        mla = self.kv_lora_rank > 0
        standard = self.kv_heads > 0 and self.head_dim > 0
        if self.layers <= 0 or self.dtype_bytes <= 0:
            raise ConfigError("model shape: layers and dtype bytes must be positive")
        if mla == standard:
            raise ConfigError(
                "model shape: give either kv_heads and head_dim (standard attention) "
                "or kv_lora_rank and qk_rope_head_dim (MLA), not both or neither"
            )
        if min(self.kv_heads, self.head_dim, self.kv_lora_rank, self.qk_rope_head_dim) < 0:
            raise ConfigError("model shape: sizes must not be negative")


def kv_bytes_per_token(shape: ModelShape) -> float:
    if shape.kv_lora_rank > 0:
        return shape.layers * (shape.kv_lora_rank + shape.qk_rope_head_dim) * shape.dtype_bytes
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes


def static_capacity_tokens(
    gpus: Iterable[GpuReading], bytes_per_token: float, utilization_cap: float
) -> int | None:
    """Tokens that fit in the memory still free under the utilisation cap, summed over healthy GPUs.

    Per GPU the budget is min(free, total * cap - used): the cap keeps room for activations and
    other processes, as vLLM's gpu_memory_utilization does. Memory the engine already holds for KV is
    not free, so reservations of running requests are counted twice here: conservative on purpose,
    for engines that report nothing better. None when no GPU reading is known.
    """
    budget = 0.0
    known = False
    for gpu in gpus:
        if not gpu.healthy or gpu.total_bytes is None or gpu.used_bytes is None or gpu.free_bytes is None:
            continue
        known = True
        budget += max(0.0, min(gpu.free_bytes, gpu.total_bytes * utilization_cap - gpu.used_bytes))
    if not known:
        return None
    return int(budget // bytes_per_token)
