"""Nothing acknowledged is lost, and nothing runs twice at once, with real processes.

kill -9 of `kvgate queue` while jobs run, on SQLite (one replica: the restarted process requeues what
was running at once) and on PostgreSQL (the dead replica's claims run out on their lease and another
process reruns them). Then two replicas on one PostgreSQL database under load, in front of engines
that record every call: each job runs exactly once, never two calls of one job at the same time.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from postgres import PostgresServer, postgres_server

from kvgate.config.headroom import HeadroomSettings
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.processes import Service, kvgate_command, sim_command
from kvgate.harness.stack import agent_process, started
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
JOB_TOKENS = 5000  # four at a time on a node of 20,000


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


def queue_process(tmp: Path, name: str, port: int, store: str, config: Path) -> Service:
    argv = kvgate_command(
        "queue",
        *("--listen", f"127.0.0.1:{port}", "--store", store, "--config", str(config)),
        *("--metrics-listen", "off", "--replica-id", name),
    )
    return started(Service(name, argv, tmp, port=port), port)


def write_config(tmp: Path, agents: list[int], queue: str = "") -> Path:
    path = tmp / "queue.yaml"
    agent_list = ", ".join(f"127.0.0.1:{port}" for port in agents)
    path.write_text(f"headroom: {{agents: [{agent_list}]}}\nqueue: {{{queue}}}\n")
    return path


def defer(port: int, index: int, headers: dict[str, str] | None = None) -> str:
    """A job of JOB_TOKENS (the gate's header, as the gate would send it); its id."""
    all_headers = {"prefer": "respond-async", "x-kvgate-tokens": str(JOB_TOKENS), **(headers or {})}
    reply = post(port, CHAT, chat(f"job {index}", max_tokens=150), all_headers)
    assert reply.status == 202, reply
    job_id: str = reply.json()["id"]
    return job_id


def job(port: int, key: str) -> dict[str, Any]:
    found: dict[str, Any] = post(port, f"/v1/kvgate/jobs/{key}", None).json()
    return found


def all_ended(port: int, keys: list[str], timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [job(port, key) for key in keys]
        if (
            all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs)
            or time.monotonic() > deadline
        ):
            return jobs
        time.sleep(0.2)


def reserved_on(agents: list[int]) -> list[int]:
    """Tokens each agent holds in reservations now."""

    async def read() -> list[int]:
        view = HeadroomView(HeadroomSettings(agents=tuple(f"127.0.0.1:{p}" for p in agents)))
        await view.start()
        try:
            while not all(node.headroom for node in view.snapshot()):
                await view.wait_update(0.2)
            return [node.headroom.reserved_tokens for node in view.snapshot() if node.headroom]
        finally:
            await view.stop()

    return asyncio.run(read())


def simulated_node(stack: ExitStack, tmp: Path) -> int:
    """A simulated node (150 output tokens at 100/s: 1.5 s a job) behind its agent; the agent's port."""
    port = free_port()
    argv = sim_command(
        *("--listen", f"127.0.0.1:{port}", "--kv-capacity-tokens", "20000", "--model-name", "test-model"),
        *("--decode-tokens-per-s", "100", "--max-model-len", "16384"),
    )
    node = started(Service("node", argv, tmp, port=port), port)
    stack.callback(node.stop)
    endpoint = f"127.0.0.1:{port}"
    flags = ["--engine-metrics", f"http://{endpoint}/metrics", "--safety-ratio", "1.0"]
    agent = agent_process(tmp, "agent", free_port(), endpoint, flags)
    stack.callback(agent.stop)
    return agent.port


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_kill_9_mid_dispatch_loses_no_acknowledged_job(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        store = f"sqlite:///{tmp_path / 'queue.db'}"
    else:
        store = request.getfixturevalue("postgres").new_database()
    with ExitStack() as stack:
        agent = simulated_node(stack, tmp_path)
        # A short claim lease: on PostgreSQL the restarted process (a new replica) waits it out.
        config = write_config(tmp_path, [agent], "claim_lease_s: 1.5, reservation_lease_s: 2")
        port = free_port()
        first = queue_process(tmp_path, "queue-1", port, store, config)
        stack.callback(first.stop)
        keys = [defer(port, i) for i in range(8)]
        held: list[Reply | Exception] = []

        def hold() -> None:
            try:
                held.append(
                    post(
                        port,
                        CHAT,
                        chat("held", max_tokens=150),
                        {"x-request-id": "held-1", "x-kvgate-tokens": str(JOB_TOKENS)},
                        timeout=60,
                    )
                )
            except OSError as error:
                held.append(error)

        holder = threading.Thread(target=hold)
        holder.start()
        deadline = time.monotonic() + 10
        while sum(job(port, key)["status"] == "running" for key in keys) < 2:
            assert time.monotonic() < deadline, [job(port, k)["status"] for k in keys]
            time.sleep(0.05)
        until_recorded = time.monotonic() + 5
        while job(port, "held-1").get("status") is None:
            assert time.monotonic() < until_recorded
            time.sleep(0.05)
        running = [key for key in keys if job(port, key)["status"] == "running"]
        first.signal(signal.SIGKILL)
        first.process.wait(10)
        holder.join(10)
        assert isinstance(held[0], OSError) or held[0].status >= 500  # its connection went with the process

        second = queue_process(tmp_path, "queue-2", port, store, config)
        stack.callback(second.stop)
        jobs = all_ended(port, [*keys, "held-1"], timeout_s=40)
        assert [j["status"] for j in jobs] == ["succeeded"] * 9, jobs
        assert all(j["response"]["body"]["object"] == "chat.completion" for j in jobs)
        # What was running when the process died ran again (at least once), on the new process.
        rerun = [j for j in jobs if j["id"] in running]
        assert rerun and all(j["attempts"] >= 2 and j["replica"] == "queue-2" for j in rerun), rerun
        # The dead process's reservations were given back (SQLite: at start-up; PostgreSQL: on recovery).
        deadline = time.monotonic() + 5
        while reserved_on([agent]) != [0]:
            assert time.monotonic() < deadline, reserved_on([agent])
            time.sleep(0.2)


@dataclass
class Recorder:
    """Engines that answer after `delay_s` and record each call's job id, start and end."""

    ports: list[int]
    delay_s: float
    calls: list[tuple[str, float, float]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        ready = threading.Event()

        async def launch() -> None:
            for port in self.ports:
                app = web.Application()
                app.router.add_post(CHAT, self._answer)
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                self._runners.append(runner)
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(launch())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10)

    async def _answer(self, request: web.Request) -> web.Response:
        started_at = time.monotonic()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        self.calls.append((request.headers["x-kvgate-job-id"], started_at, time.monotonic()))
        return web.json_response({"object": "chat.completion"})

    def close(self) -> None:
        async def shutdown() -> None:
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def test_two_replicas_on_postgresql_run_each_job_once_and_never_twice_at_once(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    store = postgres.new_database()
    with ExitStack() as stack:
        engine_ports = [free_port(), free_port()]
        recorder = Recorder(engine_ports, delay_s=0.3)
        stack.callback(recorder.close)
        agents = []
        for i, engine in enumerate(engine_ports):
            agent = agent_process(
                tmp_path,
                f"agent-{i}",
                free_port(),
                f"127.0.0.1:{engine}",
                ["--capacity-tokens", "20000", "--safety-ratio", "1.0"],
            )
            stack.callback(agent.stop)
            agents.append(agent.port)
        config = write_config(tmp_path, agents)
        replicas = []
        for name in ("replica-a", "replica-b"):
            replica = queue_process(tmp_path, name, free_port(), store, config)
            stack.callback(replica.stop)
            replicas.append(replica)
        # 60 jobs, sent to both replicas alternately from four clients at once.
        keys: list[str] = []
        lock = threading.Lock()

        def client(offset: int) -> None:
            for i in range(offset, 60, 4):
                key = defer(replicas[i % 2].port, i)
                with lock:
                    keys.append(key)

        clients = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(30)
        jobs = all_ended(replicas[0].port, keys, timeout_s=60)
    assert len(keys) == 60 and [j["status"] for j in jobs] == ["succeeded"] * 60
    runs: dict[str, list[tuple[float, float]]] = {}
    for job_id, start, end in recorder.calls:
        runs.setdefault(job_id, []).append((start, end))
    assert sorted(runs) == sorted(keys)
    assert all(len(spans) == 1 for spans in runs.values()), {k: v for k, v in runs.items() if len(v) > 1}
    assert {j["replica"] for j in jobs} == {"replica-a", "replica-b"}
    # Four jobs of 5,000 tokens fit each 20,000-token node: never more than eight calls at once.
    assert recorder.most_in_flight <= 8
    assert recorder.most_in_flight >= 6


def test_sigterm_answers_the_clients_the_queue_holds_before_it_exits(tmp_path: Path) -> None:
    """A rolling update's SIGTERM: the replica stops taking connections, runs on until the held client's
    job has answered it (within queue.drain_s), and exits 0 with nothing held on the agent."""
    with ExitStack() as stack:
        agent = simulated_node(stack, tmp_path)
        config = write_config(tmp_path, [agent])
        port = free_port()
        queue = queue_process(tmp_path, "queue-1", port, f"sqlite:///{tmp_path / 'queue.db'}", config)
        stack.callback(queue.stop)
        held: list[Reply | Exception] = []

        def hold() -> None:
            try:
                headers = {"x-request-id": "held-1", "x-kvgate-tokens": str(JOB_TOKENS)}
                held.append(post(port, CHAT, chat("held", max_tokens=150), headers, timeout=60))
            except OSError as error:
                held.append(error)

        holder = threading.Thread(target=hold)
        holder.start()
        deadline = time.monotonic() + 20
        while job(port, "held-1").get("status") != "running":
            assert time.monotonic() < deadline, job(port, "held-1")
            time.sleep(0.05)
        queue.signal(signal.SIGTERM)
        holder.join(30)
        (answer,) = held
        assert isinstance(answer, Reply) and answer.status == 200, answer
        assert answer.json()["object"] == "chat.completion"
        assert queue.process.wait(30) == 0
        assert reserved_on([agent]) == [0]
