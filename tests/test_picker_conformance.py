"""The Gateway API Inference Extension's conformance assertions that apply to a picker and its gateway,
run against kvgate as the pool's endpoint picker behind the real Envoy in the InferencePool
configuration (envoy/envoy-inferencepool.yaml), on simulated vLLM nodes; the same on the real vLLM
engines is in tests/test_engines_e2e.py.

Ported from kubernetes-sigs/gateway-api-inference-extension conformance/tests @84436a96:
- GatewayFollowingEPPRouting (gateway_following_epp_routing.go) and its data-parallel variant
  (gateway_following_epp_routing_dp.go): for each allowed set of endpoints ([e2], [e0, e1],
  [e0, e1, e2]; here engines on one IP and distinct ports, as the variant's ranks are), 100 requests,
  10 at a time, each answered 200 by an engine of the set. The suite's picker takes the set from a
  test-only header (`test-epp-endpoint-selection`, pkg/lwepp/handlers/request.go); kvgate picks by its
  own rules, so the set is given the way a gateway gives one, as the protocol's subset hint, and each
  request is also held to the gateway serving the engine kvgate named first.
- GatewayDestinationEndpointServed (gateway_destination_endpoint_served.go): a request held to one
  engine is served there, and the served endpoint the gateway reports (`envoy.lb` /
  `x-gateway-destination-endpoint-served`) is exactly that engine's `ip:port`. The suite's picker
  copies the report into a response header; kvgate keeps engine addresses from clients, so the report
  is read where the gateway writes it (Envoy's access log of the same metadata) and where the picker
  acts on it (a reserved request's reservation stays where it was served).
- EppUnAvailableFailOpen (epp_unavailable_fail_open.go) and InferencePoolInvalidEPPService
  (inferencepool_invalid_epp_service.go): with the picker unreachable, FailClose answers a 5xx. FailOpen
  is held to Envoy's own behaviour, not the suite's expectation of a 200: Envoy fails a
  FULL_DUPLEX_STREAMED request closed once its body went to the picker (ext_proc.cc
  Filter::failureModeAllow), so only bodiless requests pass (the suite's own FailOpen test takes down
  another pool's picker since a6306375, so it passes whatever the gateway does).

The suite has no test for a subset hint, a fallback list or 503 on an empty subset: those are the
protocol's (docs/proposals/004-endpoint-picker-protocol), held in tests/test_picker.py. The other
conformance tests check Kubernetes status (Accepted, ResolvedRefs) or HTTPRoute matching, which a
picker has no part in; tests/test_chart_inferencepool.py checks the chart's objects against the API.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_picker import CHAT, counted, fast_sim, picker_envoy
from test_soft_pools import node_agent, page, sim_node
from texts import text_with_tokens
from waiting import until

from kvgate.harness.client import Reply, chat, post
from kvgate.harness.processes import Service
from kvgate.harness.stack import envoy_process, gate_process
from kvgate.localports import free_port
from kvgate.names import DESTINATION_HEADER

pytestmark = pytest.mark.slow

# Per allowed set, as the suite sends them (gateway_following_epp_routing.go: 100 requests, 10 at once).
REQUESTS = 100
AT_ONCE = 10
REQUEST_HEADER = "x-conformance-request"
# What the gateway did with each request: the engine it connected to, the served endpoint it reported
# to the picker, and the engines the picker named.
ACCESS_LOG_FORMAT = (
    f"%REQ({REQUEST_HEADER})% %UPSTREAM_HOST% "
    "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint-served)% "
    f"%REQ({DESTINATION_HEADER})% %RESPONSE_CODE%\n"
)


@dataclass(frozen=True)
class Pool:
    listener: int
    gate: Service
    engines: dict[str, str]  # name -> ip:port
    log: Path
    long_agent: Service

    def served(self) -> dict[str, Served]:
        return gateway_log(self.log)


@dataclass(frozen=True)
class Served:
    """What the gateway logged of one request."""

    upstream: str  # the engine it connected to
    reported: str  # the served endpoint it reported to the picker (envoy.lb)
    named: list[str]  # the engines the picker named, in order
    status: str


def gateway_log(log: Path) -> dict[str, Served]:
    """Envoy's access log (ACCESS_LOG_FORMAT) by request id (REQUEST_HEADER)."""
    lines = [line.split(" ") for line in log.read_text().splitlines() if line.strip()]
    return {f[0]: Served(f[1], f[2], f[3].split(","), f[4]) for f in lines if len(f) == 5}


