"""The routers kvgate is compared with, run as they ship: found, started on 127.0.0.1, stopped for sure.

`make peers` (scripts/peers.sh) installs PyPI's `smg` (SGLang Model Gateway) and `vllm-router` into
`.venv-peers` beside the checkout. `find_peer` locates a binary there, or says plainly why it cannot;
`peer_router` starts one router with a policy in front of worker URLs and waits, with a generous
timeout, until its /readiness answers 200 with every worker healthy. A router that exits first, or
never gets there, fails with ChildError and the end of its log; leaving the `with` block stops its
whole process group.

What each router is given, read from its --help and source defaults:
- Every listener on loopback: `--host 127.0.0.1` (smg binds 0.0.0.0 by default), a Prometheus port of
  its own on 127.0.0.1 (both default to 29000, so two routers would collide).
- smg: `--load-monitor-interval 1`, so the engines' /metrics are polled every second instead of
  every 10 s (running, waiting, KV usage feed its load-aware policies and its overload guard).
- vllm-router `kv_aware`: its HTTP discovery reads /get_server_info and /kv_event_sources but, in
  0.1.17, spawns no subscriber for an HTTP worker; the KV-event feed reaches it only through its
  static flags (`--kv-event-source URL=ENDPOINT` per worker, `--kv-event-model`,
  `--kv-event-block-size`). `kv_event_flags` reads them from the workers, as a user would from
  their engines' /kv_event_sources and block size.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from kvgate.harness.processes import ChildError, Service, checkout_path
from kvgate.localports import free_ports

PeerName = Literal["smg", "vllm-router"]
PEERS_VENV = ".venv-peers"
# The policies that fit a comparison on OpenAI-compatible workers (each router's --help lists more).
POLICIES: dict[PeerName, tuple[str, ...]] = {
    "smg": ("cache_aware", "prefix_hash", "power_of_two", "least_load", "round_robin"),
    "vllm-router": ("round_robin", "power_of_two", "consistent_hash", "cache_aware", "kv_aware"),
}
_STOP_GRACE_S = 10.0
_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class PeerLookup:
    """A peer router's binary, or (`path` None) the plain reason it is not here."""

    name: PeerName
    path: Path | None
    reason: str = ""


def find_peer(name: PeerName) -> PeerLookup:
    try:
        venv = checkout_path(PEERS_VENV)
    except ChildError:
        return PeerLookup(name, None, f"no {PEERS_VENV} in the kvgate checkout: run `make peers`")
    binary = venv / "bin" / name
    if not os.access(binary, os.X_OK):
        return PeerLookup(name, None, f"{binary} is missing or not executable: run `make peers` again")
    return PeerLookup(name, binary)


def peer_argv(
    binary: Path, name: PeerName, policy: str, workers: Sequence[str], *, port: int, metrics_port: int
) -> list[str]:
    """The command line of one router on 127.0.0.1:`port` in front of `workers`."""
    if policy not in POLICIES[name]:
        raise ValueError(f"{name} is not compared in policy {policy!r}; choose from {POLICIES[name]}")
    common = [
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--worker-urls", *workers),
        *("--policy", policy),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
    ]
    if name == "smg":
        return [str(binary), "launch", *common, "--load-monitor-interval", "1"]
    return [str(binary), *common]


def kv_event_flags(workers: Sequence[str]) -> list[str]:
    """vllm-router's static KV-event flags for `workers`, from their /kv_event_sources and
    /get_server_info; ChildError when a worker publishes no events (start it with a KV-event endpoint)."""
    flags: list[str] = []
    identities = set()
    for worker in workers:
        ranks = _get_json(worker, "/kv_event_sources")
        if not isinstance(ranks, dict) or not ranks:
            raise ChildError(f"{worker} publishes no KV events (its /kv_event_sources is {ranks!r})")
        host = urlsplit(worker).hostname or "127.0.0.1"
        endpoints = [connectable_endpoint(ranks[rank]["endpoint"], host) for rank in sorted(ranks, key=int)]
        flags += ["--kv-event-source", f"{worker}={','.join(endpoints)}"]
        info = _get_json(worker, "/get_server_info")
        identities.add((str(info["model_id"]), int(info["kv_block_size"])))
    if len(identities) != 1:
        raise ChildError(f"the workers disagree on model or block size: {sorted(identities)}")
    ((model, block_size),) = identities
    return [*flags, "--kv-event-model", model, "--kv-event-block-size", str(block_size)]


def connectable_endpoint(endpoint: str, host: str) -> str:
    """A bound wildcard address (tcp://*:P, tcp://0.0.0.0:P) as the worker's host, as vllm-router's own
    discovery rewrites it (its static flags refuse unspecified hosts)."""
    scheme, _, rest = endpoint.partition("://")
    address, _, port = rest.rpartition(":")
    return f"{scheme}://{host}:{port}" if address in ("*", "0.0.0.0", "[::]") else endpoint


@dataclass
class PeerRouter:
    """A started router: where it listens and its process."""

    name: PeerName
    policy: str
    workers: tuple[str, ...]
    service: Service

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def metrics_port(self) -> int:
        return self.service.metrics_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int | None:
        """SIGTERM to its process group, SIGKILL after a grace period; its exit code."""
        process = self.service.process
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(_STOP_GRACE_S)
        # Whatever it started in its group goes with it.
        _signal_group(process, signal.SIGKILL)
        return process.returncode


@contextlib.contextmanager
def peer_router(
    name: PeerName,
    policy: str,
    workers: Sequence[str],
    log_dir: Path,
    *,
    extra: Sequence[str] = (),
    timeout_s: float = 120.0,
) -> Iterator[PeerRouter]:
    """Router `name` in `policy` in front of `workers`, ready (every worker healthy) when yielded."""
    lookup = find_peer(name)
    if lookup.path is None:
        raise ChildError(lookup.reason)
    port, metrics_port = free_ports(2)
    argv = [*peer_argv(lookup.path, name, policy, workers, port=port, metrics_port=metrics_port), *extra]
    service = Service(f"{name}-{policy}", argv, log_dir, port=port, metrics_port=metrics_port)
    router = PeerRouter(name, policy, tuple(workers), service)
    try:
        wait_ready(router, timeout_s)
        yield router
    finally:
        router.stop()


def wait_ready(router: PeerRouter, timeout_s: float = 120.0) -> None:
    """Until /readiness answers 200 with every worker healthy; ChildError if the router dies first or
    is not ready after `timeout_s` (both routers answer {"status", "healthy_workers", "total_workers"})."""
    deadline = time.monotonic() + timeout_s
    last: object = "no answer"
    while True:
        router.service.check_alive()
        with contextlib.suppress(OSError, ValueError):
            status, body = _get(router.port, "/readiness")
            last = f"{status} {body[:200]!r}"
            answer = json.loads(body) if status == 200 else {}
            if isinstance(answer, dict) and answer.get("healthy_workers") == len(router.workers):
                return
        if time.monotonic() > deadline:
            raise ChildError(
                f"{router.service.name} was not ready after {timeout_s:g} s (last /readiness: {last}):\n"
                f"{router.service.log_tail()}"
            )
        time.sleep(_POLL_S)


def _get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _get_json(url: str, path: str) -> Any:
    parts = urlsplit(url)
    try:
        status, body = _get(parts.port or 80, path, parts.hostname or "127.0.0.1")
    except OSError as exc:
        raise ChildError(f"GET {url}{path}: {exc}") from exc
    if status != 200:
        raise ChildError(f"GET {url}{path}: {status} {body[:200]!r}")
    return json.loads(body)


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    # The child leads a session of its own (processes.Service), so its pid is its process group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
