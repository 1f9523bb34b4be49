"""The gate pins requests only to an engine on its agent's own host (issue 27, "the gate trusts the
endpoint an agent reports").

An agent's reported endpoint is taken when its host is the agent's own (or in
headroom.allowed_endpoints) and its port is allowed (headroom.endpoint_ports, when set); a node whose
agent reports any other is unhealthy, with the reason, and never routed to. Tried against real agents:
in process under the gate's HeadroomView, and as processes behind the real Envoy and gate, where a
rogue agent offering ten times the room of the real node gets nothing: not the prompt, not the key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from texts import text_with_tokens
from waiting import PATIENCE_S, until_async

from kvgate.agent.node import NodeSettings
from kvgate.agent.server import Agent
from kvgate.config import parse_config
from kvgate.config.headroom import EndpointRule, HeadroomSettings, ip_or_none
from kvgate.errors import ConfigError, HeadroomError
from kvgate.harness.client import chat, post, post_until_admitted
from kvgate.harness.envoy import render_envoy
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.headroom.snapshot import NodeView
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
FAST: dict[str, Any] = {"reconnect_initial_s": 0.05, "reconnect_max_s": 0.2}


# --- the rule ---------------------------------------------------------------------------------------


def ips(*hosts: str) -> frozenset[Any]:
    return frozenset(ip_or_none(h) for h in hosts)


def test_the_rule_takes_the_agents_own_host_or_what_is_allowed() -> None:
    own = EndpointRule()
    assert own.problem("10.0.0.5", 8000, ips("10.0.0.5"), ips("10.0.0.5")) == ""
    assert "not the agent's own host (10.0.0.5)" in own.problem(
        "10.0.0.6", 8000, ips("10.0.0.6"), ips("10.0.0.5")
    )
    # A name counts with every address it has: one foreign address is enough to refuse it.
    assert own.problem("engine", 8000, ips("10.0.0.5", "10.9.9.9"), ips("10.0.0.5")) != ""
    nodes = EndpointRule.parse(("10.1.0.0/16", "engine.local"), (8000, 30000))
    assert nodes.problem("10.1.2.3", 30000, ips("10.1.2.3"), ips("10.244.0.7")) == ""
    assert nodes.problem("ENGINE.local", 8000, frozenset(), ips("10.244.0.7")) == "", "names as written"
    assert "port 9100 is not in headroom.endpoint_ports" in nodes.problem(
        "10.1.2.3", 9100, ips("10.1.2.3"), ips("10.1.2.3")
    )


def test_config_errors_name_the_key_and_line() -> None:
    with pytest.raises(ConfigError, match=r":2: headroom: headroom\.allowed_endpoints\[1\]: expected a CIDR"):
        parse_config("headroom:\n  allowed_endpoints: [10.0.0.0/8, 'not a host!']\n")
    with pytest.raises(ConfigError, match=r"headroom\.allowed_endpoints\[0\]: not a CIDR"):
        parse_config("headroom: {allowed_endpoints: [10.0.0.0/33]}\n")
    with pytest.raises(ConfigError, match=r":1: headroom\.endpoint_ports\[0\]: must be <= 65535"):
        parse_config("headroom: {endpoint_ports: [70000]}\n")
    settings = parse_config("headroom: {allowed_endpoints: [10.0.0.0/8], endpoint_ports: [8000]}\n").headroom
    assert settings.endpoint_rule().ports == {8000}


# --- the view, against real agents in process --------------------------------------------------------


@asynccontextmanager
async def following(endpoint: str, agent_host: str = "127.0.0.1", **settings: Any) -> AsyncIterator[NodeView]:
    """The view's node for one agent that reports `endpoint`, once it has spoken."""
    agent = Agent(NodeSettings("n1", endpoint, period_s=0.05, capacity_tokens=40_000))
    port = await agent.start("127.0.0.1:0")
    looked_up: list[str] = []

    async def resolver(host: str, port: int) -> frozenset[str]:
        looked_up.append(host)
        if host == "localhost":
            return frozenset({"127.0.0.1:0"})
        raise HeadroomError(f"cannot resolve {host}")

    view = HeadroomView(
        HeadroomSettings(agents=(f"{agent_host}:{port}",), **FAST, **settings), resolver=resolver
    )
    await view.start()
    try:
        (node,) = await until_async(
            lambda: [n for n in view.snapshot() if n.connected], "the agent's first message", PATIENCE_S
        )
        yield node
    finally:
        await view.stop()
        await agent.stop(grace_s=0)


