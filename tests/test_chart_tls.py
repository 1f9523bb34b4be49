"""TLS in the Helm chart: the Secrets each pod mounts, the gate's `tls` section, the agents' --tls-* flags,
probes that work over TLS, and Envoy's TLS context for the gate, all rendered by the real helm.

Certificates come from tests/pki.py, one CA per Secret, so a CA taken from the wrong Secret fails the
handshake. `mount_volumes` plays the kubelet: it writes each volume of a rendered pod from the rendered
ConfigMaps and from per-Secret directories, behind a `..data` link as in a real Secret volume, and the
paths the rendered config names are rewritten into those directories. What runs is then the rendered
wiring itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from pki import Authority
from test_chart import (
    CHART,
    OWN_ENVOY_PEERS,
    Helm,
    HelmFailed,
    by_kind,
    check_object,
    container,
    gate_config_text,
    one,
    real_helm,
    standalone,
)
from test_chart_envoy import envoy_validate
from texts import text_with_tokens

from kvgate.agent.cli import register, tls_from_args
from kvgate.config import parse_config
from kvgate.harness.client import chat, post, post_until_admitted
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

GATE_SECRET = "kvgate-gate-tls"
ENVOY_SECRET = "kvgate-envoy-tls"
AGENT_SECRET = "kvgate-agent-tls"
GATE_CLIENT_SECRET = "kvgate-gate-client-tls"
# The names the chart's defaults expect in the gate's and the agents' certificates.
SANS = {
    GATE_SECRET: "DNS:kvgate-gate",
    ENVOY_SECRET: "DNS:envoy",
    AGENT_SECRET: "DNS:kvgate-agent",
    GATE_CLIENT_SECRET: "DNS:gate",
}
MOUNTED = re.compile(r"/etc/(?:kvgate-tls|envoy)\b[^\s'\"]*")


@pytest.fixture(scope="session")
def helm() -> Helm:
    return real_helm()


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    """A directory per Secret holding tls.crt, tls.key and ca.crt as cert-manager writes them, each
    certificate from its own CA."""
    root = tmp_path / "secrets"
    for name, sans in SANS.items():
        directory = root / name
        directory.mkdir(parents=True)
        ca = Authority.create(directory, "ca")
        ca.issue(directory, "tls", sans)
    return root


def tls_values(client_auth: bool = True, gate: bool = True, agents: bool = True) -> dict[str, Any]:
    return {
        "gate": {
            "enabled": gate,
            "secretName": GATE_SECRET,
            "clientAuth": client_auth and gate,
            "clientSecretName": ENVOY_SECRET,
        },
        "agents": {
            "enabled": agents,
            "secretName": AGENT_SECRET,
            "clientAuth": client_auth and agents,
            "clientSecretName": GATE_CLIENT_SECRET,
        },
    }


def with_tls(**tls: bool) -> dict[str, Any]:
    return standalone(tls=tls_values(**tls))


def tls_override(link: str, **values: Any) -> dict[str, Any]:
    """Standalone values with mTLS on both links and `values` changed in tls.<link>."""
    tls = tls_values()
    tls[link] = tls[link] | values
    return standalone(tls=tls)


def pod(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def projected(workload: dict[str, Any], name: str) -> dict[str, tuple[str, str]]:
    """A projected volume's files: path -> (Secret, key)."""
    (volume,) = [v for v in pod(workload)["volumes"] if v["name"] == name]
    assert volume["projected"]["defaultMode"] == 0o440
    return {
        item["path"]: (source["secret"]["name"], item["key"])
        for source in volume["projected"]["sources"]
        for item in source["secret"]["items"]
    }


def tls_mounts(workload: dict[str, Any], name: str) -> dict[str, str]:
    mounts = container(workload, name)["volumeMounts"]
    for mount in mounts:
        if mount["name"].startswith("tls-"):
            assert mount["readOnly"] is True
    return {m["name"]: m["mountPath"] for m in mounts if m["name"].startswith("tls-")}


def tls_volumes(workload: dict[str, Any]) -> set[str]:
    return {v["name"] for v in pod(workload)["volumes"] if v["name"].startswith("tls-")}


def own(secret: str) -> dict[str, tuple[str, str]]:
    return {"tls.crt": (secret, "tls.crt"), "tls.key": (secret, "tls.key")}


