"""Engine readers: an inference engine's Prometheus page to the KV figures the headroom needs.

Pure (no I/O); one module per engine, each with the rules it takes from that engine's source:
    vllm      vLLM: per-engine usage, the DP-summed cache_config_info, kv_cache_size_tokens
    sglang    SGLang: one pool per dp_rank, repeated by every TP/PP rank; gauges that appear late
    kvless    TGI and llama.cpp: request counts only, no KV figures
    promtext  the shared reader: one family at a time, by substring search
    reading   EngineReading, what every reader answers

`read_engine_page` tries each reader in turn. A page none of them knows is still an answer (kind
UNKNOWN, naming its first metrics); text that is not a Prometheus page at all raises HeadroomError.
"""

from __future__ import annotations

from kvgate.agent.sources.engines import kvless, promtext, sglang, vllm
from kvgate.agent.sources.engines.reading import EngineKind, EngineReading, PageState
from kvgate.errors import HeadroomError

__all__ = ["EngineKind", "EngineReading", "PageState", "read_engine_page"]

_READERS = (vllm.read, sglang.read, kvless.read)
_NAMES_SHOWN = 5


def read_engine_page(text: str) -> EngineReading:
    for reader in _READERS:
        reading = reader(text)
        if reading is not None:
            return reading
    names = promtext.metric_names(text, _NAMES_SHOWN)
    if not names:
        raise HeadroomError(
            f"engine metrics: not a Prometheus text page ({len(text)} chars, "
            f"first line {promtext.first_line(text)!r})"
        )
    return EngineReading(
        EngineKind.UNKNOWN,
        PageState.NO_KV,
        None,
        None,
        None,
        None,
        None,
        (),
        f"unrecognised engine page (first metric names: {', '.join(names)})",
        None,
    )
