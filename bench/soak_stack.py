"""The soak's stack on 127.0.0.1: the shipped Envoy config, a two-worker gate, agents, simulated nodes.

Layout: one simulated interactive node; two simulated long-context nodes, each with a `kvgate agent`
reading its vLLM-style /metrics and serving its own /metrics (holders, reservation events);
`kvgate gate --workers 2` with both agents; Envoy from envoy/envoy.yaml with its ports remapped. The
soak kills things on purpose: an agent, a node or the whole gate (supervisor and workers at once, as
a container dies) is stopped and started again on the same ports; the gate can also be stopped
gracefully (SIGTERM). The gate's workers are found as the children of the gate's supervisor process,
and each is a holder of its own on the agents (`<hostname>:<worker pid>`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import ChildError, ProcessGroup, find_envoy, kvgate_command, sim_command
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent

LONG_NODES = ("long-0", "long-1")
# Sized so that a long request (~8k tokens) takes about a second and four fit on a node at once.
DECODE_TOKENS_PER_S = 100
SIM_FLAGS = (
    *("--prefill-tokens-per-s", "40000", "--decode-tokens-per-s", str(DECODE_TOKENS_PER_S)),
    *("--on-exhaustion", "preempt"),
)
LONG_KV_TOKENS = 40_000
INTERACTIVE_KV_TOKENS = 200_000
WORKERS = 2
DRAIN_S = 5.0
# A killed process is started again this long after it died: a container restart's back-off.
RESTART_S = 3.0


@dataclass(frozen=True, slots=True)
class Ports:
    listener: int
    admin: int
    gate: int
    gate_metrics: int
    interactive: int
    long: tuple[int, ...]
    agents: tuple[int, ...]
    agent_metrics: tuple[int, ...]


def consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive free ports: gate worker i serves /metrics on the base port + i."""
    for _ in range(100):
        base = int(free_port())
        with contextlib.ExitStack() as stack:
            try:
                for offset in range(1, count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", base + offset))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def pick_ports() -> Ports:
    return Ports(
        listener=free_port(),
        admin=free_port(),
        gate=free_port(),
        gate_metrics=consecutive_free_ports(WORKERS),
        interactive=free_port(),
        long=tuple(free_port() for _ in LONG_NODES),
        agents=tuple(free_port() for _ in LONG_NODES),
        agent_metrics=tuple(free_port() for _ in LONG_NODES),
    )


def gate_yaml(ports: Ports, lease_s: float) -> str:
    agents = ", ".join(f"127.0.0.1:{port}" for port in ports.agents)
    return (
        f"server: {{listen: '127.0.0.1:{ports.gate}', workers: {WORKERS}, drain_seconds: {DRAIN_S:g}}}\n"
        # A lost release (a killed worker's) comes back after the lease; short so the soak can see it.
        f"headroom: {{agents: [{agents}], lease_s: {lease_s}}}\n"
        "admission: {max_wait_s: 1.0}\n"
    )


def _pid_children(pid: int) -> list[int]:
    """The live children of `pid`: a killed one stays a zombie until its parent reaps it, and is not."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name, in parentheses, may hold spaces: the state and the parent pid follow it.
        state, parent = stat.rpartition(")")[2].split()[:2]
        if int(parent) == pid and state != "Z":
            children.append(int(entry.name))
    return sorted(children)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class SoakStack:
    """Every process of one soak run; leaving the `with` block stops them all."""

    log_dir: Path
    lease_s: float
    ports: Ports = field(default_factory=pick_ports)
    restarts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group = ProcessGroup(self.log_dir)

    def __enter__(self) -> SoakStack:
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.listener}/v1/chat/completions"

    @property
    def agent_addresses(self) -> tuple[str, ...]:
        return tuple(f"127.0.0.1:{port}" for port in self.ports.agents)

    @property
    def agent_metrics_urls(self) -> tuple[str, ...]:
        return tuple(f"http://127.0.0.1:{port}/metrics" for port in self.ports.agent_metrics)

    def agent_pid(self, index: int) -> int:
        return self.group[f"agent-{LONG_NODES[index]}"].process.pid

    def _start_all(self) -> None:
        p = self.ports
        self.group.start(
            "sim-interactive", self._sim("interactive", p.interactive, INTERACTIVE_KV_TOKENS, 4096)
        )
        for node, port in zip(LONG_NODES, p.long, strict=True):
            self.group.start(f"sim-{node}", self._sim(node, port, LONG_KV_TOKENS, 32768))
        for i in range(len(LONG_NODES)):
            self.start_agent(i)
        config = self.log_dir / "kvgate.yaml"
        config.write_text(gate_yaml(p, self.lease_s))
        metrics = f"127.0.0.1:{p.gate_metrics}"
        self.group.start("gate", kvgate_command("gate", "--config", str(config), "--metrics-listen", metrics))
        envoy_ports = {
            "listener": p.listener,
            "admin": p.admin,
            "gate": p.gate,
            "interactive": p.interactive,
            "long": p.long[0],
        }
        envoy_yaml = render_envoy(ROOT / "envoy" / "envoy.yaml", self.log_dir / "envoy.yaml", envoy_ports)
        envoy_argv = [str(find_envoy()), "-c", str(envoy_yaml), "--disable-hot-restart", "--concurrency", "1"]
        self.group.start("envoy", [*envoy_argv, "--log-level", "warning"])
        ready = {"sim-interactive": p.interactive, "envoy": p.listener}
        ready |= {f"sim-{node}": port for node, port in zip(LONG_NODES, p.long, strict=True)}
        for name, port in ready.items():
            self.group[name].wait_listening(port, timeout_s=60)
        self.wait_gate_workers()

    def wait_gate_workers(self) -> None:
        """Until the gate listens and runs all its workers."""
        self.group["gate"].wait_listening(self.ports.gate, timeout_s=60)
        deadline = time.monotonic() + 60
        while len(self.gate_workers()) < WORKERS:
            if time.monotonic() > deadline:
                raise ChildError(f"the gate did not start its {WORKERS} workers within 60 s")
            time.sleep(0.1)

    @staticmethod
    def _sim(node: str, port: int, kv_tokens: int, max_model_len: int) -> list[str]:
        return sim_command(
            *("--listen", f"127.0.0.1:{port}", "--node-name", node),
            *("--kv-capacity-tokens", str(kv_tokens), "--max-model-len", str(max_model_len)),
            *SIM_FLAGS,
        )

    def start_agent(self, index: int) -> None:
        node, port = LONG_NODES[index], self.ports.agents[index]
        argv = kvgate_command(
            "agent",
            *("--listen", f"127.0.0.1:{port}", "--endpoint", f"127.0.0.1:{self.ports.long[index]}"),
            *("--engine-metrics", f"http://127.0.0.1:{self.ports.long[index]}/metrics"),
            *("--nvml", "off", "--node-name", node),
            *("--metrics-listen", f"127.0.0.1:{self.ports.agent_metrics[index]}"),
        )
        name = f"agent-{node}"
        generation = self.restarts.get(name, 0)
        agent = self.group.start(name, argv, log_name=f"{name}.{generation}" if generation else name)
        agent.wait_listening(port, timeout_s=60)

    def restart_agent(self, index: int) -> None:
        """SIGKILL the agent (its ledger dies with it) and start a fresh one on the same port."""
        name = f"agent-{LONG_NODES[index]}"
        self.group[name].kill()
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.start_agent(index)

    def gate_workers(self) -> list[int]:
        """The gate's worker pids (its supervisor's children that are not multiprocessing helpers)."""
        workers = []
        for pid in _pid_children(self.group["gate"].process.pid):
            with contextlib.suppress(OSError):
                if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    workers.append(pid)
        return workers

    def kill_gate_worker(self, pid: int) -> None:
        """SIGKILL one worker; the gate's supervisor is expected to start a new one."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def kill_gate(self) -> None:
        """SIGKILL the supervisor and its workers at once, as a container is killed: no worker outlives
        the supervisor long enough to release anything."""
        gate = self.group["gate"]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gate.process.pid, signal.SIGKILL)
        gate.process.wait(10)
        gate.end_session()

    def term_gate(self) -> int:
        """SIGTERM: the gate drains (in-flight streams finish, releases go out) and exits; its exit code
        (a drain that overran DRAIN_S by far is SIGKILLed: -9)."""
        return self.group["gate"].stop(timeout_s=DRAIN_S + 10)

    def start_gate(self) -> None:
        """Start the stopped gate again with its command and ports, and wait for all its workers."""
        self.group.restart("gate")
        self.wait_gate_workers()

    def kill_node(self, index: int) -> None:
        """SIGKILL a long node's engine (its cache and running requests die with it)."""
        self.group[f"sim-{LONG_NODES[index]}"].kill()

    def start_node(self, index: int) -> None:
        """Start the killed engine again on its port, with an empty cache."""
        node = self.group.restart(f"sim-{LONG_NODES[index]}")
        node.wait_listening(self.ports.long[index], timeout_s=60)

    def pids(self) -> dict[str, int]:
        """The current pid of every process by role; gate workers as gate-worker:PID."""
        found = {name: service.process.pid for name, service in self.group.services.items()}
        found |= {f"gate-worker:{pid}": pid for pid in self.gate_workers()}
        return found

    def check_alive(self) -> None:
        self.group.check_alive()

    def stop(self) -> None:
        # Envoy first, so nothing new reaches the gate while it drains; the nodes last.
        for name in ("envoy", "gate", *(f"agent-{n}" for n in LONG_NODES)):
            if name in self.group.services:
                self.group.stop(name)
        self.group.stop_all()
