"""The simulator's /metrics page: the engine it speaks as, rendered as that engine renders it.

`VllmPage` (kvgate.sim.vllm_page) and `SglangPage` (kvgate.sim.sglang_page) take the engine models'
stats; the server calls `stepped` after every engine step (SGLang writes its gauges on its own
cadence), `finished` when a request ends, and `render` on every scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate.sim.engine import EngineConfig, EngineStats
from kvgate.sim.layout import Layout
from kvgate.sim.sglang_page import SglangPage
from kvgate.sim.vllm_page import VllmPage

MetricsPage = VllmPage | SglangPage


def metrics_page(
    config: EngineConfig, layout: Layout, model_name: str, clock: Callable[[], float] = time.monotonic
) -> MetricsPage:
    if layout.engine == "sglang":
        return SglangPage(config, layout, model_name, clock)
    return VllmPage(config, layout, model_name)


def render_metrics(config: EngineConfig, stats: EngineStats, model_name: str) -> str:
    """One vLLM engine's page for these stats, rendered once."""
    return VllmPage(config, Layout(), model_name).render([stats])
