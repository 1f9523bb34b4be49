"""A minimal stand-in for an inference engine's /metrics endpoint, for tests, benchmarks and demos.

It serves the families a real vLLM (or SGLang) exposes, in their format, with values a test sets:
KV usage, queue lengths, preemptions. It can also answer slowly, with an HTTP error, or with a body
that is not metrics at all. The full engine simulator (`kvgate sim`) models KV growth; this only
reports what it is told.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from aiohttp import web


@dataclass(slots=True)
class FakeEngineMetrics:
    flavor: Literal["vllm", "vllm-old", "sglang"] = "vllm"
    # Blocks requests can use: a vLLM page counts one more, its null block (engines/vllm.py).
    num_gpu_blocks: int = 2500
    block_size: int = 16
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    status: int = 200
    delay_s: float = 0.0
    # When set, served instead of metrics (garbage, an HTML error page, ...).
    body: str | None = None
    scrapes: int = 0
    _runner: web.AppRunner | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0 picks a free port) and return the /metrics URL."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        return f"http://{host}:{bound}/metrics"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def render(self) -> str:
        if self.body is not None:
            return self.body
        if self.flavor == "sglang":
            used = round(self.kv_usage * self.capacity_tokens)
            return "".join(
                _family(name, "gauge", help_text, f"{{{_MODEL}}}", value)
                for name, help_text, value in (
                    ("sglang:num_used_tokens", "The number of used tokens.", f"{used}.0"),
                    (
                        "sglang:max_total_num_tokens",
                        "Maximum tokens in the KV pool.",
                        f"{self.capacity_tokens}.0",
                    ),
                    ("sglang:num_running_reqs", "The number of running requests.", f"{self.running}.0"),
                    (
                        "sglang:num_queue_reqs",
                        "The number of requests in the waiting queue.",
                        f"{self.waiting}.0",
                    ),
                    ("sglang:token_usage", "The token usage.", repr(self.kv_usage)),
                )
            )
        usage_name = "vllm:gpu_cache_usage_perc" if self.flavor == "vllm-old" else "vllm:kv_cache_usage_perc"
        labels = f'{{engine="0",{_MODEL}}}'
        cache_info = (
            f'{{block_size="{self.block_size}",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
            f'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="{self.num_gpu_blocks + 1}",'
            'num_gpu_blocks_override="None",sliding_window="None"}'
        )
        return (
            _family(
                "vllm:num_requests_running",
                "gauge",
                "Requests in execution batches.",
                labels,
                f"{self.running}.0",
            )
            + _family("vllm:num_requests_waiting", "gauge", "Requests waiting.", labels, f"{self.waiting}.0")
            + _family(
                usage_name, "gauge", "KV-cache usage. 1 means 100 percent usage.", labels, repr(self.kv_usage)
            )
            + _family(
                "vllm:num_preemptions_total",
                "counter",
                "Cumulative preemptions.",
                labels,
                f"{self.preemptions}.0",
            )
            + _family(
                "vllm:cache_config_info",
                "gauge",
                "Information of the LLMEngine CacheConfig",
                cache_info,
                "1.0",
            )
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status, text=self.render(), content_type="text/plain")


_MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'


def _family(name: str, kind: str, help_text: str, labels: str, value: str) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name}{labels} {value}\n"
