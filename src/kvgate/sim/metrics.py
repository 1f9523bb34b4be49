"""The simulator's /metrics page: vLLM's Prometheus names and labels, plus the simulator's own counters.

An agent scrapes it exactly as it would scrape vLLM (>= 0.10 names; `kv_cache_usage_perc` is a
fraction in [0, 1] as in vLLM). The `kvgate_sim_*` series exist only here: they let the demo count
OOM crashes and peak KV demand, which a crashed real engine could not report.
"""

from __future__ import annotations

from kvgate.sim.engine import EngineConfig, EngineStats

_GAUGE = "gauge"
_COUNTER = "counter"


def _labels(pairs: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(kind: str, name: str, help_text: str, labels: dict[str, str], value: float) -> list[str]:
    # prometheus_client (which vLLM uses) names a counter's family without the `_total` suffix.
    family = name.removesuffix("_total") if kind == _COUNTER else name
    return [
        f"# HELP {family} {help_text}",
        f"# TYPE {family} {kind}",
        f"{name}{_labels(labels)} {float(value)!r}",
    ]


def render_metrics(config: EngineConfig, stats: EngineStats, model_name: str) -> str:
    base = {"engine": "0", "model_name": model_name}
    cache_info = {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": "False",
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "num_cpu_blocks": "0",
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
    }
    sim = {"model_name": model_name}
    capacity = stats.total_blocks * stats.block_size
    return "\n".join([
        *_family(_GAUGE, "vllm:num_requests_running", "Number of requests in model execution batches.", base,
                 stats.running),
        *_family(_GAUGE, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", base,
                 stats.waiting),
        *_family(_GAUGE, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", base,
                 stats.kv_usage),
        *_family(_GAUGE, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", cache_info, 1),
        *_family(_COUNTER, "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                 base, stats.preemptions_total),
        *_family(_COUNTER, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", base,
                 stats.prompt_tokens_total),
        *_family(_COUNTER, "vllm:generation_tokens_total", "Number of generation tokens processed.", base,
                 stats.generation_tokens_total),
        *_family(_COUNTER, "vllm:request_success_total", "Count of successfully processed requests.", base,
                 stats.finished_total),
        *_family(_COUNTER, "kvgate_sim_oom_crashes_total", "Simulated CUDA OOM crashes of this node.", sim,
                 stats.oom_crashes_total),
        *_family(_GAUGE, "kvgate_sim_peak_kv_tokens",
                 "Most KV tokens the engine held or tried to hold (above capacity only at an OOM).", sim,
                 stats.peak_kv_tokens),
        *_family(_GAUGE, "kvgate_sim_kv_capacity_tokens", "KV-cache capacity of this node in tokens.", sim,
                 capacity),
    ]) + "\n"  # fmt: skip
