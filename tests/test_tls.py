"""TLS and mTLS: certificate files, the agent refusing unauthenticated gates, rotation without restart,
and the gate behind the real Envoy over mTLS (envoy/envoy-tls.yaml).

Certificates come from a throwaway PKI made with the openssl command line (tests/pki.py): two CAs that
do not trust each other, gate / Envoy / agent certificates from the first.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import Authority, Issued
from texts import text_with_tokens

from kvgate.agent.cli import register, tls_from_args
from kvgate.agent.cli import run as run_agent
from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.config import parse_config
from kvgate.config.headroom import HeadroomSettings
from kvgate.errors import ConfigError, HeadroomError
from kvgate.harness.client import chat, post, post_until_admitted
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import find_envoy
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.headroom.credentials import ChannelSecurity
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port
from kvgate.tls import ClientTls, PemFiles, ServerTls, describe

ROOT = Path(__file__).resolve().parent.parent

AGENT_NAME = "kvgate-agent"
GATE_NAME = "kvgate-gate"
# Agents are addressed by IP; their certificates carry a name, which the gate is told to expect.
AGENT_SANS = f"DNS:{AGENT_NAME}"
FAST: dict[str, Any] = {"reconnect_initial_s": 0.05, "reconnect_max_s": 0.2, "reserve_timeout_s": 2.0}


@dataclass(frozen=True)
class Pki:
    directory: Path
    ca: Authority
    other_ca: Authority
    agent: Issued
    gate: Issued
    envoy: Issued
    stranger: Issued  # from other_ca: a certificate kvgate's CA never signed


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = Authority.create(tmp_path, "kvgate-ca")
    other = Authority.create(tmp_path, "other-ca")
    return Pki(
        tmp_path,
        ca,
        other,
        ca.issue(tmp_path, "agent", AGENT_SANS),
        ca.issue(tmp_path, "gate", f"DNS:{GATE_NAME}"),
        ca.issue(tmp_path, "envoy", "DNS:envoy"),
        other.issue(tmp_path, "stranger", f"DNS:{GATE_NAME}"),
    )


def gate_tls(pki: Pki, client: Issued | None, ca: Path | None = None, interval_s: float = 10.0) -> ClientTls:
    return ClientTls(
        ca=str(ca or pki.ca.cert),
        cert=None if client is None else str(client.cert),
        key=None if client is None else str(client.key),
        server_name=AGENT_NAME,
        reload_interval_s=interval_s,
    )


def mtls_agent(pki: Pki, served: Issued | None = None) -> ServerTls:
    served = served or pki.agent
    return ServerTls(str(served.cert), str(served.key), client_ca=str(pki.ca.cert))


# --- settings and files -------------------------------------------------------------------------------


def test_incomplete_tls_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="cert and key"):
        ServerTls(cert="a.crt")
    with pytest.raises(ConfigError, match="client_ca needs cert and key"):
        ServerTls(client_ca="ca.crt")
    with pytest.raises(ConfigError, match="need ca"):
        ClientTls(cert="a.crt", key="a.key")
    assert not ServerTls().enabled and not ClientTls().enabled


def test_a_listeners_start_line_says_how_it_is_secured() -> None:
    assert describe(None) == describe(ServerTls()) == "plaintext"
    assert describe(ServerTls(cert="a.crt", key="a.key")) == "TLS"
    assert describe(ServerTls(cert="a.crt", key="a.key", client_ca="ca.crt")).startswith("mTLS")


def test_tls_section_in_the_config_file(pki: Pki) -> None:
    config = parse_config(
        f"tls:\n  server: {{cert: {pki.gate.cert}, key: {pki.gate.key}, client_ca: {pki.ca.cert}}}\n"
        f"  agents: {{ca: {pki.ca.cert}, server_name: {AGENT_NAME}, reload_interval_s: 2}}\n",
        "kvgate.yaml",
    )
    assert config.tls.server.client_ca == str(pki.ca.cert)
    assert config.tls.agents.server_name == AGENT_NAME and config.tls.agents.reload_interval_s == 2
    config.tls.check_files()
    with pytest.raises(ConfigError, match=r"kvgate\.yaml:2: tls\.server: cert and key"):
        parse_config(f"tls:\n  server: {{cert: {pki.gate.cert}}}\n", "kvgate.yaml")
    with pytest.raises(ConfigError, match=r"kvgate\.yaml:2: tls\.agents\.crt: unknown key"):
        parse_config("tls:\n  agents: {crt: x}\n", "kvgate.yaml")
    missing = parse_config(f"tls: {{server: {{cert: {pki.directory}/nope.crt, key: {pki.gate.key}}}}}\n")
    with pytest.raises(ConfigError, match=r"tls\.server: cannot read .*nope\.crt"):
        missing.tls.check_files()


def test_unusable_pem_files_name_the_file(pki: Pki) -> None:
    with pytest.raises(ConfigError, match=r"agent TLS: cannot read .*absent\.key"):
        PemFiles(str(pki.agent.cert), str(pki.directory / "absent.key"), None, "agent TLS")
    with pytest.raises(ConfigError, match="KEY_VALUES_MISMATCH"):
        PemFiles(str(pki.agent.cert), str(pki.gate.key), None, "agent TLS")
    with pytest.raises(ConfigError, match="not a usable PEM set"):
        PemFiles(None, None, str(pki.agent.key), "agent TLS")


def test_refresh_reads_only_changes_and_keeps_the_old_files_through_a_broken_rotation(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    files = PemFiles(str(pki.agent.cert), str(pki.agent.key), str(pki.ca.cert), "agent TLS")
    first = files.current
    assert first.cert == pki.agent.cert.read_bytes()
    assert files.refresh() is None

    # Half a rotation: a new key next to the old certificate. Unusable, so the old pair stays.
    spare = pki.ca.issue(pki.directory, "spare", AGENT_SANS)
    pki.agent.key.write_bytes(spare.key.read_bytes())
    with caplog.at_level(logging.WARNING, logger="kvgate.tls"):
        assert files.refresh() is None
        assert files.refresh() is None
    assert files.current == first
    assert len([r for r in caplog.records if "keeping the certificates" in r.message]) == 1

    pki.agent.cert.write_bytes(spare.cert.read_bytes())
    rotated = files.refresh()
    assert rotated is not None and rotated.cert == spare.cert.read_bytes() != first.cert
    assert files.current == rotated and files.refresh() is None


def test_agent_tls_flags(pki: Pki) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["agent", "--listen", "127.0.0.1:0", "--endpoint", "127.0.0.1:8000", "--capacity-tokens", "1"]

    def tls(*flags: str) -> ServerTls:
        return tls_from_args(parser.parse_args([*base, *flags]))

    assert tls() == ServerTls()
    assert tls("--tls-cert", "a.crt", "--tls-key", "a.key", "--tls-client-ca", "ca.crt").client_ca == "ca.crt"
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        tls("--tls-cert", "a.crt")
    with pytest.raises(ConfigError, match="--tls-client-ca needs"):
        tls("--tls-client-ca", "ca.crt")
    # Unusable files stop the command before it samples or listens.
    mismatched = ["--tls-cert", str(pki.agent.cert), "--tls-key", str(pki.gate.key)]
    with pytest.raises(ConfigError, match=r"agent TLS: .*KEY_VALUES_MISMATCH"):
        run_agent(parser.parse_args([*base, *mismatched]))


# --- the agent over mTLS, in process ------------------------------------------------------------------


@asynccontextmanager
async def serving_agent(tls: ServerTls) -> AsyncIterator[tuple[Agent, str]]:
    agent = Agent(NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=100_000))
    port = await agent.start("127.0.0.1:0", tls)
    try:
        yield agent, f"127.0.0.1:{port}"
    finally:
        await agent.stop(grace_s=0.1)


@asynccontextmanager
async def gate_view(address: str, tls: ClientTls | None) -> AsyncIterator[HeadroomView]:
    security = None if tls is None else ChannelSecurity(tls)
    view = HeadroomView(HeadroomSettings(agents=(address,), **FAST), security=security)
    await view.start()
    try:
        yield view
    finally:
        await view.stop()


async def connected(view: HeadroomView, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(node.connected for node in view.snapshot()):
            return True
        await view.wait_update(0.1)
    return False


async def refused(address: str, tls: ClientTls | None) -> str:
    """The error a gate with these credentials gets from Reserve; fails the test if it is granted."""
    async with gate_view(address, tls) as view:
        with pytest.raises(HeadroomError) as caught:
            await view.reserve(address, "r-refused", 1_000)
        assert not await connected(view, 0.3), "the stream must be refused as well"
    return str(caught.value)


def test_agent_with_a_client_ca_grants_only_to_authenticated_gates(pki: Pki) -> None:
    async def scenario() -> None:
        async with serving_agent(mtls_agent(pki)) as (agent, address):
            async with gate_view(address, gate_tls(pki, pki.gate)) as view:
                assert await connected(view, 5.0)
                granted = await view.reserve(address, "r-good", 1_000)
                assert granted.granted and granted.reserved_tokens == 1_000
            for credentials in (gate_tls(pki, None), gate_tls(pki, pki.stranger), None):
                assert "UNAVAILABLE" in await refused(address, credentials)
            # A gate that does not trust the agent's CA gives up on its side of the handshake.
            assert "UNAVAILABLE" in await refused(address, gate_tls(pki, pki.gate, ca=pki.other_ca.cert))
            assert agent.state.ledger.reserved_tokens == 1_000

    asyncio.run(scenario())


def test_agent_serves_a_rotated_certificate_without_restarting(pki: Pki) -> None:
    """The agent's certificate is replaced on disk by one from another CA; new connections get it."""

    async def scenario() -> None:
        async with serving_agent(mtls_agent(pki)) as (agent, address):
            trusts_new_ca_only = gate_tls(pki, pki.gate, ca=pki.other_ca.cert)
            assert "UNAVAILABLE" in await refused(address, trusts_new_ca_only)
            pki.other_ca.issue(pki.directory, "agent-next", AGENT_SANS, into=pki.agent)
            async with gate_view(address, trusts_new_ca_only) as view:
                assert await connected(view, 5.0)
                assert (await view.reserve(address, "r-after", 1_000)).granted
            assert agent.state.ledger.reserved_tokens == 1_000

    asyncio.run(scenario())


