"""Envoy's side of the trust boundary (issue 27), in every shipped config and in `kvgate envoy-config`'s
output, and through the real Envoy binary:
- a client cannot name its own tenant, priority or tenant class (x-kvgate-tenant, x-kvgate-priority,
  x-kvgate-tenant-class, x-tenant, x-tenant-id), and one without an identity is the tenant "anonymous";
- a JWT's claims are the tenant and priority (envoy/envoy-jwt.yaml); a bad token is refused;
- 1,030 open requests do not make Envoy skip the gate (the gate cluster's circuit breakers);
- `strict.local.` and `strict.local:80` get strict.local's policy.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import resource
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_envoyconfig_routes import run_cli
from texts import text_with_tokens
from waiting import until

from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.jwt import Signer
from kvgate.harness.processes import Service
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
ENVOY = ROOT / "envoy"
CHAT = "/v1/chat/completions"
# Every Envoy bootstrap shipped in envoy/ (kvgate.yaml is the gate's own config).
SHIPPED = sorted(p.name for p in ENVOY.glob("*.yaml") if p.name != "kvgate.yaml")
IDENTITY_HEADERS = (
    "x-kvgate-tenant",
    "x-kvgate-priority",
    "x-kvgate-tenant-class",
    "x-tenant",
    "x-tenant-id",
)
ISSUER = "https://id.example.com"  # envoy/envoy-jwt.yaml's provider
AUDIENCE = "kvgate"


def rendered(tmp_path: Path, *flags: str) -> dict[str, Any]:
    output = tmp_path / "rendered.yaml"
    pools = ["--pool", "interactive=127.0.0.1:8001", "--pool", "long=127.0.0.1:8002"]
    assert run_cli([*pools, *flags, "--output", str(output)]) == 0
    bootstrap: dict[str, Any] = yaml.safe_load(output.read_text())
    return bootstrap


def bootstraps(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Every shipped config and `kvgate envoy-config`'s output in both modes, by name."""
    result = {name: yaml.safe_load((ENVOY / name).read_text()) for name in SHIPPED}
    for trips in ("1", "2"):
        result[f"envoy-config --round-trips {trips}"] = rendered(tmp_path, "--round-trips", trips)
    return result


def ingress(config: dict[str, Any]) -> dict[str, Any]:
    manager: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return manager


def gate_cluster(config: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == "kvgate_gate")


def filter_names(config: dict[str, Any]) -> list[str]:
    return [f["name"] for f in ingress(config)["http_filters"]]


# --- every config -------------------------------------------------------------------------------------


def test_no_client_names_its_own_tenant_or_priority(tmp_path: Path) -> None:
    for name, config in bootstraps(tmp_path).items():
        (early,) = ingress(config)["early_header_mutation_extensions"]
        removed = {m["remove"] for m in early["typed_config"]["mutations"]}
        routing = {"x-kvgate-pool", "x-kvgate-endpoint", "x-kvgate-tokens", "x-kvgate-reason"}
        assert removed >= routing | set(IDENTITY_HEADERS), name


def test_the_anonymous_tenant_is_set_after_authentication_and_before_the_gate(tmp_path: Path) -> None:
    for name, config in bootstraps(tmp_path).items():
        names = filter_names(config)
        anonymous = names.index("envoy.filters.http.header_mutation")
        assert anonymous < names.index("envoy.filters.http.ext_proc"), name
        for auth in ("envoy.filters.http.jwt_authn", "envoy.filters.http.ext_authz"):
            assert auth not in names or names.index(auth) < anonymous, name
        (tenant,) = [
            m["append"]
            for m in ingress(config)["http_filters"][anonymous]["typed_config"]["mutations"][
                "request_mutations"
            ]
        ]
        assert tenant == {
            "header": {"key": "x-kvgate-tenant", "value": "anonymous"},
            "append_action": "ADD_IF_ABSENT",
        }, name


