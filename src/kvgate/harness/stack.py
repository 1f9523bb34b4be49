"""The gate, an agent and Envoy as child processes on 127.0.0.1: started, waited for, stopped.

Each starter waits until its process listens; one that fails to start is stopped and ChildError
carries its log's tail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvgate.harness.processes import ChildError, Service, find_envoy, kvgate_command
from kvgate.localports import free_port


def started(service: Service, *ports: int, timeout_s: float = 30.0) -> Service:
    """`service` once it listens on every port; stopped, with ChildError, if it does not."""
    try:
        service.wait_listening(*ports, timeout_s=timeout_s)
    except ChildError:
        service.stop()
        raise
    return service


@contextlib.contextmanager
def gate_process(config_text: str, log_dir: Path, port: int, extra: Sequence[str] = ()) -> Iterator[Service]:
    """`kvgate gate` with `config_text` as its kvgate.yaml (its listen address overridden to `port`)."""
    config = log_dir / "kvgate.yaml"
    config.write_text(config_text, encoding="utf-8")
    metrics_port = free_port()
    argv = kvgate_command(
        "gate",
        *("--config", str(config), "--listen", f"127.0.0.1:{port}"),
        *("--metrics-listen", f"127.0.0.1:{metrics_port}"),
        *extra,
    )
    gate = started(Service("gate", argv, log_dir, port=port, metrics_port=metrics_port), port)
    try:
        yield gate
    finally:
        gate.stop()


def agent_process(log_dir: Path, name: str, port: int, endpoint: str, extra: Sequence[str]) -> Service:
    """`kvgate agent` for the engine at `endpoint`, without NVML, with its own metrics port."""
    metrics_port = free_port()
    argv = kvgate_command(
        "agent",
        *("--listen", f"127.0.0.1:{port}", "--endpoint", endpoint, "--nvml", "off"),
        *("--node-name", name, "--metrics-listen", f"127.0.0.1:{metrics_port}"),
        *extra,
    )
    return started(Service(name, argv, log_dir, port=port, metrics_port=metrics_port), port)


def envoy_process(config: Path, log_dir: Path, admin_port: int, listener_port: int) -> Service:
    argv = [str(find_envoy()), "-c", str(config), "--disable-hot-restart", "--log-level", "warning"]
    return started(Service("envoy", argv, log_dir, port=listener_port), admin_port, listener_port)
