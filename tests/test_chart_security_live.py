"""The chart's trust boundaries run: its rendered standalone Envoy bootstrap in the real Envoy, and its
generated agent certificates in a real agent, on 127.0.0.1 (test_chart_security.py renders them).

Where no gate runs, ext_proc fails open, so what reaches the recording pools is Envoy's own doing.
"""

from __future__ import annotations

import http.client
import itertools
import json
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pki import Authority
from test_chart import Helm, container, gate_config_text, one, real_helm, standalone
from test_chart_envoy import text_of_about
from test_chart_security import MTLS, secret_files
from test_chart_tls import mount_volumes, rewrite

from kvgate.harness.client import Reply, chat, post
from kvgate.harness.jwt import Signer
from kvgate.harness.processes import Service, kvgate_command
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

pytestmark = pytest.mark.slow

STATUS_TIMEOUT_S = 60


@pytest.fixture(scope="session")
def helm() -> Helm:
    return real_helm()


def test_generated_certificates_open_the_agent_to_the_gate_only(
    helm: Helm, tmp_path: Path, pools: tuple[dict[str, int], Upstreams]
) -> None:
    """A real agent serving the chart's certificates: the gate's client certificate reads its Subscribe
    stream; the agent's own certificate, from the other CA, is refused in the handshake."""
    pool_ports, _ = pools
    docs = helm.render(standalone())
    agent_dir = secret_files(docs, "rel-kvgate-agent-tls", tmp_path)
    gate_dir = secret_files(docs, "rel-kvgate-gate-client-tls", tmp_path)
    serving = tmp_path / "agent-volume"
    serving.mkdir()
    for name in ("tls.crt", "tls.key"):
        (serving / name).write_bytes((agent_dir / name).read_bytes())
    (serving / "ca.crt").write_bytes((gate_dir / "ca.crt").read_bytes())
    flags: list[str] = []
    for flag, value in itertools.pairwise(container(one(docs, "DaemonSet"), "agent")["args"]):
        if flag.startswith("--tls-"):
            flags += [flag, rewrite(value, {"/etc/kvgate-tls/agents": serving})]
    port = free_port()
    agent = agent_process(
        tmp_path, "agent", port, f"127.0.0.1:{pool_ports['long']}", ["--capacity-tokens", "100000", *flags]
    )
    try:

        def status(cert_dir: Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                kvgate_command(
                    "status",
                    *("--agent", f"127.0.0.1:{port}", "--json", "--tls-server-name", "kvgate-agent"),
                    *("--tls-ca", str(agent_dir / "ca.crt")),
                    *("--tls-cert", str(cert_dir / "tls.crt"), "--tls-key", str(cert_dir / "tls.key")),
                ),
                capture_output=True,
                text=True,
                timeout=STATUS_TIMEOUT_S,
                check=False,
            )

        trusted = status(gate_dir)
        assert trusted.returncode in (0, 1), (trusted.stdout, trusted.stderr, agent.log())
        assert json.loads(trusted.stdout)["node"] == "agent"
        refused = status(agent_dir)
        assert refused.returncode == 2, (refused.stdout, refused.stderr)
    finally:
        agent.stop()


# --- through the real Envoy ------------------------------------------------------------------------------


def live_values(ports: dict[str, int], **extra: Any) -> dict[str, Any]:
    """The chart's standalone Envoy on 127.0.0.1, in front of recording pools; no agents."""
    return {
        "gate": {"port": ports["gate"], "workers": 1, "drainSeconds": 5},
        "agent": {"enabled": False},
        "tls": {"agents": {"enabled": False, "clientAuth": False}},
        "envoy": {
            "mode": "standalone",
            "pools": {
                name: {"address": "127.0.0.1", "port": ports[name]} for name in ("interactive", "long")
            },
            "standalone": {
                "listenAddress": "127.0.0.1",
                "listenPort": ports["listener"],
                "readyPort": ports["ready"],
                "adminPort": ports["admin"],
                "gateAddress": "127.0.0.1",
            },
        },
    } | extra


@pytest.fixture
def live_ports() -> dict[str, int]:
    return {name: free_port() for name in ("listener", "ready", "admin", "gate", "interactive", "long")}


@pytest.fixture
def recording(live_ports: dict[str, int]) -> Iterator[Upstreams]:
    upstreams = Upstreams({pool: live_ports[pool] for pool in ("interactive", "long")})
    upstreams.start()
    try:
        yield upstreams
    finally:
        upstreams.stop()