def test_envoy_bounds_every_client(tmp_path: Path) -> None:
    for name, config in bootstraps(tmp_path).items():
        manager = ingress(config)
        assert manager["request_headers_timeout"] == "10s", name
        assert manager["request_timeout"] == "60s", name
        assert manager["strip_trailing_host_dot"] is True and manager["strip_any_host_port"] is True, name
        assert manager["http2_protocol_options"] == {"max_concurrent_streams": 100}, name
        assert manager["common_http_protocol_options"] == {"headers_with_underscores_action": "DROP_HEADER"}
        (thresholds,) = gate_cluster(config)["circuit_breakers"]["thresholds"]
        assert thresholds == {
            "max_connections": 100_000,
            "max_pending_requests": 100_000,
            "max_requests": 100_000,
            "max_retries": 3,
        }, name
        overload = config["overload_manager"]
        monitors = {m["name"]: m["typed_config"] for m in overload["resource_monitors"]}
        assert int(monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"]) == 1 << 30, name
        connections = monitors["envoy.resource_monitors.global_downstream_max_connections"]
        assert int(connections["max_active_downstream_connections"]) == 50_000, name
        actions = {a["name"]: a["triggers"] for a in overload["actions"]}
        assert actions["envoy.overload_actions.shrink_heap"][0]["threshold"] == {"value": 0.95}, name
        assert actions["envoy.overload_actions.stop_accepting_requests"][0]["threshold"] == {"value": 0.98}


def test_one_trip_replaces_a_clients_session_id_with_the_gates(tmp_path: Path) -> None:
    one_trip = {
        "envoy-one-trip.yaml": yaml.safe_load((ENVOY / "envoy-one-trip.yaml").read_text()),
        "envoy-config --round-trips 1": rendered(tmp_path, "--round-trips", "1"),
    }
    for name, config in one_trip.items():
        added = {h["header"]["key"]: h for h in ingress(config)["route_config"]["request_headers_to_add"]}
        assert added["x-session-id"]["header"]["value"] == "%DYNAMIC_METADATA(kvgate:session)%", name
        assert added["x-session-id"]["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD", name


def test_the_jwt_example_is_envoy_yaml_plus_the_jwt_filter() -> None:
    example = yaml.safe_load((ENVOY / "envoy-jwt.yaml").read_text())
    filters = ingress(example)["http_filters"]
    jwt = filters.pop(0)
    assert jwt["name"] == "envoy.filters.http.jwt_authn"
    assert example == yaml.safe_load((ENVOY / "envoy.yaml").read_text())
    provider = jwt["typed_config"]["providers"]["kvgate"]
    assert provider["claim_to_headers"] == [
        {"claim_name": "tenant", "header_name": "x-kvgate-tenant"},
        {"claim_name": "kvgate_priority", "header_name": "x-kvgate-priority"},
    ]
    assert "forward" not in provider, "the token is removed once verified"


# --- through the real Envoy -----------------------------------------------------------------------------


@dataclass
class Stack:
    ports: dict[str, int]
    upstreams: Upstreams
    envoy: Service

    def send(self, body: bytes | None, path: str = CHAT, headers: dict[str, str] | None = None) -> Reply:
        return post(self.ports["listener"], path, body, headers)  # type: ignore[arg-type]

    def stat(self, name: str) -> int:
        """An Envoy counter or gauge by its full name (0 while Envoy has not created it)."""
        text = post(self.ports["admin"], f"/stats?filter={name}", None).body.decode()  # type: ignore[arg-type]
        found = re.search(rf"^{re.escape(name)}: (\d+)$", text, re.M)
        return int(found.group(1)) if found else 0


@contextlib.contextmanager
def silent_pool(port: int) -> Iterator[None]:
    """A pool that takes connections and never answers: each request sent to it stays open until
    this closes (the kernel completes up to `backlog` connections nobody accepts)."""
    with socket.create_server(("127.0.0.1", port), backlog=4096):
        yield


@contextlib.contextmanager
def running(
    source: Path,
    tmp: Path,
    gate_config: str,
    *,
    edit: Callable[[dict[str, Any]], None] | None = None,
    silent: tuple[str, ...] = (),
    ports: dict[str, int] | None = None,
) -> Iterator[Stack]:
    """Envoy with `source` (its ports remapped, then `edit`ed), the gate, and a recording upstream for
    each pool but the `silent` ones (`silent_pool`), on `ports` (default: free ones)."""
    ports = ports or stack_ports()
    upstreams = Upstreams(
        {pool: ports[pool] for pool in ("interactive", "long", "async") if pool not in silent}
    )
    upstreams.start()
    quiet = contextlib.ExitStack()
    for pool in silent:
        quiet.enter_context(silent_pool(ports[pool]))
    config_path = render_envoy(source, tmp / "envoy.yaml", ports)
    if edit is not None:
        config = yaml.safe_load(config_path.read_text())
        edit(config)
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        with gate_process(gate_config, tmp, ports["gate"]):
            envoy = envoy_process(config_path, tmp, ports["admin"], ports["listener"])
            try:
                yield Stack(ports, upstreams, envoy)
            finally:
                envoy.stop()
    finally:
        quiet.close()
        upstreams.stop()


def stack_ports() -> dict[str, int]:
    return {name: free_port() for name in ("listener", "gate", "interactive", "long", "async", "admin")}


def gate_config(sp_model_path: Path) -> str:
    return f"default_model: {{tokenizer: {sp_model_path}}}\n"


FORGED = {
    "x-kvgate-tenant": "globex",
    "x_kvgate_tenant": "globex",
    "x-kvgate-priority": "high",
    "x-tenant": "globex",
    "x-tenant-id": "globex",
}


def identity_at_the_queue(stack: Stack, headers: dict[str, str]) -> dict[str, str]:
    """What the queue's own API (/v1/files: Envoy routes it with ext_proc off) receives of the identity
    headers, and of the client's Authorization."""
    reply = stack.send(None, "/v1/files", headers)
    assert reply.status == 200, reply.body
    received = stack.upstreams.received[-1]
    assert received.pool == "async" and received.path == "/v1/files"
    keep = (*IDENTITY_HEADERS, "x_kvgate_tenant", "authorization")
    return {key: value for key, value in received.headers.items() if key in keep}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["envoy.yaml", "envoy-one-trip.yaml"])
def test_a_clients_tenant_and_priority_never_arrive(tmp_path: Path, sp_model_path: Path, source: str) -> None:
    with running(ENVOY / source, tmp_path, gate_config(sp_model_path)) as stack:
        assert identity_at_the_queue(stack, FORGED) == {"x-kvgate-tenant": "anonymous"}
        reply = stack.send(chat("Say hello."), headers=FORGED)
        assert reply.status == 200 and reply.headers["x-kvgate-pool"] == "interactive", reply.body
        received = stack.upstreams.received[-1].headers
        assert not {"x-tenant", "x-tenant-id", "x_kvgate_tenant"} & received.keys()
        # What the gate decided with (one round trip: Envoy copies the priority from its metadata).
        assert received["x-kvgate-tenant"] == "anonymous"
        assert received["x-kvgate-priority"] == "normal"


@pytest.mark.slow
@pytest.mark.parametrize("source", ["envoy.yaml", "envoy-one-trip.yaml"])
def test_the_queues_uploads_are_not_inflated_on_the_way(
    tmp_path: Path, sp_model_path: Path, source: str
) -> None:
    """A 548 KB gzip upload would reach the queue as 191 MiB (review finding 5): the queue's routes
    stream, so no Envoy buffer caps what the decompressor makes. The queue gets the bytes as sent and
    refuses them (415, test_queue_uploads); a chat request is still inflated for the gate and engines."""
    packed = gzip.compress(b"{}" + b" " * 4_000_000)
    compressed = {"content-encoding": "gzip", "content-type": "application/json"}
    with running(ENVOY / source, tmp_path, gate_config(sp_model_path)) as stack:
        assert stack.send(packed, "/v1/files", compressed).status == 200
        upload = stack.upstreams.received[-1]
        # As sent (the recording upstream, aiohttp, inflates what it reads: its headers tell).
        assert upload.path == "/v1/files" and upload.headers.get("content-encoding") == "gzip"
        assert upload.headers.get("content-length") == str(len(packed))
        chat_body = gzip.compress(chat("Say hello."))
        assert stack.send(chat_body, headers=compressed).status == 200
        inflated = stack.upstreams.received[-1]
        assert "content-encoding" not in inflated.headers and inflated.pool == "interactive"


def with_jwks(jwks: str, required: bool = False) -> Callable[[dict[str, Any]], None]:
    """An edit of envoy/envoy-jwt.yaml: the test's keys, and optionally no anonymous access."""

    def edit(config: dict[str, Any]) -> None:
        (jwt,) = [f for f in ingress(config)["http_filters"] if f["name"] == "envoy.filters.http.jwt_authn"]
        jwt["typed_config"]["providers"]["kvgate"]["local_jwks"] = {"inline_string": jwks}
        if required:
            jwt["typed_config"]["rules"][0]["requires"] = {"provider_name": "kvgate"}

    return edit


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> Signer:
    return Signer.create(tmp_path_factory.mktemp("jwt"))


@pytest.mark.slow
def test_the_tenant_and_priority_come_from_the_jwt(
    tmp_path: Path, sp_model_path: Path, signer: Signer
) -> None:
    acme = signer.token(ISSUER, aud=AUDIENCE, tenant="acme", kvgate_priority="high")
    forger = Signer.create(tmp_path, "forger")
    # Envoy's answers (jwt_authn): 401 for a token it cannot verify, 403 for one not meant for it.
    bad = {
        "another key": (forger.token(ISSUER, aud=AUDIENCE, tenant="acme"), 401),
        "expired": (signer.token(ISSUER, lifetime_s=-120, aud=AUDIENCE, tenant="acme"), 401),
        "another issuer": (signer.token("https://evil.example.com", aud=AUDIENCE, tenant="acme"), 401),
        "another audience": (signer.token(ISSUER, aud="other", tenant="acme"), 403),
    }
    edit = with_jwks(signer.jwks())
    with running(ENVOY / "envoy-jwt.yaml", tmp_path, gate_config(sp_model_path), edit=edit) as stack:
        verified = identity_at_the_queue(stack, {**FORGED, "authorization": f"Bearer {acme}"})
        # The claims, and nothing the client sent: the token itself is removed once verified.
        assert verified == {"x-kvgate-tenant": "acme", "x-kvgate-priority": "high"}
        assert identity_at_the_queue(stack, FORGED) == {"x-kvgate-tenant": "anonymous"}
        before = len(stack.upstreams.received)
        for what, (token, status) in bad.items():
            reply = stack.send(chat("Say hello."), headers={"authorization": f"Bearer {token}"})
            assert reply.status == status, what
        assert len(stack.upstreams.received) == before, "a refused token reaches no upstream"
        # The gate still decides each request.
        decided = stack.send(chat("Say hello."), headers={"authorization": f"Bearer {acme}"})
        assert decided.status == 200 and decided.headers["x-kvgate-pool"] == "interactive"


@pytest.mark.slow
def test_a_required_jwt_refuses_a_request_without_one(
    tmp_path: Path, sp_model_path: Path, signer: Signer
) -> None:
    acme = signer.token(ISSUER, aud=AUDIENCE, tenant="acme")
    edit = with_jwks(signer.jwks(), required=True)
    with running(ENVOY / "envoy-jwt.yaml", tmp_path, gate_config(sp_model_path), edit=edit) as stack:
        assert stack.send(chat("Say hello."), headers=FORGED).status == 401
        assert identity_at_the_queue(stack, {"authorization": f"Bearer {acme}"}) == {
            "x-kvgate-tenant": "acme"
        }


@pytest.mark.slow
@pytest.mark.parametrize("host", ["strict.local.", "strict.local:80", "STRICT.LOCAL.:8080", "strict.local"])
def test_every_spelling_of_a_policy_host_gets_its_policy(
    tmp_path: Path, sp_model_path: Path, host: str
) -> None:
    """envoy.yaml's strict.local caps requests at 2,000 tokens (the gate's 413 past it)."""
    request = chat("word " * 2000)  # about 2,000 prompt tokens + the 1,024-token default budget
    with running(ENVOY / "envoy.yaml", tmp_path, gate_config(sp_model_path)) as stack:
        reply = stack.send(request, headers={"host": host})
        assert reply.status == 413, reply.body
        assert "2000" in reply.json()["error"]["message"]


@pytest.mark.slow
def test_one_trip_sends_the_gates_session_id_not_the_clients(tmp_path: Path, sp_model_path: Path) -> None:
    """A reserved request's X-Session-ID names the gate's reservation (the engine's KV events are tied
    to it by that id), whatever the client sent."""
    ports = stack_ports()
    agent_port = free_port()
    agent = agent_process(
        tmp_path, "agent", agent_port, f"127.0.0.1:{ports['long']}", ["--capacity-tokens", "100000"]
    )
    config = gate_config(sp_model_path) + f"headroom: {{agents: ['127.0.0.1:{agent_port}']}}\n"
    long_chat = chat(text_with_tokens(sp_model_path, 9000))
    try:
        with running(ENVOY / "envoy-one-trip.yaml", tmp_path, config, ports=ports) as stack:
            # 503 until the gate has heard from its agent.
            reply = until(
                lambda: (
                    (r := stack.send(long_chat, headers={"x-session-id": "victim-1"})).status != 503 and r
                ),
                "a long request admitted",
            )
    finally:
        agent.stop()
    assert reply.status == 200 and reply.json()["pool"] == "long", reply.body
    session = stack.upstreams.received[-1].headers["x-session-id"]
    assert session and session != "victim-1"


# --- 1,030 open requests ---------------------------------------------------------------------------------

OPEN_REQUESTS = 1030  # past Envoy's default circuit breaker (1,024 streams to the gate)


def _open_file_limit(needed: int) -> None:
    """Each open request costs this process a socket and Envoy two; children inherit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def header_only(port: int) -> socket.socket:
    """A chat request's headers, announcing a 100,000-byte body that never comes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\n"
        "content-length: 100000\r\n\r\n".encode()
    )
    return sock


