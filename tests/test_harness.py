"""The one harness of the demo, the tests and the benchmarks: processes and Envoy configs."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from leftovers import alive
from test_demo_envoy import envoy_accepts
from waiting import until

from kvgate.demo.envoy_config import write_yaml
from kvgate.harness.envoy import LOCAL_PORTS, render_envoy
from kvgate.harness.processes import ChildError, ProcessGroup, find_envoy
from kvgate.localports import free_ports

ENVOY_DIR = Path(__file__).resolve().parent.parent / "envoy"


def ports_of(cluster: dict[str, Any]) -> list[int]:
    return [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]


def test_a_child_that_exits_early_fails_with_its_log(tmp_path: Path) -> None:
    async def case() -> None:
        with ProcessGroup(tmp_path) as group:
            broken = group.start(
                "broken", [sys.executable, "-c", "print('bad flag --nope'); raise SystemExit(3)"]
            )
            with pytest.raises(ChildError, match=r"(?s)broken exited with code 3.*bad flag --nope"):
                await broken.listening(free_ports(1)[0], timeout_s=10)
            with pytest.raises(ChildError, match="broken exited with code 3"):
                group.check_alive()

    asyncio.run(case())


@pytest.mark.slow
def test_children_are_ready_when_listening_and_stopped_on_exit(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    server = f"import socket, time; s = socket.create_server(('127.0.0.1', {port})); time.sleep(60)"
    # Ignores SIGTERM: the group must escalate to SIGKILL after its grace period.
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"

    started = time.monotonic()
    with ProcessGroup(tmp_path) as group:
        listening = group.start("server", [sys.executable, "-c", server])
        stuck = group.start("stubborn", [sys.executable, "-c", stubborn])
        listening.wait_listening(port, timeout_s=10)
        group.check_alive()
    assert not listening.alive and not stuck.alive
    assert time.monotonic() - started < 20


def test_what_a_killed_child_left_in_its_session_goes_with_it(tmp_path: Path) -> None:
    """A child killed before it could stop its own workers (a gate and its token counter, say):
    stopping it ends what is left of the process group it leads."""
    parent = (
        "import subprocess, sys, time; "
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(worker.pid, flush=True); time.sleep(600)"
    )
    with ProcessGroup(tmp_path) as group:
        child = group.start("parent", [sys.executable, "-c", parent])
        (worker,) = map(int, until(lambda: child.log().split(), "the worker's pid"))
        child.signal(signal.SIGKILL)
        child.process.wait(10)
        assert alive(worker), "orphaned: nothing stopped it yet"
    until(lambda: not alive(worker), "the worker to end with its parent's process group")


def test_envoy_binary_is_found() -> None:
    assert find_envoy().is_file()


def test_render_envoy_moves_the_local_layout_and_spreads_pools(tmp_path: Path) -> None:
    ports = {"listener": 20000, "admin": 20001, "gate": 20002, "interactive": [21000], "long": [21001, 21002]}
    config = yaml.safe_load(render_envoy(ENVOY_DIR / "envoy.yaml", tmp_path / "e.yaml", ports).read_text())
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert ports_of(clusters["kvgate_gate"]) == [20002]
    assert ports_of(clusters["interactive"]) == [21000]
    assert ports_of(clusters["long_context"]) == [21001, 21002]
    assert ports_of(clusters["async"]) == [LOCAL_PORTS["async"]], "not named: left as shipped"
    assert config["admin"]["address"]["socket_address"]["port_value"] == 20001
    original = yaml.safe_load((ENVOY_DIR / "envoy.yaml").read_text())
    listener, shipped = (
        config["static_resources"]["listeners"][0],
        original["static_resources"]["listeners"][0],
    )
    assert listener["address"]["socket_address"]["port_value"] == 20000
    assert listener["filter_chains"] == shipped["filter_chains"], "everything else is the repository's"


def test_a_config_off_the_local_layout_is_refused_by_name(tmp_path: Path) -> None:
    other = write_yaml({"static_resources": {"clusters": []}}, tmp_path / "other.yaml")
    with pytest.raises(ChildError, match="no port for gate, listener"):
        render_envoy(other, tmp_path / "out.yaml", {"gate": 1, "listener": 2})
    with pytest.raises(ValueError, match="no local port named"):
        render_envoy(ENVOY_DIR / "envoy.yaml", tmp_path / "out.yaml", {"gateway": 1})


@pytest.mark.slow
def test_real_envoy_accepts_a_spread_config(tmp_path: Path) -> None:
    ports = {"listener": 20000, "admin": 20001, "gate": 20002, "interactive": [21000, 21003], "async": []}
    path = render_envoy(ENVOY_DIR / "envoy.yaml", tmp_path / "rendered.yaml", ports)
    envoy_accepts(yaml.safe_load(path.read_text()), tmp_path)
