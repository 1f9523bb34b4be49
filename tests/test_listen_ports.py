"""One process per port (kvgate.listening): a second agent, queue or gate on a taken port exits 2 with
one line naming it, a gate's own workers still share theirs, and a port that is no port is a config
error naming its flag or key."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import PATIENCE_S, until

from kvgate.agent.cli import register as register_agent
from kvgate.agent.cli import settings_from_args
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.cli import main
from kvgate.config import parse_config
from kvgate.errors import ConfigError, ListenError
from kvgate.harness.processes import Service, kvgate_command
from kvgate.harness.stack import started
from kvgate.listening import check_listen
from kvgate.localports import free_port

NOT_PORTS = ("127.0.0.1:99999", "127.0.0.1", "127.0.0.1:abc")


def agent_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_agent(parser.add_subparsers())
    return parser.parse_args(["agent", "--endpoint", "127.0.0.1:8000", "--capacity-tokens", "1000", *argv])


@pytest.mark.parametrize("address", NOT_PORTS)
def test_a_port_that_is_no_port_is_a_config_error_naming_its_flag_or_key(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    in_range = r"\(a port from 1 to 65535\)"
    with pytest.raises(ConfigError, match=r"^--listen: .*\(a port from 0 to 65535\)"):
        settings_from_args(agent_args("--listen", address))
    with pytest.raises(ConfigError, match=rf"^--metrics-listen: .*{in_range}"):
        settings_from_args(agent_args("--listen", "127.0.0.1:0", "--metrics-listen", address))
    with pytest.raises(ConfigError, match=rf"server.listen: .*{in_range}"):
        parse_config(f"server: {{listen: '{address}'}}\n")
    for flag in ("--listen", "--metrics-listen"):
        assert main(["gate", flag, address]) == 2
        assert re.match(rf"kvgate: configuration error: {flag}: .*{in_range}", capsys.readouterr().err)


def test_the_agent_alone_may_listen_on_port_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tests and the demo start agents on port 0 and read the port they got; the gate and the queue
    have no such reader: Envoy and the gate's own workers find them where their config says."""
    assert settings_from_args(agent_args("--listen", "127.0.0.1:0")).node
    with pytest.raises(ConfigError, match=r"server.listen: .*\(a port from 1 to 65535\)"):
        parse_config("server: {listen: '127.0.0.1:0'}\n")
    config = tmp_path / "kvgate.yaml"
    config.write_text("headroom: {agents: ['127.0.0.1:9100']}\n")
    store = f"sqlite:///{tmp_path / 'queue.db'}"
    assert main(["gate", "--listen", "127.0.0.1:0"]) == 2
    assert main(["queue", "--listen", "127.0.0.1:0", "--config", str(config), "--store", store]) == 2
    refused = "kvgate: configuration error: --listen: expected host:port, got '127.0.0.1:0' (a port from 1"
    assert [line[: len(refused)] for line in capsys.readouterr().err.splitlines()] == [refused, refused]


def test_the_probe_sees_a_listener_that_shares_its_port() -> None:
    """What a gRPC server with its default options looks like to a second one."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ListenError, match=rf"^--listen 127.0.0.1:{port}: port {port} is in use"):
            check_listen("127.0.0.1", port, "--listen")
    check_listen("127.0.0.1", port, "--listen")  # free again


def test_two_agents_in_one_process_do_not_share_a_port() -> None:
    """The bind itself refuses, without the command's probe: gRPC's SO_REUSEPORT is off."""
    settings = NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=1000)

    async def scenario() -> None:
        first = Agent(settings)
        port = await first.start("127.0.0.1:0")
        try:
            with pytest.raises(ListenError, match=rf"^--listen 127.0.0.1:{port}: cannot listen there"):
                await Agent(settings).start(f"127.0.0.1:{port}")
        finally:
            await first.stop(grace_s=0.1)

    asyncio.run(scenario())


def second(*argv: str) -> tuple[int, list[str]]:
    """`kvgate ARGV` run to its end: its exit code and the lines it wrote to stderr."""
    command = kvgate_command(*argv)
    done = subprocess.run(command, capture_output=True, text=True, timeout=PATIENCE_S * 3, check=False)
    return done.returncode, done.stderr.splitlines()


def in_use(port: int) -> list[str]:
    return [f"kvgate: --listen 127.0.0.1:{port}: port {port} is in use by another process"]


@pytest.fixture
def holder() -> Iterator[list[Service]]:
    """The first processes, stopped at the end."""
    services: list[Service] = []
    yield services
    for service in services:
        service.stop()


@pytest.mark.slow
def test_a_second_agent_on_a_taken_port_exits_2_naming_it(tmp_path: Path, holder: list[Service]) -> None:
    port, metrics = free_port(), free_port()
    argv = ("agent", "--listen", f"127.0.0.1:{port}", "--endpoint", "127.0.0.1:8000", "--nvml", "off")
    argv += ("--capacity-tokens", "1000", "--metrics-listen", f"127.0.0.1:{metrics}")
    first = started(Service("agent", kvgate_command(*argv), tmp_path, port=port), port, metrics)
    holder.append(first)
    # The README's block pasted twice: both its ports are taken, and one line says so.
    assert second(*argv) == (2, in_use(port))
    first.check_alive()


@pytest.mark.slow
def test_a_second_queue_on_a_taken_port_exits_2_naming_it(tmp_path: Path, holder: list[Service]) -> None:
    port = free_port()
    config = tmp_path / "kvgate.yaml"
    config.write_text(f"headroom: {{agents: ['127.0.0.1:{free_port()}']}}\n")

    def queue(store: str) -> tuple[str, ...]:
        argv = ("queue", "--listen", f"127.0.0.1:{port}", "--config", str(config), "--metrics-listen", "off")
        return (*argv, "--store", f"sqlite:///{tmp_path / store}")

    holder.append(started(Service("queue", kvgate_command(*queue("first.db")), tmp_path, port=port), port))
    assert second(*queue("second.db")) == (2, in_use(port))
    holder[0].check_alive()


def gate(port: int, *extra: str) -> tuple[str, ...]:
    return ("gate", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "off", *extra)


@pytest.mark.slow
def test_a_second_gate_on_a_taken_port_exits_2_naming_it(tmp_path: Path, holder: list[Service]) -> None:
    port = free_port()
    holder.append(started(Service("gate", kvgate_command(*gate(port)), tmp_path, port=port), port))
    until(lambda: f"gate listening on 127.0.0.1:{port} (plaintext," in holder[0].log(), "the start line")
    assert second(*gate(port)) == (2, in_use(port))
    holder[0].check_alive()


def listeners(port: int) -> int:
    """Sockets listening on `port` in this network namespace (Linux's /proc/net/tcp{,6})."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            count += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return count


@pytest.mark.slow
def test_a_gates_workers_share_its_port_and_no_one_else_does(tmp_path: Path, holder: list[Service]) -> None:
    port = free_port()
    first = Service("gate", kvgate_command(*gate(port, "--workers", "2")), tmp_path, port=port)
    holder.append(first)
    until(lambda: listeners(port) == 2, "both workers listening on the gate's port")
    assert second(*gate(port)) == (2, in_use(port))
    # Another gate's workers would share the port with these (both ask to): its supervisor checks the
    # port before it starts any.
    assert second(*gate(port, "--workers", "2")) == (2, in_use(port))
    assert listeners(port) == 2
    first.check_alive()
    assert "restarting" not in first.log()