def held(port: int) -> socket.socket:
    """A whole short chat, which the (silent) interactive pool never answers: it stays open."""
    body = chat("Say hello.")
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST {CHAT} HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "opener"),
    [("envoy.yaml", header_only), ("envoy-one-trip.yaml", held)],
    ids=["two-trips-header-only", "one-trip-held"],
)
def test_open_requests_past_1024_do_not_make_envoy_skip_the_gate(
    tmp_path: Path, sp_model_path: Path, source: str, opener: Callable[[int], socket.socket]
) -> None:
    """A request being decided holds a stream to the gate: with two round trips from its headers on,
    so one whose body never comes keeps it. A request held upstream keeps none: the gate ends the
    stream of one that holds no reservation once it has answered it. Past the gate cluster's circuit
    breaker, ext_proc fails open and sends requests on undecided; with 1,030 open, a 9k-token chat must
    still be decided by the gate (or refused with 503)."""
    _open_file_limit(4 * OPEN_REQUESTS + 1000)
    long_chat = chat(text_with_tokens(sp_model_path, 9000))
    silent = ("interactive",) if opener is held else ()
    with running(ENVOY / source, tmp_path, gate_config(sp_model_path), silent=silent) as stack:
        failed_open = "http.llm.ext_proc.failure_mode_allowed"
        streams = "cluster.kvgate_gate.upstream_rq_active"
        overflowed = "cluster.kvgate_gate.upstream_rq_active_overflow"
        sockets: list[socket.socket] = []
        try:
            for _ in range(OPEN_REQUESTS):
                sockets.append(opener(stack.ports["listener"]))
            if opener is held:
                # Every request was decided, and none holds its stream to the gate while it waits.
                until(
                    lambda: (
                        stack.stat("cluster.kvgate_gate.upstream_rq_total") >= OPEN_REQUESTS
                        and stack.stat(streams) == 0
                    ),
                    f"{OPEN_REQUESTS} requests decided, their streams ended",
                    60,
                )
                assert stack.stat("http.llm.downstream_rq_active") >= OPEN_REQUESTS, "all still open"
                assert stack.stat(overflowed) == 0
            else:
                # Every request holds its stream, or (past the breaker) has failed open.
                until(
                    lambda: stack.stat(streams) + stack.stat(overflowed) >= OPEN_REQUESTS,
                    f"{OPEN_REQUESTS} requests at the gate",
                    60,
                )
            before = stack.stat(failed_open)
            try:
                reply = stack.send(long_chat)
            except TimeoutError:  # sent on undecided, to the silent pool
                reply = None
            assert stack.stat(failed_open) == before, "ext_proc failed open: the request went on undecided"
            assert reply is not None
            if reply.status == 503:
                return
            decided = reply.headers.get("x-kvgate-pool") or reply.headers.get("x-kvgate-reason")
            assert decided, f"no decision: {reply.status} {reply.body[:200]!r}"
            if reply.status == 200:
                assert reply.json()["pool"] == "long"
        finally:
            for sock in sockets:
                sock.close()


def test_the_jwks_of_the_example_is_a_public_key() -> None:
    """The example's key is RSA, public only: a config people copy must not carry a private key."""
    example = yaml.safe_load((ENVOY / "envoy-jwt.yaml").read_text())
    (jwt,) = [f for f in ingress(example)["http_filters"] if f["name"] == "envoy.filters.http.jwt_authn"]
    keys = json.loads(jwt["typed_config"]["providers"]["kvgate"]["local_jwks"]["inline_string"])["keys"]
    assert [sorted(key) for key in keys] == [["alg", "e", "kid", "kty", "n", "use"]]
