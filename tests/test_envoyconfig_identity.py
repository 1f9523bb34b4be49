"""`kvgate envoy-config --auth`: JWT, ext_authz and client certificates set the tenant, through the real
Envoy; the flags of one mode are refused with another; Envoy's bounds are the operator's to size."""

from __future__ import annotations

import http.client
import http.server
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pki import Authority
from test_chart_envoy import envoy_validate
from test_envoyconfig_routes import run_cli

from kvgate.errors import ConfigError
from kvgate.harness.client import post
from kvgate.harness.jwt import Signer
from kvgate.harness.stack import envoy_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

POOLS = ["--pool", "interactive=127.0.0.1:8001", "--pool", "long=127.0.0.1:8002"]


def render(tmp: Path, argv: list[str]) -> dict[str, Any]:
    output = tmp / "envoy.yaml"
    assert run_cli([*argv, "--output", str(output)]) == 0
    bootstrap: dict[str, Any] = yaml.safe_load(output.read_text())
    return bootstrap


def filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    found: list[dict[str, Any]] = manager["http_filters"]
    return found


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--jwt-issuer", "i"], r"--jwt-issuer is for --auth jwt \(got --auth none\)"),
        (["--auth", "mtls", "--ext-authz", "a:1"], r"--ext-authz is for --auth ext-authz"),
        (["--auth", "jwt", "--jwt-issuer", "i"], r"--auth jwt needs --jwt-issuer and --jwt-jwks"),
        (["--auth", "ext-authz"], r"--auth ext-authz needs --ext-authz HOST:PORT"),
        (["--auth", "mtls", "--tls-cert", "c"], r"--auth mtls needs --tls-cert, --tls-key and --client-ca"),
        (["--auth-required"], r"--auth-required needs --auth jwt or mtls"),
        (
            ["--auth", "ext-authz", "--ext-authz", "a:1", "--auth-required"],
            r"the authorization service decides",
        ),
    ],
)
def test_auth_flags_name_what_is_wrong(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_cli([*POOLS, *flags])


def test_jwt_renders_the_claims_and_passes_envoy_validate(tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text(Signer.create(tmp_path).jwks())
    flags = ["--auth", "jwt", "--jwt-issuer", "https://id", "--jwt-jwks", str(jwks), "--jwt-audience", "a"]
    flags += ["--jwt-tenant-claim", "org", "--auth-required"]
    bootstrap = render(tmp_path, [*POOLS, *flags])
    envoy_validate(bootstrap, tmp_path)
    jwt = filters(bootstrap)[0]["typed_config"]
    provider = jwt["providers"]["kvgate"]
    assert provider["issuer"] == "https://id" and provider["audiences"] == ["a"]
    assert provider["local_jwks"] == {"filename": str(jwks)}
    assert provider["claim_to_headers"] == [
        {"header_name": "x-kvgate-tenant", "claim_name": "org"},
        {"header_name": "x-kvgate-priority", "claim_name": "kvgate_priority"},
    ]
    assert jwt["rules"] == [{"match": {"prefix": "/"}, "requires": {"provider_name": "kvgate"}}]


def test_bounds_are_the_operators_to_size(tmp_path: Path) -> None:
    flags = ["--request-timeout-seconds", "300", "--request-headers-timeout-seconds", "5"]
    flags += ["--max-connections", "1000", "--max-heap-mib", "1536"]
    bootstrap = render(tmp_path, [*POOLS, *flags])
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert (manager["request_timeout"], manager["request_headers_timeout"]) == ("300s", "5s")
    monitors = {m["name"]: m["typed_config"] for m in bootstrap["overload_manager"]["resource_monitors"]}
    assert int(monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"]) == 1536 << 20
    connections = monitors["envoy.resource_monitors.global_downstream_max_connections"]
    assert int(connections["max_active_downstream_connections"]) == 1000


# --- through the real Envoy -------------------------------------------------------------------------------


@pytest.fixture
def queue() -> Iterator[tuple[int, Upstreams]]:
    """A recording upstream standing in for `kvgate queue` (--queue): its own API skips the gate."""
    port = free_port()
    upstreams = Upstreams({"async": port})
    upstreams.start()
    try:
        yield port, upstreams
    finally:
        upstreams.stop()


def local_flags(ports: dict[str, int], queue_port: int) -> list[str]:
    flags = [*POOLS, "--queue", f"127.0.0.1:{queue_port}", "--listen", f"127.0.0.1:{ports['listener']}"]
    return [*flags, "--ready-port", str(ports["ready"]), "--admin-port", str(ports["admin"])]


def identity(received: dict[str, str]) -> dict[str, str]:
    keep = ("x-kvgate-tenant", "x-kvgate-priority", "x-evil")
    return {key: value for key, value in received.items() if key in keep}


class _Authz(http.server.BaseHTTPRequestHandler):
    """An HTTP authorization service: `Bearer acme` is tenant acme at high priority, anything else 403.
    It also answers a header it has no business setting, which must not reach the upstream."""

    def do_GET(self) -> None:
        if self.headers.get("authorization") == "Bearer acme":
            self.send_response(200)
            for key, value in (("x-kvgate-tenant", "acme"), ("x-kvgate-priority", "high"), ("x-evil", "1")):
                self.send_header(key, value)
        else:
            self.send_response(403)
        self.send_header("content-length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.slow
def test_ext_authz_answers_the_tenant_and_nothing_else(tmp_path: Path, queue: tuple[int, Upstreams]) -> None:
    queue_port, upstreams = queue
    ports = {name: free_port() for name in ("listener", "ready", "admin")}
    authz = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Authz)
    threading.Thread(target=authz.serve_forever, daemon=True).start()
    flags = ["--auth", "ext-authz", "--ext-authz", f"127.0.0.1:{authz.server_address[1]}"]
    render(tmp_path, [*local_flags(ports, queue_port), *flags])
    envoy = envoy_process(tmp_path / "envoy.yaml", tmp_path, ports["admin"], ports["listener"])
    try:
        forged = {"x-kvgate-tenant": "globex", "x-kvgate-priority": "high"}
        admitted = post(ports["listener"], "/v1/files", None, {**forged, "authorization": "Bearer acme"})  # type: ignore[arg-type]
        assert admitted.status == 200
        assert identity(upstreams.received[-1].headers) == {
            "x-kvgate-tenant": "acme",
            "x-kvgate-priority": "high",
        }
        assert post(ports["listener"], "/v1/files", None, forged).status == 403  # type: ignore[arg-type]
        authz.shutdown()
        authz.server_close()
        # The service gone: refused, never let through unauthenticated.
        assert post(ports["listener"], "/v1/files", None, {"authorization": "Bearer acme"}).status == 503  # type: ignore[arg-type]
        assert len(upstreams.received) == 1
    finally:
        envoy.stop()


def _get_tls(port: int, ca: Path, cert: Path | None = None, key: Path | None = None) -> int:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    conn = http.client.HTTPSConnection("localhost", port, context=context, timeout=30)
    try:
        conn.request("GET", "/v1/files", headers={"x-kvgate-tenant": "globex"})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("required", [True, False], ids=["required", "optional"])
def test_the_client_certificate_is_the_tenant(
    tmp_path: Path, queue: tuple[int, Upstreams], required: bool
) -> None:
    queue_port, upstreams = queue
    ca = Authority.create(tmp_path, "clients-ca")
    server = ca.issue(tmp_path, "envoy", "DNS:localhost")
    acme = ca.issue(tmp_path, "acme", "URI:spiffe://kvgate.test/tenant/acme")
    ports = {name: free_port() for name in ("listener", "ready", "admin")}
    flags = ["--auth", "mtls", "--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    flags += ["--client-ca", str(ca.cert), *(["--auth-required"] if required else [])]
    render(tmp_path, [*local_flags(ports, queue_port), *flags])
    envoy = envoy_process(tmp_path / "envoy.yaml", tmp_path, ports["admin"], ports["listener"])
    try:
        assert _get_tls(ports["listener"], ca.cert, acme.cert, acme.key) == 200
        assert identity(upstreams.received[-1].headers) == {
            "x-kvgate-tenant": "spiffe://kvgate.test/tenant/acme"
        }
        if required:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _get_tls(ports["listener"], ca.cert)
            assert len(upstreams.received) == 1
        else:
            assert _get_tls(ports["listener"], ca.cert) == 200
            assert identity(upstreams.received[-1].headers) == {"x-kvgate-tenant": "anonymous"}
    finally:
        envoy.stop()