def test_the_view_marks_a_node_with_a_foreign_endpoint_unhealthy() -> None:
    async def scenario() -> None:
        async with following("127.0.0.1:8000") as node:
            assert node.healthy and node.usable
        async with following("127.0.0.2:8000") as node:
            assert not node.healthy and not node.usable
            assert node.headroom is not None and node.headroom.reason.startswith(
                "endpoint_refused: 127.0.0.2"
            )
        async with following("127.0.0.2:8000", allowed_endpoints=("127.0.0.0/8",)) as node:
            assert node.healthy
        async with following("127.0.0.1:8000", endpoint_ports=(9000,)) as node:
            assert not node.healthy and "port 8000" in node.headroom.reason  # type: ignore[union-attr]
        async with following("127.0.0.1:8000", agent_host="localhost") as node:
            assert node.healthy, "an agent named by host name: the addresses of the name"
        async with following("engine.invalid:8000") as node:
            assert not node.healthy and "cannot resolve engine.invalid" in node.headroom.reason  # type: ignore[union-attr]

    asyncio.run(scenario())


# --- behind the real Envoy and gate ------------------------------------------------------------------


@pytest.mark.slow
def test_a_rogue_agents_endpoint_is_never_used(
    tmp_path: Path, sp_model_path: Path, pools: tuple[dict[str, int], Upstreams]
) -> None:
    """Two rogues offer 400k tokens each: one an engine on another host, one a port on its own host
    where a listener records what it gets. Every long request goes to the real node's engine."""
    pool_ports, upstreams = pools
    capture = Upstreams({"capture": free_port()})
    capture.start()
    ports = dict(pool_ports, listener=free_port(), gate=free_port(), admin=free_port())
    rogue_args = ["--capacity-tokens", "400000", "--safety-ratio", "1.0"]
    body = chat(text_with_tokens(sp_model_path, 6_000), max_tokens=500)
    try:
        with ExitStack() as stack:
            agents = [
                agent_process(
                    tmp_path,
                    name,
                    free_port(),
                    endpoint,
                    rogue_args if name.startswith("rogue") else ["--capacity-tokens", "40000"],
                )
                for name, endpoint in (
                    ("node-a", f"127.0.0.1:{pool_ports['long']}"),
                    ("rogue-elsewhere", f"127.0.0.2:{pool_ports['long']}"),
                    ("rogue-port", f"127.0.0.1:{capture.ports['capture']}"),
                )
            ]
            for agent in agents:
                stack.callback(agent.stop)
            listed = ", ".join(f"127.0.0.1:{a.port}" for a in agents)
            config = (
                f"default_model: {{tokenizer: {sp_model_path}}}\n"
                f"headroom: {{agents: [{listed}], endpoint_ports: [{pool_ports['long']}]}}\n"
                "admission: {max_wait_s: 0.5}\n"
            )
            envoy_config = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp_path / "envoy.yaml", ports)
            envoy = envoy_process(envoy_config, tmp_path, ports["admin"], ports["listener"])
            stack.callback(envoy.stop)
            gate = stack.enter_context(gate_process(config, tmp_path, ports["gate"]))
            first = post_until_admitted(ports["listener"], body)
            replies = [
                first,
                *(
                    post(
                        ports["listener"], "/v1/chat/completions", body, {"authorization": "Bearer sk-VICTIM"}
                    )
                    for _ in range(3)
                ),
            ]
            log = gate.log()
    finally:
        capture.stop()
    assert [r.status for r in replies] == [200] * 4, [r.body[:200] for r in replies]
    assert all(r.json()["pool"] == "long" for r in replies)
    assert not capture.received, "the rogue's listener got nothing"
    pinned = {r.headers["x-kvgate-endpoint"] for r in upstreams.received if r.pool == "long"}
    assert pinned == {f"127.0.0.1:{pool_ports['long']}"}
    assert "127.0.0.2 (127.0.0.2) is not the agent's own host" in log
    assert f"port {capture.ports['capture']} is not in headroom.endpoint_ports" in log
