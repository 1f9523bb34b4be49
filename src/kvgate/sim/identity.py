"""What a simulated node says about itself, as the engine it plays says it (pure: plain dicts).

Routers identify a worker before they route to it: smg (SGLang Model Gateway) asks /v1/models and takes
`owned_by` "vllm" or "sglang" for the engine, else tries GET /version (vLLM only) and /server_info
(smg model_gateway/src/workflow/steps/local/detect_backend.rs @ f8daa88), then polls the engine's
/metrics for load; vllm-router asks /version at start, /get_load for power_of_two and /get_server_info
for kv_aware. Each answer below names its source.

vLLM (the version the simulated /metrics page follows, 0.33.0):
- GET /version: `{"version": VLLM_VERSION}` (the API server's show_version).
- GET /v1/models: a ModelList of ModelCards, `owned_by` "vllm", `root`, `max_model_len`
  (vllm/entrypoints/openai/engine/protocol.py @ 040a2cc, ModelCard).
- GET /server_info?config_format=json: `{"vllm_config", "vllm_env", "system_env"}`
  (vllm/entrypoints/serve/instrumentator/server_info.py @ 09cb327); the config is the part of
  VllmConfig the simulator models (model, cache, parallel and scheduler settings, KV events).
- GET /get_server_info: no vLLM release serves it; vllm-router's kv_aware discovery reads it for the
  worker's cache identity (`model_id`, `instance_id`, `kv_block_size`; vllm-project/router
  src/kv_index/discovery.rs, query_server_info). Answered with exactly those facts.
SGLang (the version the simulated page follows, 0.5.23):
- GET /server_info and its older name /get_server_info: the server arguments, the scheduler's info,
  one internal state per DP rank and the version (python/sglang/srt/entrypoints/http_server.py
  @ 0025436, get_server_info; the internal state's fields as its scheduler's get_internal_state
  fills them).
- GET /model_info and /get_model_info: `{"model_path", "tokenizer_path", "is_generation"}`.
- GET /get_load: one entry per DP rank, `{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}`
  (GetLoadReqOutput): requests running plus waiting, those waiting, and the tokens held in KV plus
  those of the waiting prompts, as SGLang's scheduler counts its load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.sim.engine import EngineConfig, EngineStats
from kvgate.sim.layout import Layout

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True, slots=True)
class Identity:
    """The facts a node reports about itself."""

    config: EngineConfig
    layout: Layout
    model_name: str
    instance_id: str
    kv_event_endpoints: tuple[str, ...] = ()  # one per DP rank, when the node publishes KV events

    @property
    def version(self) -> str:
        return SGLANG_VERSION if self.layout.engine == "sglang" else VLLM_VERSION

    def models(self, created: int) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": created,
            "owned_by": self.layout.engine,
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card]}

    def vllm_server_info(self) -> dict[str, Any]:
        config = self.config
        vllm_config = {
            "model_config": {
                "model": self.model_name,
                "served_model_name": self.model_name,
                "max_model_len": config.max_model_len,
            },
            "cache_config": {
                "block_size": config.block_size,
                "enable_prefix_caching": config.enable_prefix_caching,
                "num_gpu_blocks": config.num_gpu_blocks * self.layout.data_parallel,
            },
            "parallel_config": {
                "tensor_parallel_size": self.layout.tensor_parallel,
                "pipeline_parallel_size": self.layout.pipeline_parallel,
                "data_parallel_size": self.layout.data_parallel,
            },
            "scheduler_config": {
                "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "max_model_len": config.max_model_len,
            },
            "kv_events_config": self._kv_events_config(),
        }
        return {"vllm_config": vllm_config, "vllm_env": {}, "system_env": {}}

    def kv_identity(self) -> dict[str, Any]:
        """vLLM mode's /get_server_info: the facts vllm-router's kv_aware discovery reads."""
        return {
            "model_id": self.model_name,
            "model_path": self.model_name,
            "instance_id": self.instance_id,
            "kv_block_size": self.config.block_size,
            "data_parallel_size": self.layout.data_parallel,
        }

    def sglang_server_info(self, stats: Sequence[EngineStats]) -> dict[str, Any]:
        config, layout = self.config, self.layout
        server_args = {
            "model_path": self.model_name,
            "tokenizer_path": self.model_name,
            "served_model_name": self.model_name,
            "context_length": config.max_model_len,
            "tp_size": layout.tensor_parallel,
            "pp_size": layout.pipeline_parallel,
            "dp_size": layout.data_parallel,
            "page_size": config.block_size,
            "max_running_requests": config.max_num_seqs,
            "chunked_prefill_size": config.max_num_batched_tokens,
            "disable_radix_cache": not config.enable_prefix_caching,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "is_embedding": False,
            "enable_metrics": True,
        }
        scheduler_info = {
            "max_total_num_tokens": config.num_gpu_blocks * config.block_size,
            "max_req_input_len": config.max_model_len - 1,
        }
        states = [
            {
                "memory_usage": {"token_capacity": s.total_blocks * s.block_size},
                "engine_paused": s.down,
                "waiting_queue_size": s.waiting,
                "running_batch_size": s.running,
                "prefill_decode_size": s.waiting + s.running,
            }
            for s in stats
        ]
        return {**server_args, **scheduler_info, "internal_states": states, "version": self.version}

    def sglang_model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_name, "tokenizer_path": self.model_name, "is_generation": True}

    @staticmethod
    def sglang_load(stats: Sequence[EngineStats]) -> list[dict[str, int]]:
        return [
            {
                "dp_rank": rank,
                "num_reqs": s.running + s.waiting,
                "num_waiting_reqs": s.waiting,
                "num_tokens": s.used_blocks * s.block_size + s.waiting_tokens,
            }
            for rank, s in enumerate(stats)
        ]

    def _kv_events_config(self) -> dict[str, Any]:
        if not self.kv_event_endpoints:
            return {"enable_kv_cache_events": False, "publisher": "null"}
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_event_endpoints[0]}
