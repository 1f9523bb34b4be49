"""parse_engine_metrics against vLLM and SGLang /metrics pages, and against garbage."""

from __future__ import annotations

import time

import pytest

from kvgate.errors import HeadroomError
from kvgate.headroom.engine_metrics import parse_engine_metrics

M = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'

# Shape of a vLLM 0.11 V1 page (trimmed): histograms and counters around the families we read.
VLLM_V1 = f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{M}}} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{M}}} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{M}}} 0.4375
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",{M}}} 123904.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",{M}}} 3.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{{engine="0",{M}}} 1.7640e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",{M}}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{M}}} 120.0
vllm:time_to_first_token_seconds_count{{engine="0",{M}}} 120.0
vllm:time_to_first_token_seconds_sum{{engine="0",{M}}} 9.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",kv_sharing_fast_prefill="False",mamba_cache_dtype="auto",num_cpu_blocks="None",num_gpu_blocks="27485",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"}} 1.0
"""  # noqa: E501

# vLLM 0.6 (V0): gpu_cache_usage_perc, no engine label, no preemptions family under that name.
VLLM_V0 = f"""# HELP vllm:cache_config_info information of cache_config
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",cpu_offload_gb="0",enable_prefix_caching="False",gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="2000",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"}} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M}}} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{M}}} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{M}}} 0.5
"""  # noqa: E501

SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 51200.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 0.25
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="Qwen/Qwen2.5-7B-Instruct",pp_rank="0",tp_rank="0"} 204800.0
"""  # noqa: E501


def test_vllm_v1_page() -> None:
    stats = parse_engine_metrics(VLLM_V1)
    assert stats.engine == "vllm"
    assert stats.capacity_tokens == 27485 * 16
    assert stats.kv_usage == 0.4375
    assert stats.used_tokens == round(0.4375 * 27485 * 16)
    assert (stats.running, stats.waiting, stats.preemptions_total) == (7, 2, 3)


def test_vllm_v0_page_uses_the_old_usage_name() -> None:
    stats = parse_engine_metrics(VLLM_V0)
    assert (stats.capacity_tokens, stats.used_tokens, stats.kv_usage) == (32_000, 16_000, 0.5)
    assert stats.preemptions_total is None  # absent, so unknown rather than zero


def test_vllm_data_parallel_engines_add_up() -> None:
    second = VLLM_V1.replace('engine="0"', 'engine="1"').replace("0.4375", "0.0625")
    stats = parse_engine_metrics(VLLM_V1 + second)
    assert stats.capacity_tokens == 2 * 27485 * 16
    assert stats.kv_usage == pytest.approx(0.25)
    assert (stats.running, stats.waiting, stats.preemptions_total) == (14, 4, 6)


def test_vllm_without_cache_info_has_unknown_capacity() -> None:
    text = "\n".join(line for line in VLLM_V1.splitlines() if "cache_config_info" not in line)
    stats = parse_engine_metrics(text)
    assert stats.kv_usage == 0.4375
    assert stats.capacity_tokens is None and stats.used_tokens is None


def test_sglang_page() -> None:
    stats = parse_engine_metrics(SGLANG)
    assert stats.engine == "sglang"
    assert (stats.capacity_tokens, stats.used_tokens, stats.kv_usage) == (204_800, 51_200, 0.25)
    assert (stats.running, stats.waiting, stats.preemptions_total) == (4, 3, None)


def test_crlf_and_timestamps_are_accepted() -> None:
    text = VLLM_V0.replace("} 0.5\n", "} 0.5 1764000000000\n").replace("\n", "\r\n")
    assert parse_engine_metrics(text).kv_usage == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "neither"),
        ("<html><body>502 Bad Gateway</body></html>", "neither"),
        ("\x00\x01\x02\xff binary", "neither"),
        ('vllm:kv_cache_usage_perc{engine="0"', "cannot parse"),
        ('vllm:kv_cache_usage_perc{engine="0"} zero\n', "cannot parse"),
        ('vllm:kv_cache_usage_perc{engine="0"} NaN\n', "finite"),
        ('vllm:kv_cache_usage_perc{engine="0"} 43.75\n', "beyond 1"),
        ("vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running -1\n", "finite value >= 0"),
        ('vllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{block_size="16"} 1.0\n', "num_gpu_blocks"),
        (
            'vllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{num_gpu_blocks="None",block_size="16"} 1\n',
            "integer",
        ),
    ],
)
def test_garbage_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(HeadroomError, match=message):
        parse_engine_metrics(text)


def test_a_big_page_parses_in_well_under_a_millisecond() -> None:
    buckets = "".join(
        f'vllm:request_prompt_tokens_bucket{{engine="0",le="{2**i}.0",{M}}} {i}.0\n' for i in range(20)
    )
    page = buckets * 60 + VLLM_V1  # ~100 KB, most of it histogram buckets, as on a busy vLLM
    assert len(page) > 100_000
    parse_engine_metrics(page)
    start = time.perf_counter()
    for _ in range(50):
        parse_engine_metrics(page)
    per_parse = (time.perf_counter() - start) / 50
    assert per_parse < 0.002, f"{per_parse * 1e3:.3f} ms per parse"
