"""Fair shares through the real Envoy (envoy/envoy-jwt.yaml): the tenant each request is charged to is
the one its verified token names, whatever header the client adds, and the gate's line of long
requests goes by attained service, so a tenant that queued behind another's flood is served next."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from test_envoy_trust import AUDIENCE, ENVOY, ISSUER, with_jwks
from texts import text_with_tokens
from waiting import until

from kvgate.agent.sources.engines import promtext
from kvgate.config.headroom import HeadroomSettings
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.jwt import Signer
from kvgate.harness.processes import Service
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

CHAT = "/v1/chat/completions"
# Reservation-only capacity: 4,500 admissible at the agent's 0.9, room for one 3,000-token request.
CAPACITY = 5_000


@dataclass(frozen=True)
class FairStack:
    listener: int
    gate: Service
    agent: str
    upstreams: Upstreams


@contextmanager
def fair_stack(tmp: Path, sp_model: Path, jwks: str, *, fairness: bool) -> Iterator[FairStack]:
    ports = {name: free_port() for name in ("listener", "gate", "interactive", "long", "async", "admin")}
    with ExitStack() as stack:
        upstreams = Upstreams({pool: ports[pool] for pool in ("interactive", "long", "async")})
        upstreams.start()
        stack.callback(upstreams.stop)
        agent_port = free_port()
        agent = agent_process(
            tmp, "agent", agent_port, f"127.0.0.1:{ports['long']}", ["--capacity-tokens", str(CAPACITY)]
        )
        stack.callback(agent.stop)
        config_path = render_envoy(ENVOY / "envoy-jwt.yaml", tmp / "envoy.yaml", ports)
        config = yaml.safe_load(config_path.read_text())
        with_jwks(jwks)(config)
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        gate_config = (
            f"default_model: {{tokenizer: {sp_model}, interactive_max_tokens: 1024}}\n"
            f"headroom: {{agents: ['127.0.0.1:{agent_port}'], stale_after_s: 5}}\n"
            "admission: {max_wait_s: 60}\n"
            f"fairness: {{enabled: {str(fairness).lower()}}}\n"
        )
        gate = stack.enter_context(gate_process(gate_config, tmp, ports["gate"]))
        envoy = envoy_process(config_path, tmp, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        yield FairStack(ports["listener"], gate, f"127.0.0.1:{agent_port}", upstreams)


async def _blocker(agent: str, tokens: int, *, release: bool = False) -> None:
    view = HeadroomView(HeadroomSettings(agents=(agent,)))
    await view.start()
    try:
        if release:
            await view.release(agent, "blocker")
        else:
            while view.snapshot()[0].headroom is None:
                await view.wait_update(1.0)
            assert (await view.reserve(agent, "blocker", tokens, lease_s=600)).granted
    finally:
        await view.stop()


def gate_figure(gate: Service, name: str, **labels: str) -> float:
    assert gate.metrics_port is not None
    text = post(gate.metrics_port, "/metrics", None).body.decode()
    return sum(
        s.value
        for s in promtext.samples(text, name)
        if all(promtext.label(s, key) == value for key, value in labels.items())
    )


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> Signer:
    return Signer.create(tmp_path_factory.mktemp("jwt-fair"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fairness", "order"), [(True, ["a1", "b1", "a2", "a3"]), (False, ["a1", "a2", "a3", "b1"])]
)
def test_a_tenant_queued_behind_anothers_flood_is_served_next_and_cannot_be_impersonated(
    tmp_path: Path, sp_model_path: Path, signer: Signer, fairness: bool, order: list[str]
) -> None:
    """Room for one long request at a time, held by a reservation of the test's own while tenant a
    queues three long requests (each also claiming to be tenant b in a header of its own) and then b
    queues one. Once the room frees: with fair shares b, lifted to a's counter when it started
    waiting, goes second, as soon as a was charged for one; without, it goes last. The gate counts
    a's three requests as a's: the claimed header never reaches it."""
    tokens = {name: signer.token(ISSUER, aud=AUDIENCE, tenant=name) for name in ("a", "b")}
    prompt = text_with_tokens(sp_model_path, 2_900)
    with fair_stack(tmp_path, sp_model_path, signer.jwks(), fairness=fairness) as stack:
        until(lambda: gate_figure(stack.gate, "kvgate_node_fresh") == 1, "the gate follows the agent")
        asyncio.run(_blocker(stack.agent, int(CAPACITY * 0.9) - 500))
        replies: dict[str, Reply] = {}

        def send(name: str, tenant: str) -> None:
            headers = {
                "authorization": f"Bearer {tokens[tenant]}",
                "x-kvgate-tenant": "b",  # a client's claim, removed before anything reads it
                "x-test-request": name,
            }
            replies[name] = post(
                stack.listener, CHAT, chat(f"{name} {prompt}", max_tokens=50), headers, timeout=90
            )

        threads = []
        for waiting, (name, tenant) in enumerate((("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")), 1):
            thread = threading.Thread(target=send, args=(name, tenant))
            thread.start()
            threads.append(thread)
            until(
                lambda n=waiting: gate_figure(stack.gate, "kvgate_gate_admission_waiting") == n,
                f"{waiting} long requests waiting",
            )
        asyncio.run(_blocker(stack.agent, 0, release=True))
        for thread in threads:
            thread.join(timeout=120)
        served = [r.headers.get("x-test-request") for r in stack.upstreams.received if r.pool == "long"]
        counted = {
            tenant: gate_figure(
                stack.gate, "kvgate_gate_tenant_requests_total", tenant=tenant, outcome="waited"
            )
            for tenant in ("a", "b")
        }

    assert all(reply.status == 200 for reply in replies.values()), {k: r.status for k, r in replies.items()}
    assert served == order
    assert counted == {"a": 3, "b": 1}


@pytest.mark.slow
def test_two_gates_order_their_lines_by_the_service_their_shared_agents_saw(
    tmp_path: Path, sp_model_path: Path, signer: Signer
) -> None:
    """Two gates, each behind its own Envoy, share the agents. On gate two, tenant a then tenant b
    queue for a node a reservation of the test's own holds. Gate one serves a on a smaller node
    (gate two's requests are too big for it). The agents' totals reach gate two, which then serves b
    first; by its own charges alone a and b would be level and a's arrival would go first."""
    tokens = {name: signer.token(ISSUER, aud=AUDIENCE, tenant=name) for name in ("a", "b")}
    big, small = text_with_tokens(sp_model_path, 2_900), text_with_tokens(sp_model_path, 1_500)
    with ExitStack() as stack:
        ports = {name: free_port() for name in ("interactive", "long", "async")}
        upstreams = Upstreams(ports)  # "long": the node both gates want; "async" stands for the small one
        upstreams.start()
        stack.callback(upstreams.stop)
        agents = {}
        for node, capacity in (("long", CAPACITY), ("async", 2_000)):
            port = free_port()
            agent = agent_process(
                tmp_path,
                f"agent-{node}",
                port,
                f"127.0.0.1:{ports[node]}",
                ["--capacity-tokens", str(capacity)],
            )
            stack.callback(agent.stop)
            agents[node] = f"127.0.0.1:{port}"
        gates = []
        for name, followed in (("one", [agents["async"]]), ("two", [agents["long"], agents["async"]])):
            tmp = tmp_path / name
            tmp.mkdir()
            local = dict(ports, listener=free_port(), gate=free_port(), admin=free_port())
            config_path = render_envoy(ENVOY / "envoy-jwt.yaml", tmp / "envoy.yaml", local)
            config = yaml.safe_load(config_path.read_text())
            with_jwks(signer.jwks())(config)
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            listed = ", ".join(f"'{agent}'" for agent in followed)
            gate_config = (
                f"default_model: {{tokenizer: {sp_model_path}, interactive_max_tokens: 1024}}\n"
                f"headroom: {{agents: [{listed}], stale_after_s: 5}}\n"
                "admission: {max_wait_s: 60}\nfairness: {enabled: true}\n"
            )
            gate = stack.enter_context(gate_process(gate_config, tmp, local["gate"]))
            envoy = envoy_process(config_path, tmp, local["admin"], local["listener"])
            stack.callback(envoy.stop)
            following = len(followed)
            until(
                lambda g=gate, n=following: gate_figure(g, "kvgate_node_fresh") == n,
                f"gate {name} follows its agents",
            )
            gates.append((local["listener"], gate))
        (one_listener, _), (two_listener, two) = gates
        asyncio.run(_blocker(agents["long"], int(CAPACITY * 0.9) - 500))
        replies: dict[str, Reply] = {}

        def send(listener: int, name: str, tenant: str, prompt: str) -> None:
            headers = {"authorization": f"Bearer {tokens[tenant]}", "x-test-request": name}
            body = chat(f"{name} {prompt}", max_tokens=50)
            replies[name] = post(listener, CHAT, body, headers, timeout=90)

        threads = []
        for waiting, (name, tenant) in enumerate((("a-two", "a"), ("b-two", "b")), 1):
            threads.append(threading.Thread(target=send, args=(two_listener, name, tenant, big)))
            threads[-1].start()
            until(
                lambda n=waiting: gate_figure(two, "kvgate_gate_admission_waiting") == n,
                f"{waiting} waiting on gate two",
            )
        send(one_listener, "a-one", "a", small)  # served at once, on the small node
        until(
            lambda: (
                gate_figure(two, "kvgate_gate_tenant_attained", tenant="a")
                > gate_figure(two, "kvgate_gate_tenant_attained", tenant="b")
            ),
            "gate two sees what gate one served a",
        )
        asyncio.run(_blocker(agents["long"], 0, release=True))
        for thread in threads:
            thread.join(timeout=120)
        served = [r.headers.get("x-test-request") for r in upstreams.received if r.pool == "long"]

    assert all(reply.status == 200 for reply in replies.values()), {k: r.status for k, r in replies.items()}
    assert [r.headers.get("x-test-request") for r in upstreams.received if r.pool == "async"] == ["a-one"]
    assert served == ["b-two", "a-two"]