def check_following(served: Served, allowed: set[str]) -> None:
    """GatewayFollowingEPPRouting and GatewayDestinationEndpointServed for one request: answered, the
    engine the picker named first served it and is what the gateway reported, and the picker named
    only engines of the set."""
    assert served.status == "200"
    assert served.upstream == served.reported == served.named[0], "the gateway followed the picker"
    assert set(served.named) <= allowed, "the picker named only engines of the set"


def with_access_log(envoy_config: Path, log: Path) -> None:
    shown = yaml.safe_load(envoy_config.read_text())
    manager = shown["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(log),
                "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
            },
        }
    ]
    envoy_config.write_text(yaml.safe_dump(shown, sort_keys=False))


SUBSETS = {"e2": ("chat-b",), "e0e1": ("long", "chat-a"), "all": ("long", "chat-a", "chat-b")}


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, sp_model_path: Path) -> Iterator[Pool]:
    """Three engines in one pool (a long one and two interactive ones, each with its agent), kvgate as
    the picker, Envoy as the gateway with a route per allowed set and per single engine."""
    tmp = tmp_path_factory.mktemp("conformance")
    with ExitStack() as stack:
        nodes = {name: fast_sim(stack, tmp, name, sp_model_path) for name in ("long", "chat-a", "chat-b")}
        engines = {name: f"127.0.0.1:{node.port}" for name, node in nodes.items()}
        long_agent = node_agent(stack, tmp, nodes["long"])
        chat_agents = [
            node_agent(stack, tmp, nodes[n], "--role", "interactive") for n in ("chat-a", "chat-b")
        ]
        ports: dict[str, Any] = {
            "interactive": [nodes["chat-a"].port, nodes["chat-b"].port],
            "long": nodes["long"].port,
        }
        ports |= {"listener": free_port(), "gate": free_port(), "admin": free_port()}
        subsets = {name: [engines[e] for e in members] for name, members in SUBSETS.items()}
        subsets |= {f"only-{name}": [endpoint] for name, endpoint in engines.items()}
        envoy_config = picker_envoy(tmp, ports, subsets)
        log = tmp / "access.log"
        with_access_log(envoy_config, log)
        envoy = envoy_process(envoy_config, tmp, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        interactive = ", ".join(f"'127.0.0.1:{a.port}'" for a in chat_agents)
        config = (
            "server: {protocol: endpoint-picker}\n"
            "default_model: {max_total_tokens: 16384, interactive_max_tokens: 1024, "
            f"tokenizer: {sp_model_path}}}\n"
            f"headroom: {{agents: ['127.0.0.1:{long_agent.port}']}}\n"
            f"interactive_headroom: {{agents: [{interactive}]}}\n"
            "soft_pools: {borrow: false}\n"
        )
        gate = stack.enter_context(gate_process(config, tmp, ports["gate"]))
        until(
            lambda: counted(page(gate.metrics_port), "kvgate_node_fresh") == 3, "the picker follows all three"
        )
        until(
            lambda: post(ports["listener"], CHAT, chat("hello", max_tokens=4)).status == 200,
            "a chat answered",
        )
        yield Pool(ports["listener"], gate, engines, log, long_agent)


_ids = itertools.count()


def ask(pool: Pool, subset: str, body: bytes) -> tuple[str, Reply]:
    request = f"r{next(_ids)}"
    headers = {"x-test-subset": subset, REQUEST_HEADER: request}
    return request, post(pool.listener, CHAT, body, headers=headers, timeout=60)


@pytest.mark.parametrize("subset", list(SUBSETS))
def test_gateway_following_epp_routing(pool: Pool, subset: str) -> None:
    """GatewayFollowingEPPRouting: 100 requests, 10 at a time, each served by an engine of the set; the
    gateway connected to the engine the picker named first, and reported that one as served."""
    allowed = {pool.engines[name] for name in SUBSETS[subset]}
    body = chat("Write as if you were a critic: San Francisco", max_tokens=4)
    with ThreadPoolExecutor(AT_ONCE) as workers:
        answers = list(workers.map(lambda _: ask(pool, subset, body), range(REQUESTS)))
    until(lambda: {r for r, _ in answers} <= pool.served().keys(), "every request in Envoy's access log")
    served = pool.served()

    for request, reply in answers:
        assert reply.status == 200, reply.body[:300]
        assert pool.engines[reply.headers["x-kvgate-sim-node"]] in allowed
        check_following(served[request], allowed)


def test_gateway_destination_endpoint_served(pool: Pool, sp_model_path: Path) -> None:
    """GatewayDestinationEndpointServed: a request held to each engine in turn is served by it, and the
    gateway reports exactly that engine's ip:port; a long request reserved on the long engine is served
    there, so its reservation stays where it is."""
    asked = {
        name: ask(pool, f"only-{name}", chat("where am I served?", max_tokens=4)) for name in pool.engines
    }
    long_request, long_reply = ask(pool, "all", chat(text_with_tokens(sp_model_path, 6_000), max_tokens=20))
    until(lambda: {r for r, _ in asked.values()} | {long_request} <= pool.served().keys(), "all logged")
    served = pool.served()

    for name, (request, reply) in asked.items():
        assert (reply.status, reply.headers.get("x-kvgate-sim-node")) == (200, name)
        check_following(served[request], {pool.engines[name]})
    assert (long_reply.status, long_reply.headers.get("x-kvgate-reason")) == (200, "long")
    check_following(served[long_request], {pool.engines["long"]})
    gate_metrics = page(pool.gate.metrics_port)
    assert counted(gate_metrics, "kvgate_gate_picker_served_elsewhere_total") == 0
    agent_metrics = page(pool.long_agent.metrics_port)
    assert counted(agent_metrics, "kvgate_agent_reservations_total", event="granted") >= 1


@pytest.mark.parametrize("fail_open", [False, True])
def test_epp_unavailable_the_gateway_does_what_the_pool_s_failure_mode_says(
    tmp_path: Path, sp_model_path: Path, fail_open: bool
) -> None:
    """EppUnAvailableFailOpen and InferencePoolInvalidEPPService. The InferencePool's
    endpointPickerRef.failureMode is the ext_proc filter's failure_mode_allow. FailClose, the API's
    default and the shipped file's, answers 500 (the suite takes any of 500-504) while the picker is
    unreachable. FailOpen sends on what carries no body. A request with a body fails closed once the
    filter has received its body (FULL_DUPLEX_STREAMED: Envoy cannot take it back from the picker),
    whatever the setting (envoy source/extensions/filters/http/ext_proc/ext_proc.cc @v1.40.0,
    Filter::failureModeAllow), and goes on unprocessed when the picker's stream failed first. Which
    comes first Envoy does not order: a CI run on 2026-12-05 got the engine's 200 where every run
    before had the 500. So FailOpen gives an inference request either answer, never none."""
    with ExitStack() as stack:
        chat_node = sim_node(stack, tmp_path, "interactive", sp_model_path)
        ports: dict[str, Any] = {"interactive": chat_node.port, "long": chat_node.port}
        ports |= {"listener": free_port(), "gate": free_port(), "admin": free_port()}  # no gate listens
        envoy_config = picker_envoy(tmp_path, ports, {})
        shown = yaml.safe_load(envoy_config.read_text())
        manager = shown["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        assert ext_proc["typed_config"]["failure_mode_allow"] is False, "the shipped file fails closed"
        ext_proc["typed_config"]["failure_mode_allow"] = fail_open
        envoy_config.write_text(yaml.safe_dump(shown, sort_keys=False))
        envoy = envoy_process(envoy_config, tmp_path, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        asked = post(ports["listener"], CHAT, chat("hello", max_tokens=4))
        listed = post(ports["listener"], "/v1/models", None)  # a GET

    if fail_open and asked.status == 200:
        assert asked.headers.get("x-kvgate-sim-node") == "interactive", "the engine answered, unpicked"
    else:
        assert asked.status == 500, asked.body[:300]
    assert listed.status == (200 if fail_open else 500), listed.body[:300]
