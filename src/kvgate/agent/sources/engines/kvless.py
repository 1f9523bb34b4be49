"""Engines whose pages hold no KV-cache figures: only their request counts are read.

- Text Generation Inference: gauges `tgi_batch_current_size` (requests in the running batch) and
  `tgi_queue_size` (requests waiting), set by its router (huggingface/text-generation-inference,
  router/src/server.rs describe_gauge; backends/v3/src/queue.rs and backend.rs set them).
- llama.cpp's server: gauges `llamacpp:requests_processing` (busy slots) and
  `llamacpp:requests_deferred` (tasks waiting for a slot), on /metrics with --metrics
  (ggml-org/llama.cpp, tools/server/server.cpp, handle_metrics). Builds of 2024 also wrote
  `llamacpp:kv_cache_usage_ratio`; current ones write no KV figure.
Capacity has to come from the operator (--capacity-tokens): the agent then runs reservation-only.
"""

from __future__ import annotations

from kvgate.agent.sources.engines import promtext
from kvgate.agent.sources.engines.reading import EngineKind, EngineReading, PageState

_ENGINES = (
    (EngineKind.TGI, "tgi_batch_current_size", "tgi_queue_size"),
    (EngineKind.LLAMACPP, "llamacpp:requests_processing", "llamacpp:requests_deferred"),
)


def read(text: str) -> EngineReading | None:
    """The page as TGI's or llama.cpp's, or None when it is neither."""
    for kind, running_name, waiting_name in _ENGINES:
        running = promtext.samples(text, running_name)
        waiting = promtext.samples(text, waiting_name)
        if running or waiting:
            return EngineReading(
                kind,
                PageState.NO_KV,
                None,
                None,
                _sum(running, running_name),
                _sum(waiting, waiting_name),
                None,
                (),
                f"{kind.value} publishes no KV-cache figures",
                None,
            )
    return None


def _sum(found: list[promtext.Sample], name: str) -> int | None:
    return round(sum(promtext.finite(s, name) for s in found)) if found else None
