"""`kvgate envoy-config` with TLS to the gate: the flags, the checks against the gate's config, the
bootstrap the real Envoy accepts, and Envoy -> gate over mTLS end to end.

Certificates come from tests/pki.py: one CA, the gate's serving certificate and Envoy's client one.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pki import Authority, Issued
from test_chart_envoy import envoy_validate, run_cli
from test_tls import GATE_NAME, gate_cluster_stats
from texts import text_with_tokens

from kvgate.errors import ConfigError
from kvgate.harness.client import chat, post
from kvgate.harness.stack import envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent

POOLS = ["--pool", "interactive=127.0.0.1:8001", "--pool", "long=127.0.0.1:8002"]


@dataclass(frozen=True)
class Pki:
    directory: Path
    ca: Authority
    gate: Issued
    envoy: Issued


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = Authority.create(tmp_path, "kvgate-ca")
    gate = ca.issue(tmp_path, "gate", f"DNS:{GATE_NAME}")
    return Pki(tmp_path, ca, gate, ca.issue(tmp_path, "envoy", "DNS:envoy"))


def server_tls(pki: Pki, client_ca: bool) -> str:
    """The gate's tls section, serving the PKI's gate certificate (mTLS with `client_ca`)."""
    mtls = f", client_ca: {pki.ca.cert}" if client_ca else ""
    return f"tls:\n  server: {{cert: {pki.gate.cert}, key: {pki.gate.key}{mtls}}}\n"


def tls_flags(pki: Pki, client_cert: bool) -> list[str]:
    flags = ["--gate-tls-ca", str(pki.ca.cert), "--gate-server-name", GATE_NAME]
    if client_cert:
        flags += ["--gate-tls-cert", str(pki.envoy.cert), "--gate-tls-key", str(pki.envoy.key)]
    return flags


def render(tmp: Path, argv: list[str], config_text: str | None = None) -> dict[str, Any]:
    config: list[str] = []
    if config_text is not None:
        (tmp / "kvgate.yaml").write_text(config_text)
        config = ["--config", str(tmp / "kvgate.yaml")]
    output = tmp / "envoy.yaml"
    assert run_cli([*config, *argv, "--output", str(output)]) == 0
    bootstrap: dict[str, Any] = yaml.safe_load(output.read_text())
    return bootstrap


def gate_cluster(bootstrap: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvgate_gate")


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_tls_bootstrap_passes_envoy_validate(pki: Pki, mtls: bool) -> None:
    bootstrap = render(pki.directory, [*POOLS, *tls_flags(pki, mtls)], server_tls(pki, mtls))
    envoy_validate(bootstrap, pki.directory)
    context = gate_cluster(bootstrap)["transport_socket"]["typed_config"]
    assert context["sni"] == GATE_NAME
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": GATE_NAME}}
    ]
    assert ("tls_certificates" in common) == mtls


def test_tls_bootstrap_is_envoy_tls_yaml_for_files_not_on_this_machine(tmp_path: Path) -> None:
    """The gate cluster's TLS context is envoy/envoy-tls.yaml's; its paths need not exist here."""
    files = "/etc/kvgate/tls"
    config = f"tls:\n  server: {{cert: {files}/gate.crt, key: {files}/gate.key, client_ca: {files}/ca.crt}}\n"
    flags = ["--gate-tls-ca", f"{files}/ca.crt", "--gate-server-name", "kvgate-gate"]
    flags += ["--gate-tls-cert", f"{files}/envoy.crt", "--gate-tls-key", f"{files}/envoy.key"]
    rendered = gate_cluster(render(tmp_path, [*POOLS, *flags], config))
    example = yaml.safe_load((ROOT / "envoy" / "envoy-tls.yaml").read_text())
    assert rendered["transport_socket"] == gate_cluster(example)["transport_socket"]


def test_plaintext_by_default(tmp_path: Path) -> None:
    assert "transport_socket" not in gate_cluster(render(tmp_path, POOLS))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gate-server-name", "g"], r"--gate-server-name needs --gate-tls-ca"),
        (["--gate-tls-cert", "e.crt", "--gate-tls-key", "e.key"], r"--gate-tls-cert needs --gate-tls-ca"),
        (
            ["--gate-tls-ca", "ca.crt"],
            r"--gate-tls-ca needs --gate-server-name: .*any certificate from the CA",
        ),
        (["--gate-tls-ca", "ca.crt", "--gate-server-name", "g", "--gate-tls-cert", "e.crt"], r"go together"),
        (["--gate-tls-ca", "ca.crt", "--gate-server-name", "g", "--gate-tls-key", "e.key"], r"go together"),
    ],
)
def test_bad_flag_combinations_name_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_cli([*POOLS, *flags])


def test_empty_tls_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli([*POOLS, "--gate-tls-ca", "", "--gate-server-name", "g"])
    assert exit_info.value.code == 2
    assert "argument --gate-tls-ca: must not be empty" in capsys.readouterr().err


def test_a_tls_gate_needs_the_tls_flags(pki: Pki) -> None:
    with pytest.raises(ConfigError, match=r"the gate serves only TLS \(tls\.server\) but no --gate-tls-ca"):
        render(pki.directory, POOLS, server_tls(pki, client_ca=False))


def test_an_mtls_gate_needs_envoys_client_certificate(pki: Pki) -> None:
    with pytest.raises(ConfigError, match=r"will refuse Envoy's handshake .*add --gate-tls-cert"):
        render(pki.directory, [*POOLS, *tls_flags(pki, False)], server_tls(pki, client_ca=True))


def test_tls_flags_for_a_plaintext_config_warn_and_render(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvgate.envoyconfig"):
        bootstrap = render(
            pki.directory, [*POOLS, *tls_flags(pki, True)], "request: {max_body_bytes: 1048576}\n"
        )
    assert "transport_socket" in gate_cluster(bootstrap)
    assert any("has no tls.server" in r.message for r in caplog.records)


@pytest.mark.slow
def test_rendered_mtls_bootstrap_routes_through_the_gate(
    pki: Pki, sp_model_path: Path, pools: tuple[dict[str, int], Upstreams]
) -> None:
    """Envoy with the rendered bootstrap, the gate serving mTLS: short and long chats reach their pools
    with the gate's own header, over a TLS handshake."""
    pool_ports, upstreams = pools
    tmp = pki.directory
    ports = {name: free_port() for name in ("listener", "ready", "admin", "gate")}
    config_text = f"default_model: {{tokenizer: {sp_model_path}}}\n" + server_tls(pki, client_ca=True)
    flags = [f"--pool={name}=127.0.0.1:{pool_ports[name]}" for name in ("interactive", "long")]
    flags += ["--listen", f"127.0.0.1:{ports['listener']}", "--gate", f"127.0.0.1:{ports['gate']}"]
    flags += ["--ready-port", str(ports["ready"]), "--admin-port", str(ports["admin"])]
    render(tmp, [*flags, *tls_flags(pki, True)], config_text)
    with gate_process(config_text, tmp, ports["gate"]):
        envoy = envoy_process(tmp / "envoy.yaml", tmp, ports["admin"], ports["listener"])
        try:
            for tokens, pool in ((100, "interactive"), (8_000, "long")):
                reply = post(
                    ports["listener"], "/v1/chat/completions", chat(text_with_tokens(sp_model_path, tokens))
                )
                assert reply.status == 200, reply.body
                received = upstreams.received[-1]
                assert received.pool == pool
                # Only the gate sets this header: failing open would leave none.
                assert received.headers.get("x-kvgate-pool") == pool, gate_cluster_stats(ports["admin"])
            handshakes = re.search(
                r"cluster\.kvgate_gate\.ssl\.handshake: (\d+)", gate_cluster_stats(ports["admin"])
            )
            assert handshakes is not None and int(handshakes.group(1)) >= 1
        finally:
            envoy.stop()