def test_gate_reconnects_with_its_rotated_client_certificate(pki: Pki) -> None:
    """The gate starts with a certificate the agent refuses; the good one lands on disk; the view's
    watcher reloads it and reconnects, with no new view."""
    own = pki.other_ca.issue(pki.directory, "gate-own", f"DNS:{GATE_NAME}")

    async def scenario() -> None:
        async with (
            serving_agent(mtls_agent(pki)) as (_, address),
            gate_view(address, gate_tls(pki, own, interval_s=0.05)) as view,
        ):
            assert not await connected(view, 0.5)
            pki.ca.issue(pki.directory, "gate-next", f"DNS:{GATE_NAME}", into=own)
            assert await connected(view, 5.0)
            assert (await view.reserve(address, "r-rotated", 1_000)).granted

    asyncio.run(scenario())


def test_status_says_the_agent_wants_tls_when_it_refuses_the_client(
    pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvgate status` against an mTLS agent without the client flags: gRPC says only "Socket closed",
    so the command asks the port itself and names the flags it lacks."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def status(address: str, *flags: str) -> tuple[int, str]:
        args = parser.parse_args(["status", "--agent", address, "--timeout-s", "5", *flags])
        code = args.func(args)
        return code, capsys.readouterr().err

    ca = ["--tls-ca", str(pki.ca.cert), "--tls-server-name", AGENT_NAME]
    client = ["--tls-cert", str(pki.gate.cert), "--tls-key", str(pki.gate.key)]

    async def scenario() -> None:
        async with serving_agent(mtls_agent(pki)) as (_, address):
            code, err = await asyncio.to_thread(status, address)
            assert code == 2 and "Socket closed" in err
            assert "the agent speaks TLS (it was started with --tls-cert): pass --tls-ca" in err, err
            code, err = await asyncio.to_thread(status, address, *ca)
            assert code == 2 and "pass --tls-cert and --tls-key" in err, err
            assert (await asyncio.to_thread(status, address, *ca, *client))[0] == 0
        async with serving_agent(ServerTls()) as (_, address):
            code, err = await asyncio.to_thread(status, address, *ca)
            assert code == 2 and "the agent does not speak TLS" in err, err
        # Nothing listens any more: not a TLS matter, and no hint says it is.
        code, err = await asyncio.to_thread(status, address)
        assert code == 2 and err.count("kvgate status:") == 1 and "TLS" not in err, err

    asyncio.run(scenario())


# --- processes: the agent command, Envoy and the gate -------------------------------------------------


def render_envoy_tls(ports: dict[str, int], pki: Pki, path: Path) -> Path:
    """envoy/envoy-tls.yaml on free ports, its /etc/kvgate/tls files taken from the test's PKI."""
    render_envoy(ROOT / "envoy" / "envoy-tls.yaml", path, ports)
    files = {
        "/etc/kvgate/tls/ca.crt": pki.ca.cert,
        "/etc/kvgate/tls/envoy.crt": pki.envoy.cert,
        "/etc/kvgate/tls/envoy.key": pki.envoy.key,
    }
    seen: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("filename") in files:
                seen.add(node["filename"])
                node["filename"] = str(files[node["filename"]])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    config = yaml.safe_load(path.read_text())
    walk(config)
    assert seen == set(files), f"envoy-tls.yaml no longer names {set(files) - seen}"
    path.write_text(yaml.safe_dump(config))
    return path


def test_envoy_tls_config_validates(pki: Pki) -> None:
    ports = {name: free_port() for name in ("listener", "gate", "interactive", "long", "async", "admin")}
    path = render_envoy_tls(ports, pki, pki.directory / "envoy-tls.yaml")
    result = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def health_check(port: int, credentials: grpc.ChannelCredentials | None) -> str:
    """The gate's gRPC health answer through a channel with these credentials, or the error code."""

    async def check() -> str:
        target = f"127.0.0.1:{port}"
        options = [("grpc.ssl_target_name_override", GATE_NAME)]
        channel = (
            grpc.aio.insecure_channel(target)
            if credentials is None
            else grpc.aio.secure_channel(target, credentials, options=options)
        )
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
        finally:
            await channel.close()
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    return asyncio.run(check())


def gate_cluster_stats(admin_port: int) -> str:
    """Envoy's counters for its connections to the gate: TLS handshakes, connection failures."""
    reply = post(admin_port, "/stats?filter=kvgate_gate", None)  # type: ignore[arg-type]
    return reply.body.decode()


@pytest.mark.slow
def test_gate_over_mtls_behind_envoy_reserving_on_an_mtls_agent(
    pki: Pki, sp_model_path: Path, pools: tuple[dict[str, int], Upstreams]
) -> None:
    """Envoy -> gate and gate -> agent both over mTLS; a long request is reserved and pinned."""
    pool_ports, upstreams = pools
    tmp = pki.directory
    ports = dict(pool_ports, listener=free_port(), gate=free_port(), admin=free_port())
    agent_port = free_port()
    agent_flags = ["--capacity-tokens", "100000", "--tls-cert", str(pki.agent.cert)]
    agent_flags += ["--tls-key", str(pki.agent.key), "--tls-client-ca", str(pki.ca.cert)]
    config = (
        f"default_model: {{tokenizer: {sp_model_path}}}\n"
        f"headroom: {{agents: [127.0.0.1:{agent_port}]}}\n"
        "tls:\n"
        f"  server: {{cert: {pki.gate.cert}, key: {pki.gate.key}, client_ca: {pki.ca.cert}}}\n"
        f"  agents: {{ca: {pki.ca.cert}, cert: {pki.gate.cert}, key: {pki.gate.key}, "
        f"server_name: {AGENT_NAME}}}\n"
    )
    with ExitStack() as stack:
        agent = agent_process(tmp, "agent", agent_port, f"127.0.0.1:{pool_ports['long']}", agent_flags)
        stack.callback(agent.stop)
        stack.enter_context(gate_process(config, tmp, ports["gate"]))
        envoy_config = render_envoy_tls(ports, pki, tmp / "envoy-tls.yaml")
        envoy = envoy_process(envoy_config, tmp, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)

        # The gate's port speaks only mTLS.
        ca = pki.ca.cert.read_bytes()
        assert health_check(ports["gate"], None) == "UNAVAILABLE"
        assert health_check(ports["gate"], grpc.ssl_channel_credentials(ca)) == "UNAVAILABLE"
        with_cert = grpc.ssl_channel_credentials(ca, pki.envoy.key.read_bytes(), pki.envoy.cert.read_bytes())
        assert health_check(ports["gate"], with_cert) == "SERVING"

        short = post(ports["listener"], "/v1/chat/completions", chat("hello"))
        assert short.status == 200, short.body
        # Headers only the gate sets: the request went through it (failing open would leave none).
        assert upstreams.received[-1].headers.get("x-kvgate-pool") == "interactive", gate_cluster_stats(
            ports["admin"]
        )

        stats = gate_cluster_stats(ports["admin"])
        handshakes = re.search(r"cluster\.kvgate_gate\.ssl\.handshake: (\d+)", stats)
        assert handshakes is not None and int(handshakes.group(1)) >= 1

        long_body = chat(text_with_tokens(sp_model_path, 8_000), max_tokens=1000)
        reply = post_until_admitted(ports["listener"], long_body)
        assert reply.status == 200, (reply.status, reply.headers, agent.log())
        received = upstreams.received[-1]
        assert received.pool == "long"
        assert received.headers["x-kvgate-endpoint"] == f"127.0.0.1:{pool_ports['long']}"
