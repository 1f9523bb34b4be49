"""What one scrape of an engine's /metrics page says, as plain data: the readers' common answer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"
    LLAMACPP = "llamacpp"
    UNKNOWN = "unknown"  # a Prometheus page with none of the families any reader knows


class PageState(StrEnum):
    READY = "ready"  # capacity and usage published
    IDLE = "idle"  # capacity published, usage not yet (the engine has not served a request)
    NOT_READY = "not_ready"  # the engine's page holds no KV capacity yet
    NO_KV = "no_kv"  # the engine publishes no KV figures at all (TGI, llama.cpp, unknown pages)


@dataclass(frozen=True, slots=True)
class EngineReading:
    """Every engine behind one endpoint (vLLM's data-parallel engines, SGLang's DP ranks), summed.

    Unknown figures are None, never zero. `used_tokens` is 0, not None, for an IDLE engine: it holds
    nothing. `engines` names what the page showed ("engine 0", "dp 1: tp 0-3, pp 0"); `rule` says how
    capacity was read, or why it could not be.
    """

    kind: EngineKind
    state: PageState
    capacity_tokens: int | None
    used_tokens: int | None
    running: int | None
    waiting: int | None
    preemptions_total: int | None
    engines: tuple[str, ...]
    rule: str
    # While requests run, the engine refreshes its figures at least this often (its own promise):
    # figures frozen for longer mean its scheduler stopped, whatever the page's HTTP server says.
    busy_refresh_s: float | None
    # Prefix cache: tokens looked up and found, summed over engines (vLLM's counters), or the hit rate
    # of the latest prefill batch (SGLang's gauge). None where the page has none.
    prefix_queries_total: int | None = None
    prefix_hits_total: int | None = None
    cache_hit_rate: float | None = None
    # Whether the engine shares cached prompt blocks among requests (None: not known to).
    prefix_caching: bool | None = None
    # Output tokens generated, summed over engines, counted as they are generated (vLLM's counter);
    # None where the page has no such counter (SGLang counts a request's tokens when it finishes).
    generation_tokens_total: int | None = None
    # Prompt tokens the engine has taken in, summed over engines (vLLM's counter, counted as each
    # request's prefill completes, prefix-cache hits included); None where the page has none.
    prompt_tokens_total: int | None = None
    # Sums over finished requests of their prompt tokens and of their prefill time, first scheduled
    # to first token (vLLM's request histograms): the measured prefill rate, kvgate.agent.prefill_rate.
    # None where the page has none.
    finished_prompt_tokens_sum: float | None = None
    finished_prefill_seconds_sum: float | None = None
    # The longest request (prompt + output) the engine serves: not on the metrics page, but in its
    # /v1/models (kvgate.agent.sources.scrape adds it). None: not known.
    max_model_len: int | None = None

    @property
    def kv_usage(self) -> float | None:
        if self.used_tokens is None or not self.capacity_tokens:
            return None
        return self.used_tokens / self.capacity_tokens
