"""Real processes on 127.0.0.1 for end-to-end tests: Envoy, the gate, and tiny recording upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENVOY_YAML = ROOT / "envoy" / "envoy.yaml"
LOCAL_PORTS = {
    "listener": 10000,
    "gate": 9002,
    "interactive": 8001,
    "long": 8002,
    "async": 8003,
    "admin": 9901,
}


def wait_for_port(port: int, timeout: float = 15.0, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Received:
    pool: str
    path: str
    headers: dict[str, str]
    body_bytes: int


@dataclass
class Upstreams:
    """One aiohttp server per pool, on a background thread, recording every request it receives."""

    ports: dict[str, int]
    received: list[Received] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    max_in_flight: dict[str, int] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runners: list[web.AppRunner] = field(default_factory=list)

    def start(self) -> None:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def launch() -> None:
            for pool, port in self.ports.items():
                app = web.Application(client_max_size=64 * 1024 * 1024)
                app.router.add_route("*", "/{tail:.*}", self._handler(pool))
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                self._runners.append(runner)
            ready.set()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(launch())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)

    def _handler(self, pool: str) -> Any:
        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            headers = {k.lower(): v for k, v in request.headers.items()}
            self.received.append(Received(pool, request.path, headers, len(body)))
            self.in_flight[pool] = self.in_flight.get(pool, 0) + 1
            self.max_in_flight[pool] = max(self.max_in_flight.get(pool, 0), self.in_flight[pool])
            try:
                delay = float(headers.get("x-test-delay", "0"))
                if delay:
                    await asyncio.sleep(delay)
            finally:
                self.in_flight[pool] -= 1
            return web.json_response({"pool": pool, "body_bytes": len(body)})

        return handle

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()


def render_envoy(ports: dict[str, int], path: Path, source: Path = ENVOY_YAML) -> Path:
    """The shipped Envoy config with its local ports remapped to free ones."""
    remap = {LOCAL_PORTS[name]: port for name, port in ports.items()}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "port_value" in node and node["port_value"] in remap:
                node["port_value"] = remap[node["port_value"]]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        return node

    path.write_text(yaml.safe_dump(walk(yaml.safe_load(source.read_text()))))
    return path


class Service:
    """A child process with its output in a log file, stopped for sure at the end."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.port = 0
        self.metrics_port = 0
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int:
        self.signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(5)
        self._log.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(
    port: int, path: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 30
) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        all_headers = {"content-type": "application/json", **(headers or {})}
        conn.request("POST" if body is not None else "GET", path, body=body, headers=all_headers)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def post_until_admitted(port: int, body: bytes, timeout: float = 10.0) -> Reply:
    """POST a chat until it is answered 200 or `timeout` s pass; the last reply. A gate's first
    Subscribe to its agents may still be in its (TLS) handshake: 429/503 until it sees them."""
    deadline = time.monotonic() + timeout
    while True:
        reply = post(port, "/v1/chat/completions", body)
        if reply.status == 200 or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


def chat(text: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": "test-model", "messages": [{"role": "user", "content": text}], **extra}
    ).encode()


@contextlib.contextmanager
def gate_process(config_text: str, tmp: Path, port: int, extra: list[str] | None = None) -> Iterator[Service]:
    config = tmp / "kvgate.yaml"
    config.write_text(config_text)
    metrics_port = free_port()
    argv = [
        str(BIN / "kvgate"),
        "gate",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{port}",
        "--metrics-listen",
        f"127.0.0.1:{metrics_port}",
        *(extra or []),
    ]
    gate = Service("gate", argv, tmp)
    gate.metrics_port = metrics_port
    try:
        wait_for_port(port, process=gate.process)
        yield gate
    finally:
        gate.stop()


def agent_process(tmp: Path, name: str, port: int, endpoint: str, extra: list[str]) -> Service:
    metrics_port = free_port()
    agent = Service(
        name,
        [
            str(BIN / "kvgate"),
            "agent",
            "--listen",
            f"127.0.0.1:{port}",
            "--endpoint",
            endpoint,
            "--nvml",
            "off",
            "--node-name",
            name,
            "--metrics-listen",
            f"127.0.0.1:{metrics_port}",
            *extra,
        ],
        tmp,
    )
    agent.port = port
    agent.metrics_port = metrics_port
    _started(agent, port)
    return agent


def envoy_process(config: Path, tmp: Path, admin_port: int, listener_port: int) -> Service:
    envoy = Service(
        "envoy",
        [str(BIN / "envoy"), "-c", str(config), "--disable-hot-restart", "--log-level", "warning"],
        tmp,
    )
    _started(envoy, admin_port, listener_port)
    return envoy


def _started(service: Service, *ports: int) -> None:
    """Wait until `service` listens on every port; a service that fails to start is stopped (its log
    closed) and its log's tail is in the error."""
    try:
        for port in ports:
            wait_for_port(port, process=service.process)
    except (RuntimeError, TimeoutError) as error:
        service.stop()
        raise RuntimeError(f"{service.name} did not start: {error}\n{service.log()[-2000:]}") from error