def ca_of(secret: str) -> dict[str, tuple[str, str]]:
    return {"ca.crt": (secret, "ca.crt")}


def gate_cluster(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvgate_gate"]
    return cluster


def agent_tls_flags(args: list[str]) -> list[str]:
    flags: list[str] = []
    for flag, value in itertools.pairwise(args):
        if flag.startswith("--tls-"):
            flags += [flag, value]
    return flags


# --- what each pod mounts and is told ------------------------------------------------------------------


def test_mtls_mounts_each_pods_own_certificate_and_only_the_ca_of_its_peer(helm: Helm) -> None:
    values = with_tls()
    values["agent"] = {"pools": {"interactive": {"enabled": True}}}
    docs = helm.render(values)
    for doc in docs:
        check_object(doc)
    gate = one(docs, "Deployment", "-gate")
    envoy = one(docs, "Deployment", "-envoy")
    agents = by_kind(docs, "DaemonSet")
    assert len(agents) == 2

    # Envoy -> gate: the gate serves its own certificate and trusts the CA of Envoy's; Envoy the reverse.
    assert projected(gate, "tls-gate") == own(GATE_SECRET) | ca_of(ENVOY_SECRET)
    assert projected(envoy, "tls-gate") == own(ENVOY_SECRET) | ca_of(GATE_SECRET)
    # gate -> agents: the agents serve theirs and trust the CA of the gate's client certificate.
    assert projected(gate, "tls-agents") == own(GATE_CLIENT_SECRET) | ca_of(AGENT_SECRET)
    for daemonset in agents:
        assert projected(daemonset, "tls-agents") == own(AGENT_SECRET) | ca_of(GATE_CLIENT_SECRET)
        assert tls_mounts(daemonset, "agent") == {"tls-agents": "/etc/kvgate-tls/agents"}
        flags = agent_tls_flags(container(daemonset, "agent")["args"])
        assert flags == [
            *("--tls-cert", "/etc/kvgate-tls/agents/tls.crt", "--tls-key", "/etc/kvgate-tls/agents/tls.key"),
            *("--tls-client-ca", "/etc/kvgate-tls/agents/ca.crt"),
        ]
    assert tls_mounts(gate, "gate") == {
        "tls-gate": "/etc/kvgate-tls/gate",
        "tls-agents": "/etc/kvgate-tls/agents",
    }
    assert tls_mounts(envoy, "envoy") == {"tls-gate": "/etc/kvgate-tls/gate"}

    config = parse_config(gate_config_text(docs))
    assert config.tls.server.cert == "/etc/kvgate-tls/gate/tls.crt"
    assert config.tls.server.key == "/etc/kvgate-tls/gate/tls.key"
    assert config.tls.server.client_ca == "/etc/kvgate-tls/gate/ca.crt"
    assert config.tls.agents.ca == "/etc/kvgate-tls/agents/ca.crt"
    assert config.tls.agents.cert == "/etc/kvgate-tls/agents/tls.crt"
    assert config.tls.agents.key == "/etc/kvgate-tls/agents/tls.key"
    assert config.tls.agents.server_name == "kvgate-agent"
    assert config.tls.agents.reload_interval_s == 10


def test_envoy_checks_the_gates_name_and_offers_h2_and_its_certificate(helm: Helm) -> None:
    docs = helm.render(tls_override("gate", serverName="gate.llm"))
    envoy_config = one(docs, "ConfigMap", "-envoy")["data"]
    bootstrap = yaml.safe_load(envoy_config["envoy.yaml"])
    assert bootstrap["node"]["id"]
    context = gate_cluster(bootstrap)["transport_socket"]["typed_config"]
    assert context["sni"] == "gate.llm"
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    validation = common["combined_validation_context"]
    assert validation["default_validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "gate.llm"}}
    ]
    sds = {
        config["name"]: config["sds_config"]["path_config_source"]["path"]
        for config in [
            *common["tls_certificate_sds_secret_configs"],
            validation["validation_context_sds_secret_config"],
        ]
    }
    assert sds == {
        "kvgate_gate_client": "/etc/envoy/gate-client-certificate.yaml",
        "kvgate_gate_ca": "/etc/envoy/gate-ca.yaml",
    }
    (ca,) = yaml.safe_load(envoy_config["gate-ca.yaml"])["resources"]
    assert ca["name"] == "kvgate_gate_ca"
    assert ca["validation_context"]["trusted_ca"] == {"filename": "/etc/kvgate-tls/gate/ca.crt"}
    assert ca["validation_context"]["watched_directory"] == {"path": "/etc/kvgate-tls/gate"}
    (client,) = yaml.safe_load(envoy_config["gate-client-certificate.yaml"])["resources"]
    assert client["name"] == "kvgate_gate_client"
    assert client["tls_certificate"]["private_key"] == {"filename": "/etc/kvgate-tls/gate/tls.key"}
    assert client["tls_certificate"]["watched_directory"] == {"path": "/etc/kvgate-tls/gate"}


def test_tls_without_client_auth_mounts_no_client_certificate(helm: Helm) -> None:
    docs = helm.render(with_tls(client_auth=False))
    gate, envoy = one(docs, "Deployment", "-gate"), one(docs, "Deployment", "-envoy")
    assert projected(gate, "tls-gate") == own(GATE_SECRET)
    assert projected(envoy, "tls-gate") == ca_of(GATE_SECRET)
    assert projected(gate, "tls-agents") == ca_of(AGENT_SECRET)
    daemonset = one(docs, "DaemonSet", "-agent-long")
    assert projected(daemonset, "tls-agents") == own(AGENT_SECRET)
    assert "--tls-client-ca" not in container(daemonset, "agent")["args"]
    config = parse_config(gate_config_text(docs))
    assert config.tls.server.client_ca is None
    assert config.tls.agents.cert is None and config.tls.agents.key is None
    envoy_config = one(docs, "ConfigMap", "-envoy")["data"]
    assert set(envoy_config) == {"envoy.yaml", "gate-ca.yaml"}
    common = gate_cluster(yaml.safe_load(envoy_config["envoy.yaml"]))["transport_socket"]["typed_config"]
    assert "tls_certificate_sds_secret_configs" not in common["common_tls_context"]


@pytest.mark.parametrize(("gate_tls", "agents_tls"), [(True, False), (False, True), (False, False)])
def test_grpc_probes_become_tcp_probes_on_a_tls_port(helm: Helm, gate_tls: bool, agents_tls: bool) -> None:
    """The kubelet's grpc probe has no TLS: it would fail every probe on a TLS port."""
    docs = helm.render(with_tls(gate=gate_tls, agents=agents_tls))
    for workload, name, port, on in (
        (one(docs, "Deployment", "-gate"), "gate", 9002, gate_tls),
        (one(docs, "DaemonSet", "-agent-long"), "agent", 9100, agents_tls),
    ):
        expected = {"tcpSocket": {"port": port}} if on else {"grpc": {"port": port}}
        for probe in ("readinessProbe", "livenessProbe"):
            check = container(workload, name)[probe]
            assert {k: v for k, v in check.items() if k in ("tcpSocket", "grpc")} == expected


def test_tls_off_renders_no_tls(helm: Helm) -> None:
    """Both links plaintext, as an operator may still choose (agents are mTLS by default)."""
    docs = helm.render(standalone(tls={"agents": {"enabled": False, "clientAuth": False}}))
    assert not by_kind(docs, "Secret") and not by_kind(docs, "Certificate")
    for workload in [*by_kind(docs, "Deployment"), *by_kind(docs, "DaemonSet")]:
        assert not tls_volumes(workload)
    assert "tls" not in yaml.safe_load(gate_config_text(docs))
    envoy_config = one(docs, "ConfigMap", "-envoy")["data"]
    assert set(envoy_config) == {"envoy.yaml"}
    bootstrap = yaml.safe_load(envoy_config["envoy.yaml"])
    assert "node" not in bootstrap and "transport_socket" not in gate_cluster(bootstrap)


@pytest.mark.parametrize("mode", ["istio", "envoy-gateway", "none"])
def test_agent_tls_works_in_every_mode(helm: Helm, mode: str) -> None:
    files = [] if mode == "none" else [CHART / "ci" / f"{mode}-values.yaml"]
    values = {"envoy": {"mode": mode}, "tls": tls_values(gate=False)}
    if mode == "none":
        values["networkPolicy"] = OWN_ENVOY_PEERS
    docs = helm.render(values, *files)
    for doc in docs:
        check_object(doc)
    assert parse_config(gate_config_text(docs)).tls.agents.enabled
    assert "--tls-client-ca" in container(one(docs, "DaemonSet", "-agent-long"), "agent")["args"]


def test_gate_tls_with_your_own_envoy(helm: Helm) -> None:
    """envoy.mode none: the gate serves TLS; the Envoy and its certificate are yours."""
    docs = helm.render(
        {"envoy": {"mode": "none"}, "tls": tls_values(agents=False), "networkPolicy": OWN_ENVOY_PEERS}
    )
    assert not [d for d in docs if d["metadata"]["name"].endswith("-envoy")]
    gate = one(docs, "Deployment", "-gate")
    assert projected(gate, "tls-gate") == own(GATE_SECRET) | ca_of(ENVOY_SECRET)
    assert parse_config(gate_config_text(docs)).tls.server.client_ca == "/etc/kvgate-tls/gate/ca.crt"


def test_helm_lint_passes_with_tls(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "tls-values.yaml"
    values.write_text(yaml.safe_dump(with_tls()))
    assert "0 chart(s) failed" in helm.run("lint", "--strict", str(CHART), "-f", str(values))


# --- bad values fail at install, naming the value --------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            standalone(tls={"gate": {"clientauth": True}}),
            r"at '/tls/gate': additional properties 'clientauth' not allowed",
        ),
        (
            tls_override("agents", reloadIntervalSeconds=0),
            r"at '/tls/agents/reloadIntervalSeconds': minimum: got 0, want 0\.01",
        ),
        (
            tls_override("gate", secretName="Gate_TLS"),
            r"at '/tls/gate/secretName': 'Gate_TLS' does not match pattern",
        ),
        (tls_override("agents", serverName=""), r"at '/tls/agents/serverName': '' does not match pattern"),
        (
            standalone(gate={"config": {"tls": {"server": {"cert": "/x.crt", "key": "/x.key"}}}}),
            r"at '/gate/config': additional properties 'tls' not allowed",
        ),
        (
            tls_override("gate", secretName=""),
            r"tls\.gate\.secretName is required when tls\.gate\.enabled is true",
        ),
        (
            tls_override("gate", clientSecretName=""),
            r"tls\.gate\.clientSecretName is required when tls\.gate\.clientAuth is true",
        ),
        (
            tls_override("agents", enabled=False),
            r"tls\.agents\.clientAuth needs tls\.agents\.enabled",
        ),
        (
            {"envoy": {"mode": "istio", "pools": standalone()["envoy"]["pools"]}, "tls": tls_values()},
            r"tls\.gate\.enabled is not supported with envoy\.mode=istio",
        ),
        (
            {
                "envoy": {
                    "mode": "envoy-gateway",
                    "pools": {"interactive": {"address": "a"}, "long": {"address": "b"}},
                },
                "tls": tls_values(agents=False),
            },
            r"tls\.gate\.enabled is not supported with envoy\.mode=envoy-gateway",
        ),
    ],
    ids=[
        "unknown-key",
        "reload-interval-zero",
        "secret-name-not-a-name",
        "empty-server-name",
        "gate-config-tls-is-the-charts",
        "gate-without-secret",
        "gate-client-auth-without-secret",
        "client-auth-without-tls",
        "istio",
        "envoy-gateway",
    ],
)
def test_bad_tls_values_fail_naming_the_value(helm: Helm, values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        helm.render(values)


# --- the rendered pods' files, written the way the kubelet does -----------------------------------------


def project(directory: Path, files: dict[str, bytes]) -> None:
    """Writes a volume as the kubelet updates one: a new directory, then the ..data link renamed onto it."""
    directory.mkdir(parents=True, exist_ok=True)
    version = directory / f"..{time.time_ns()}"
    version.mkdir()
    for name, content in files.items():
        (version / name).write_bytes(content)
    staged = directory / "..data_tmp"
    staged.symlink_to(version.name)
    os.replace(staged, directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


def rewrite(text: str, mounts: dict[str, Path]) -> str:
    """`text` with every path under a mount moved into the directory standing in for it."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        text = re.sub(re.escape(mount_path) + r"(?=/|\s|$)", str(mounts[mount_path]), text)
    return text


def volume_files(docs: list[dict[str, Any]], volume: dict[str, Any], secrets: Path) -> dict[str, bytes]:
    if "projected" in volume:
        return {
            item["path"]: (secrets / source["secret"]["name"] / item["key"]).read_bytes()
            for source in volume["projected"]["sources"]
            for item in source["secret"]["items"]
        }
    (config_map,) = [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == volume["configMap"]["name"]
    ]
    return {name: text.encode() for name, text in config_map["data"].items()}


def mount_volumes(
    docs: list[dict[str, Any]], workload: dict[str, Any], name: str, secrets: Path, root: Path
) -> dict[str, Path]:
    """The container's ConfigMap and Secret volumes under `root`: mountPath -> directory. ConfigMap files
    are rewritten to point into these directories, as they point into the mounts in the pod."""
    volumes = {v["name"]: v for v in pod(workload)["volumes"]}
    mounted = {
        m["mountPath"]: volumes[m["name"]]
        for m in container(workload, name)["volumeMounts"]
        if {"projected", "configMap"} & set(volumes[m["name"]])
    }
    mounts = {path: root / volume["name"] for path, volume in mounted.items()}
    for path, volume in mounted.items():
        files = volume_files(docs, volume, secrets)
        if "configMap" in volume:
            files = {key: rewrite(content.decode(), mounts).encode() for key, content in files.items()}
        project(mounts[path], files)
    return mounts


def unmounted(text: str) -> list[str]:
    """Paths under /etc/kvgate-tls or /etc/envoy left after rewriting: no volume holds them."""
    return MOUNTED.findall(text)


def file_paths(node: Any) -> list[str]:
    """Every `filename` and `path` in an Envoy resource."""
    if isinstance(node, dict):
        here = [v for k, v in node.items() if k in ("filename", "path") and isinstance(v, str)]
        return here + [path for value in node.values() for path in file_paths(value)]
    if isinstance(node, list):
        return [path for value in node for path in file_paths(value)]
    return []


def parse_agent_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(args)


@pytest.mark.parametrize("client_auth", [True, False], ids=["mtls", "tls"])
def test_every_file_the_rendered_pods_name_is_in_their_volumes(
    helm: Helm, secrets: Path, tmp_path: Path, client_auth: bool
) -> None:
    """The gate loads its files, the agent its own, and `envoy --mode validate` passes the bootstrap."""
    docs = helm.render(with_tls(client_auth=client_auth))

    gate_mounts = mount_volumes(docs, one(docs, "Deployment", "-gate"), "gate", secrets, tmp_path / "gate")
    config_text = rewrite(gate_config_text(docs), gate_mounts)
    assert not unmounted(config_text), config_text
    parse_config(config_text).tls.check_files()

    daemonset = one(docs, "DaemonSet", "-agent-long")
    agent_mounts = mount_volumes(docs, daemonset, "agent", secrets, tmp_path / "agent")
    args = [rewrite(arg, agent_mounts) for arg in container(daemonset, "agent")["args"]]
    assert not unmounted(" ".join(args))
    agent_tls = tls_from_args(parse_agent_args(args))
    assert agent_tls.enabled and (agent_tls.client_ca is not None) == client_auth
    agent_tls.open_files("agent TLS")

    envoy = one(docs, "Deployment", "-envoy")
    envoy_mounts = mount_volumes(docs, envoy, "envoy", secrets, tmp_path / "envoy")
    envoy_dir = envoy_mounts["/etc/envoy"]
    for file in envoy_dir.glob("*.yaml"):
        assert not unmounted(file.read_text()), file.read_text()
    for sds_file in envoy_dir.glob("gate-*.yaml"):
        named = file_paths(yaml.safe_load(sds_file.read_text()))
        assert named and all(Path(path).exists() for path in named), named
    envoy_validate(yaml.safe_load((envoy_dir / "envoy.yaml").read_text()), tmp_path)


# --- end to end: the rendered pieces over mTLS on 127.0.0.1 ----------------------------------------------


def serial(cert: Path) -> int:
    result = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-serial"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(result.stdout.strip().partition("=")[2], 16)


def envoy_client_serials(admin_port: int) -> set[int]:
    """Serial numbers of the client certificates Envoy has loaded, from its admin /certs."""
    certificates = json.loads(post(admin_port, "/certs", None).body)["certificates"]  # type: ignore[arg-type]
    return {int(c["serial_number"], 16) for entry in certificates for c in entry.get("cert_chain", [])}


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_rendered_wiring_carries_requests_over_mtls_on_both_links(
    helm: Helm,
    secrets: Path,
    tmp_path: Path,
    sp_model_path: Path,
    pools: tuple[dict[str, int], Upstreams],
) -> None:
    """Envoy -> gate and gate -> agent over mTLS with the rendered files; a long request is reserved on the
    agent and pinned; a renewed Envoy certificate is loaded without a restart."""
    pool_ports, upstreams = pools
    ports = {name: free_port() for name in ("listener", "ready", "admin", "gate", "agent")}
    values = {
        "gate": {"port": ports["gate"], "workers": 1, "drainSeconds": 5},
        "agent": {"port": ports["agent"]},
        "envoy": {
            "mode": "standalone",
            "pools": {name: {"address": "127.0.0.1", "port": port} for name, port in pool_ports.items()},
            "standalone": {
                "listenAddress": "127.0.0.1",
                "listenPort": ports["listener"],
                "readyPort": ports["ready"],
                "adminPort": ports["admin"],
                "gateAddress": "127.0.0.1",
            },
        },
        "tls": tls_values(),
    }
    docs = helm.render(values)
    gate_mounts = mount_volumes(docs, one(docs, "Deployment", "-gate"), "gate", secrets, tmp_path / "gate")
    config = yaml.safe_load(rewrite(gate_config_text(docs), gate_mounts))
    # The agents' headless Service stands for the one agent on 127.0.0.1.
    config["headroom"] = {"agents": [f"127.0.0.1:{ports['agent']}"]}
    daemonset = one(docs, "DaemonSet", "-agent-long")
    agent_mounts = mount_volumes(docs, daemonset, "agent", secrets, tmp_path / "agent")
    agent_flags = [
        rewrite(arg, agent_mounts) for arg in agent_tls_flags(container(daemonset, "agent")["args"])
    ]
    envoy_mounts = mount_volumes(
        docs, one(docs, "Deployment", "-envoy"), "envoy", secrets, tmp_path / "envoy"
    )

    with ExitStack() as stack:
        agent = agent_process(
            tmp_path,
            "agent",
            ports["agent"],
            f"127.0.0.1:{pool_ports['long']}",
            ["--capacity-tokens", "100000", *agent_flags],
        )
        stack.callback(agent.stop)
        gate = stack.enter_context(
            gate_process(yaml.safe_dump(config), tmp_path, ports["gate"], ["--tokenizer", str(sp_model_path)])
        )
        envoy = envoy_process(
            envoy_mounts["/etc/envoy"] / "envoy.yaml", tmp_path, ports["admin"], ports["listener"]
        )
        stack.callback(envoy.stop)

        short = post(ports["listener"], "/v1/chat/completions", chat("hello"))
        assert short.status == 200, short.body
        # A header only the gate sets: the request went through it (failing open would leave none).
        assert upstreams.received[-1].headers.get("x-kvgate-pool") == "interactive", (envoy.log(), gate.log())

        long_body = chat(text_with_tokens(sp_model_path, 8_000), max_tokens=1000)
        reply = post_until_admitted(ports["listener"], long_body)
        assert reply.status == 200, (reply.status, reply.body, agent.log(), gate.log())
        assert upstreams.received[-1].pool == "long"
        assert upstreams.received[-1].headers["x-kvgate-endpoint"] == f"127.0.0.1:{pool_ports['long']}"

        # cert-manager renews Envoy's certificate: the Secret changes and the kubelet swaps the volume.
        envoy_secret = secrets / ENVOY_SECRET
        before = serial(envoy_secret / "tls.crt")
        assert envoy_client_serials(ports["admin"]) == {before}
        ca = Authority("ca", envoy_secret / "ca.crt", envoy_secret / "ca.key")
        ca.issue(envoy_secret, "tls", SANS[ENVOY_SECRET])
        renewed = serial(envoy_secret / "tls.crt")
        (volume,) = [v for v in pod(one(docs, "Deployment", "-envoy"))["volumes"] if v["name"] == "tls-gate"]
        project(envoy_mounts["/etc/kvgate-tls/gate"], volume_files(docs, volume, secrets))
        wait_for(
            lambda: envoy_client_serials(ports["admin"]) == {renewed},
            10,
            "Envoy to load the renewed certificate",
        )
        assert post(ports["listener"], "/v1/chat/completions", chat("again")).status == 200
        assert upstreams.received[-1].headers.get("x-kvgate-pool") == "interactive"