def run_envoy(
    docs: list[dict[str, Any]], ports: dict[str, int], tmp_path: Path, secrets: Path | None = None
) -> Service:
    """The rendered Envoy pod's bootstrap (and, with `secrets`, its Secret volumes) run here."""
    if secrets is None:
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(one(docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"])
    else:
        mounts = mount_volumes(docs, one(docs, "Deployment", "-envoy"), "envoy", secrets, tmp_path / "envoy")
        bootstrap = mounts["/etc/envoy"] / "envoy.yaml"
    return envoy_process(bootstrap, tmp_path, ports["admin"], ports["listener"])


def test_jwt_claims_not_client_headers_name_the_tenant(
    helm: Helm, live_ports: dict[str, int], recording: Upstreams, tmp_path: Path
) -> None:
    """No gate runs (ext_proc fails open), so what reaches the pool is Envoy's own doing."""
    signer = Signer.create(tmp_path)
    auth = {"method": "jwt", "jwt": {"issuer": "kvgate-test", "jwks": {"inline": signer.jwks()}}}
    envoy = run_envoy(helm.render(live_values(live_ports, auth=auth)), live_ports, tmp_path)
    forged = {"x-kvgate-tenant": "bob", "x-kvgate-priority": "high", "x-tenant": "bob", "x-tenant-id": "bob"}

    def send(headers: dict[str, str]) -> Reply:
        return post(live_ports["listener"], "/v1/chat/completions", chat("hello"), headers)

    try:
        assert send(forged).status == 401, "no token"
        bad = Signer.create(tmp_path, "other").token("kvgate-test", tenant="alice")
        assert send(forged | {"authorization": f"Bearer {bad}"}).status == 401, "a key the issuer never had"
        token = signer.token("kvgate-test", tenant="alice", kvgate_priority="low")
        assert send(forged | {"authorization": f"Bearer {token}"}).status == 200
        headers = recording.received[-1].headers
        assert headers["x-kvgate-tenant"] == "alice" and headers["x-kvgate-priority"] == "low"
        assert "x-tenant" not in headers and "x-tenant-id" not in headers
        assert "authorization" not in headers, "the token goes no further than Envoy"
        plain = signer.token("kvgate-test")
        assert send(forged | {"authorization": f"Bearer {plain}"}).status == 200
        headers = recording.received[-1].headers
        assert headers["x-kvgate-tenant"] == "anonymous" and "x-kvgate-priority" not in headers
    finally:
        envoy.stop()


def test_client_certificates_name_the_tenant(
    helm: Helm, live_ports: dict[str, int], recording: Upstreams, tmp_path: Path
) -> None:
    secrets = tmp_path / "secrets"
    serving, clients = secrets / "envoy-serving", secrets / "clients-ca"
    serving.mkdir(parents=True)
    clients.mkdir()
    server_ca = Authority.create(serving, "ca")
    server_ca.issue(serving, "tls", "DNS:localhost,IP:127.0.0.1")
    client_ca = Authority.create(clients, "ca")
    acme = client_ca.issue(clients, "acme", "URI:spiffe://example.org/tenant/acme")
    nameless = client_ca.issue(clients, "nameless", "DNS:client.example.org")
    stranger = Authority.create(tmp_path, "stranger").issue(
        tmp_path, "mallory", "URI:spiffe://example.org/tenant/acme"
    )
    docs = helm.render(live_values(live_ports, auth=MTLS))
    envoy = run_envoy(docs, live_ports, tmp_path, secrets)

    def send(cert: Path, key: Path) -> int:
        context = ssl.create_default_context(cafile=str(serving / "ca.crt"))
        context.load_cert_chain(str(cert), str(key))
        connection = http.client.HTTPSConnection(
            "127.0.0.1", live_ports["listener"], context=context, timeout=30
        )
        try:
            connection.request("POST", "/v1/chat/completions", chat("hello"), {"x-kvgate-tenant": "bob"})
            response = connection.getresponse()
            response.read()
            return response.status
        finally:
            connection.close()

    try:
        assert send(acme.cert, acme.key) == 200
        assert recording.received[-1].headers["x-kvgate-tenant"] == "spiffe://example.org/tenant/acme"
        assert send(nameless.cert, nameless.key) == 200
        assert recording.received[-1].headers["x-kvgate-tenant"] == "anonymous"
        with pytest.raises((ssl.SSLError, ConnectionError)):
            send(stranger.cert, stranger.key)
    finally:
        envoy.stop()


def test_stats_show_requests_that_skipped_the_gate_and_nothing_else_of_admin(
    helm: Helm, live_ports: dict[str, int], recording: Upstreams, tmp_path: Path
) -> None:
    docs = helm.render(live_values(live_ports, metrics={"serviceMonitor": {"enabled": True}}))
    (alert,) = one(docs, "PrometheusRule")["spec"]["groups"][0]["rules"]
    envoy = run_envoy(docs, live_ports, tmp_path)
    try:
        # No gate listens: ext_proc fails open, which the alert is about.
        assert post(live_ports["listener"], "/v1/chat/completions", chat("hello")).status == 200
        stats = post(live_ports["ready"], "/stats/prometheus", None).body.decode()
        (line,) = [
            entry
            for entry in stats.splitlines()
            if entry.startswith("envoy_http_ext_proc_failure_mode_allowed{")
        ]
        assert line.endswith(" 1") and "envoy_http_ext_proc_failure_mode_allowed" in alert["expr"]
        for path in ("/quitquitquit", "/config_dump", "/stats/prometheus/../quitquitquit"):
            assert post(live_ports["ready"], path, None).status == 404
    finally:
        envoy.stop()


def test_a_host_policy_holds_whatever_the_host_is_spelled(
    helm: Helm, live_ports: dict[str, int], recording: Upstreams, tmp_path: Path, sp_model_path: Path
) -> None:
    """Finding 10: `strict.local.` and `strict.local:80` got the catch-all's answer (200) where
    `strict.local` got its policy's (413)."""
    policies = [{"name": "strict", "hosts": ["strict.local"], "maxTotalTokens": 2000}]
    values = live_values(live_ports)
    values["envoy"]["routePolicies"] = policies
    docs = helm.render(values)
    envoy = run_envoy(docs, live_ports, tmp_path)
    try:
        with gate_process(
            gate_config_text(docs), tmp_path, live_ports["gate"], ["--tokenizer", str(sp_model_path)]
        ):
            body = chat(text_of_about(sp_model_path, 3000))
            assert post(live_ports["listener"], "/v1/chat/completions", body).status == 200
            for host in (
                "strict.local",
                "strict.local.",
                "STRICT.LOCAL.",
                "strict.local:80",
                "strict.local.:8080",
            ):
                refused = post(live_ports["listener"], "/v1/chat/completions", body, {"host": host})
                assert refused.status == 413, (host, refused.status, refused.body)
    finally:
        envoy.stop()
