"""kvgate as an InferencePool's endpoint picker (server.protocol: endpoint-picker): the protocol's names
read and written, the engine chosen within the gateway's subset hint, and end to end through the real
Envoy configured as the pool's gateway (envoy/envoy-inferencepool.yaml) against simulated vLLM nodes."""

from __future__ import annotations

import copy
import json
import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from test_soft_pools import CAPACITY, headroom, node_agent, page, sim_node
from texts import text_with_tokens
from waiting import until

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.agent.sources.engines import promtext
from kvgate.config import parse_config
from kvgate.errors import ConfigError
from kvgate.gate import responses
from kvgate.gate.admission import Admission
from kvgate.gate.picker import served_endpoint, subset_hint
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service, sim_command
from kvgate.harness.stack import agent_process, envoy_process, gate_process, started
from kvgate.headroom.snapshot import NodeRole, NodeView
from kvgate.localports import free_port
from kvgate.names import DESTINATION_HEADER, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE
from kvgate.policy import Reason, Route
from kvgate.policy.endpoints import least_busy, within

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
PICKER_YAML = ROOT / "envoy" / "envoy-inferencepool.yaml"


def with_hint(value: Any) -> ProcessingRequest:
    message = ProcessingRequest()
    message.metadata_context.filter_metadata[SUBSET_NAMESPACE].update({SUBSET_KEY: value})
    return message


def test_the_subset_hint_is_read_as_a_list_or_as_a_flat_string() -> None:
    assert subset_hint(ProcessingRequest()) is None, "no hint: the whole pool"
    assert subset_hint(with_hint(["10.0.0.1:8000", "10.0.0.2:8000"])) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert subset_hint(with_hint("10.0.0.1:8000, 10.0.0.2:8000")) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert subset_hint(with_hint([])) == frozenset(), "an empty hint allows nothing"
    assert subset_hint(with_hint(3)) == frozenset(), "a hint of another type allows nothing"


def test_the_served_endpoint_is_read_from_envoy_lb() -> None:
    message = ProcessingRequest()
    assert served_endpoint(message) is None
    message.metadata_context.filter_metadata[LB_NAMESPACE].update({SERVED_KEY: "10.0.0.2:8000"})
    assert served_endpoint(message) == "10.0.0.2:8000"


def view(name: str, *, waiting: int = 0, running: int = 0, fresh: bool = True) -> NodeView:
    node = headroom(name, CAPACITY, NodeRole.INTERACTIVE)
    data = node.headroom
    assert data is not None
    busy = type(data)(
        **{**{f: getattr(data, f) for f in data.__slots__}, "waiting": waiting, "running": running}
    )
    return NodeView(name, busy, 0.0, True, fresh, True)


def test_unreserved_requests_go_to_the_least_busy_engines_within_the_hint() -> None:
    nodes = [view("a", running=3), view("b", waiting=1), view("c", running=1), view("d", fresh=False)]
    endpoints = {n.agent: f"{n.agent}.engine:8000" for n in nodes}
    assert least_busy(nodes, None) == (endpoints["c"], endpoints["a"], endpoints["b"]), "queue, then running"
    assert least_busy(nodes, frozenset({endpoints["a"], endpoints["b"]})) == (endpoints["a"], endpoints["b"])
    assert least_busy(nodes, frozenset({endpoints["d"]})) == (), "a stale node is no pick"
    assert least_busy(nodes, frozenset()) == ()
    assert [n.agent for n in within(nodes, frozenset({endpoints["b"]}))] == ["b"]


@pytest.mark.parametrize(("count", "named"), [(3, 3), (1, 1)])
def test_server_picker_endpoints_bounds_the_engines_named_for_a_request_that_reserves_nothing(
    count: int, named: int
) -> None:
    """1 for a gateway that takes one endpoint (agentgateway reads one `ip:port`; a list is an error)."""
    clock = ManualClock()
    interactive = FakeHeadroom(clock, stale_after_s=5.0)
    for name in ("a", "b", "c", "d"):
        interactive.add_node(name, 10_000)
    config = parse_config(f"server: {{picker_endpoints: {count}}}")
    admission = Admission(
        config.admission, None, interactive, clock=clock, picker_endpoints=config.server.picker_endpoints
    )
    picked = admission.pick_unreserved(Route("interactive", Reason.SHORT, 100), None)
    assert isinstance(picked, Route) and picked.endpoint is not None
    assert len(picked.endpoint.split(",")) == named


def test_the_picked_answer_names_the_engine_in_the_header_and_envoy_lb_alike() -> None:
    route = Route("long", Reason.LONG, 9_000, "10.0.0.2:8000")
    identity = responses.Identity("anonymous", "normal")
    answer = responses.picked(route, [], {}, "kvgate", identity=identity, session="r1", body_bytes=1234)
    headers = {
        h.header.key: h.header.raw_value.decode()
        for h in answer.request_headers.response.header_mutation.set_headers
    }
    assert headers[DESTINATION_HEADER] == "10.0.0.2:8000" and headers["content-length"] == "1234"
    lb = answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    assert lb[DESTINATION_HEADER].string_value == "10.0.0.2:8000"


def test_the_body_goes_back_in_chunks_of_at_most_62_000_bytes_the_last_one_ending_the_stream() -> None:
    body = bytes(range(256)) * 500  # 128,000 bytes
    chunks = responses.streamed_request_body(body, end_of_stream=True)
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert [len(s.body) for s in streamed] == [62_000, 62_000, 4_000]
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    before_trailers = responses.streamed_request_body(body, end_of_stream=False)
    assert not any(
        c.request_body.response.body_mutation.streamed_response.end_of_stream for c in before_trailers
    )
    (empty,) = responses.streamed_request_body(b"", end_of_stream=True)
    assert empty.request_body.response.body_mutation.streamed_response.end_of_stream


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("server: {protocol: endpoint-picker}\ninteractive_headroom: {agents: ['a:1']}", "headroom.agents"),
        ("server: {protocol: endpoint-picker}\nheadroom: {agents: ['a:1']}", "interactive_headroom.agents"),
        (
            "server: {protocol: endpoint-picker}\nheadroom: {agents: ['a:1']}\n"
            "interactive_headroom: {agents: ['b:1']}\nadmission: {async_fallback: true}",
            "admission.async_fallback",
        ),
        (
            "server: {protocol: endpoint-picker}\nheadroom: {agents: ['a:1']}\n"
            "interactive_headroom: {agents: ['b:1']}\ndefault_model: {async_mode: prefer}",
            "default_model.async_mode",
        ),
    ],
)
def test_picker_mode_needs_both_pools_agents_and_no_async_pool(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(text)


def picker_envoy(tmp: Path, ports: dict[str, Any], subsets: dict[str, list[str]]) -> Path:
    """envoy-inferencepool.yaml for this run, with a route per entry of `subsets`: a request whose
    `x-test-subset` header names the entry gets that subset hint (its own copy of the shipped
    kvgate.subset_hint filter, turned on by the route, as a gateway's route would)."""
    rendered = render_envoy(PICKER_YAML, tmp / "envoy.yaml", ports)
    config = yaml.safe_load(rendered.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = manager["http_filters"]
    shipped = next(f for f in filters if f["name"] == "kvgate.subset_hint")
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    for name, endpoints in subsets.items():
        hint = copy.deepcopy(shipped)
        hint["name"] = f"kvgate.subset_hint.{name}"
        hint["typed_config"]["metadata"][0]["value"][SUBSET_KEY] = endpoints
        filters.insert(filters.index(shipped), hint)
        on = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
        match = {"prefix": "/", "headers": [{"name": "x-test-subset", "string_match": {"exact": name}}]}
        routes.insert(
            0, {"match": match, "route": routes[-1]["route"], "typed_per_filter_config": {hint["name"]: on}}
        )
    rendered.write_text(yaml.safe_dump(config, sort_keys=False))
    return rendered


def picker_stack(
    stack: ExitStack,
    tmp: Path,
    nodes: tuple[Service, Service],
    model: str,
    subsets: dict[str, list[str]],
    *chat_flags: str,
) -> tuple[int, Service, Service]:
    """Agents for the (long, interactive) `nodes`, the gate in picker mode with `model` as its
    default_model's extra keys, and Envoy as the pool's gateway with the `subsets` routes; returns the
    listener's port, once a chat is answered, the gate and the long node's agent. Answers also show
    the prompt tokens the gate estimated (x-kvgate-prompt-tokens)."""
    long_node, chat_node = nodes
    long_agent = node_agent(stack, tmp, long_node)
    chat_agent = node_agent(stack, tmp, chat_node, *chat_flags)
    ports = {"interactive": chat_node.port, "long": long_node.port}
    ports |= {"listener": free_port(), "gate": free_port(), "admin": free_port()}
    config = (
        "server: {protocol: endpoint-picker}\n"
        f"default_model: {{max_total_tokens: 16384, {model}}}\n"
        f"headroom: {{agents: ['127.0.0.1:{long_agent.port}']}}\n"
        f"interactive_headroom: {{agents: ['127.0.0.1:{chat_agent.port}']}}\n"
        "soft_pools: {borrow: false}\n"
    )
    envoy_config = picker_envoy(tmp, ports, subsets)
    shown = yaml.safe_load(envoy_config.read_text())
    manager = shown["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["route_config"]["response_headers_to_add"].append(
        {"header": {"key": "x-kvgate-prompt-tokens", "value": "%DYNAMIC_METADATA(kvgate:prompt_tokens)%"}}
    )
    envoy_config.write_text(yaml.safe_dump(shown, sort_keys=False))
    envoy = envoy_process(envoy_config, tmp, ports["admin"], ports["listener"])
    stack.callback(envoy.stop)
    gate = stack.enter_context(gate_process(config, tmp, ports["gate"]))
    listener = ports["listener"]
    until(lambda: post(listener, CHAT, chat("hello", max_tokens=4)).status == 200, "a chat answered")
    return listener, gate, long_agent


@pytest.mark.slow
def test_through_envoy_as_an_inferencepool_gateway_requests_reach_the_engines_kvgate_picked(
    tmp_path: Path, sp_model_path: Path
) -> None:
    with ExitStack() as stack:
        long_node = sim_node(stack, tmp_path, "long", sp_model_path)
        chat_node = sim_node(stack, tmp_path, "interactive", sp_model_path)
        subsets = {"long": [f"127.0.0.1:{long_node.port}"], "none": []}
        model = f"tokenizer: {sp_model_path}, interactive_max_tokens: 1024"
        nodes = (long_node, chat_node)
        listener, gate, _ = picker_stack(stack, tmp_path, nodes, model, subsets, "--role", "interactive")

        short = post(listener, CHAT, chat("what is the capital of France?", max_tokens=4))
        long = post(listener, CHAT, chat(text_with_tokens(sp_model_path, 6_000), max_tokens=50), timeout=60)
        too_long = post(listener, CHAT, chat(text_with_tokens(sp_model_path, 20_000), max_tokens=50))
        hinted = post(listener, CHAT, chat("hello again", max_tokens=4), headers={"x-test-subset": "long"})
        nowhere = post(listener, CHAT, chat("and again", max_tokens=4), headers={"x-test-subset": "none"})
        assert gate.metrics_port is not None
        metrics = post(gate.metrics_port, "/metrics", None).body.decode()

    assert (short.status, short.headers.get("x-kvgate-sim-node")) == (200, "interactive")
    assert (long.status, long.headers.get("x-kvgate-sim-node")) == (200, "long")
    assert long.headers.get("x-kvgate-reason") == "long"
    assert too_long.status == 413 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert (hinted.status, hinted.headers.get("x-kvgate-sim-node")) == (200, "long"), (
        "the hint is never escaped"
    )
    assert nowhere.status == 503 and nowhere.headers.get("x-kvgate-reason") == "no_healthy_node"
    assert "retry-after" in nowhere.headers
    # Every response came back through the picker, chunk by chunk, and nothing failed in it.
    assert 'kind="response_body"' in metrics and "internal_errors" not in metrics


def fast_sim(stack: ExitStack, tmp: Path, name: str, sp_model: Path) -> Service:
    """A simulated vLLM node that answers at once: 20,000 tokens a second each way."""
    port = free_port()
    argv = sim_command("--listen", f"127.0.0.1:{port}", "--node-name", name, "--tokenizer", str(sp_model))
    flags = ("--kv-capacity-tokens", "65536", "--max-model-len", "16384", "--model-name", "test-model")
    speed = ("--prefill-tokens-per-s", "20000", "--decode-tokens-per-s", "20000")
    service = started(Service(name, [*argv, *flags, *speed], tmp, port=port), port)
    stack.callback(service.stop)
    return service


@pytest.mark.slow
def test_the_budget_charged_without_max_tokens_follows_what_the_answers_produced(
    tmp_path: Path, sp_model_path: Path
) -> None:
    """The simulator writes 32-256 tokens when a request names no max_tokens; the picker reads each
    answer's usage, and after a window of them charges the next such request their high quantile
    (within 10 %) instead of the configured default of 1,024."""
    with ExitStack() as stack:
        long_node = fast_sim(stack, tmp_path, "long", sp_model_path)
        chat_node = fast_sim(stack, tmp_path, "interactive", sp_model_path)
        model = f"tokenizer: {sp_model_path}, interactive_max_tokens: 4096, default_output_tokens: 1024"
        listener, _, _ = picker_stack(stack, tmp_path, (long_node, chat_node), model, {})

        def unbounded(i: int) -> Reply:
            body = json.dumps(
                {"model": "test-model", "messages": [{"role": "user", "content": f"question {i}"}]}
            )
            return post(listener, CHAT, body.encode())

        first = unbounded(0)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(unbounded, range(1, 121)))
        last = unbounded(121)

    assert first.status == 200 and all(a.status == 200 for a in answers)
    produced = sorted(a.json()["usage"]["completion_tokens"] for a in answers)
    q99 = produced[math.ceil(0.99 * len(produced)) - 1]
    charged_first = int(first.headers["x-kvgate-tokens"]) - int(first.headers["x-kvgate-prompt-tokens"])
    charged = int(last.headers["x-kvgate-tokens"]) - int(last.headers["x-kvgate-prompt-tokens"])
    assert charged_first == 1024, "before any answer: the configured default"
    assert abs(charged - q99) <= 0.1 * q99, (charged, q99, produced[-5:])


def counted(text: str, name: str, **labels: str) -> float:
    """A counter's samples with these labels, summed."""
    return sum(
        s.value
        for s in promtext.samples(text, name)
        if all(promtext.label(s, key) == value for key, value in labels.items())
    )


@pytest.mark.slow
def test_past_a_named_engine_that_is_down_envoy_goes_on_and_the_reservation_moves_to_the_engine_that_served(
    tmp_path: Path, sp_model_path: Path
) -> None:
    """One engine of each role is named by an agent whose engine is not listening (its figures read
    from a live one): a chat is named both interactive engines, the dead one first, and Envoy's
    override_host balancer follows the list; a long request is named the dead long engine, where its
    reservation is, and Envoy's retry lands on the live one (the named host used up, its fallback round
    robin over the long cluster), where the reservation moves."""
    with ExitStack() as stack:
        long_node = sim_node(stack, tmp_path, "long", sp_model_path)
        chat_node = sim_node(stack, tmp_path, "interactive", sp_model_path)
        dead_long, dead_chat = free_port(), free_port()

        def agent(name: str, endpoint_port: int, engine: Service, *flags: str) -> Service:
            metrics = ("--engine-metrics", f"http://127.0.0.1:{engine.port}/metrics")
            service = agent_process(
                tmp_path, name, free_port(), f"127.0.0.1:{endpoint_port}", [*metrics, *flags]
            )
            stack.callback(service.stop)
            return service

        # The dead long engine's agent has more room than the live one's, so it is placed first.
        down = agent("agent-long-down", dead_long, long_node)
        up = agent("agent-long-up", long_node.port, long_node, "--safety-ratio", "0.5")
        chat_down = agent("agent-chat-down", dead_chat, chat_node, "--role", "interactive")
        chat_up = agent("agent-chat-up", chat_node.port, chat_node, "--role", "interactive")
        ports: dict[str, Any] = {
            "interactive": [dead_chat, chat_node.port],
            "long": [dead_long, long_node.port],
        }
        ports |= {"listener": free_port(), "gate": free_port(), "admin": free_port()}
        envoy_config = picker_envoy(tmp_path, ports, {})
        _route_long_to_its_own_cluster(envoy_config, [dead_long, long_node.port])
        envoy = envoy_process(envoy_config, tmp_path, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        config = (
            "server: {protocol: endpoint-picker}\n"
            "default_model: {max_total_tokens: 16384, interactive_max_tokens: 1024, "
            f"tokenizer: {sp_model_path}}}\n"
            f"headroom: {{agents: ['127.0.0.1:{down.port}', '127.0.0.1:{up.port}']}}\n"
            f"interactive_headroom: {{agents: ['127.0.0.1:{chat_down.port}', '127.0.0.1:{chat_up.port}']}}\n"
            "soft_pools: {borrow: false}\n"
        )
        gate = stack.enter_context(gate_process(config, tmp_path, ports["gate"]))
        listener = ports["listener"]
        until(lambda: counted(page(gate.metrics_port), "kvgate_node_fresh") == 4, "the gate follows all four")

        short = post(listener, CHAT, chat("what is the capital of France?", max_tokens=4))
        long = post(
            listener,
            CHAT,
            chat(text_with_tokens(sp_model_path, 6_000), max_tokens=20),
            headers={"x-test-cluster": "long"},
            timeout=60,
        )
        gate_metrics = page(gate.metrics_port)
        granted_up = counted(page(up.metrics_port), "kvgate_agent_reservations_total", event="granted")
        granted_down = counted(page(down.metrics_port), "kvgate_agent_reservations_total", event="granted")
        for agent_of in (down, up):
            until(
                lambda port=agent_of.metrics_port: counted(page(port), "kvgate_agent_reservations_live") == 0,
                f"{agent_of.name}'s reservation released",
            )

    assert (short.status, short.headers.get("x-kvgate-sim-node")) == (200, "interactive")
    assert (long.status, long.headers.get("x-kvgate-sim-node")) == (200, "long"), long.body[:300]
    assert long.headers.get("x-kvgate-reason") == "long"
    assert (granted_down, granted_up) == (1, 1), (
        "reserved on the named engine's agent, then on the serving one's"
    )
    moved = "kvgate_gate_picker_served_elsewhere_total"
    assert (
        counted(gate_metrics, moved, reservation="moved"),
        counted(gate_metrics, moved, reservation="released"),
    ) == (
        1,
        0,
    )


def _route_long_to_its_own_cluster(envoy_config: Path, ports: list[int]) -> None:
    """A route for requests marked `x-test-cluster: long` to a copy of the pool's cluster holding only
    the long engines, as a gateway routes to the pool an HTTPRoute names: Envoy's fallback, once the
    named engine is used up, stays within it."""
    shown = yaml.safe_load(envoy_config.read_text())
    resources = shown["static_resources"]
    pool = next(c for c in resources["clusters"] if c["name"] == "inference_pool")
    long_only = copy.deepcopy(pool)
    long_only["name"] = long_only["load_assignment"]["cluster_name"] = "long_only"
    endpoint = long_only["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    long_only["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
        for port in ports
    ]
    assert endpoint["endpoint"]["address"]["socket_address"]["address"] == "127.0.0.1"
    resources["clusters"].append(long_only)
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    route = copy.deepcopy(routes[-1])
    route["match"] = {
        "prefix": "/",
        "headers": [{"name": "x-test-cluster", "string_match": {"exact": "long"}}],
    }
    route["route"]["cluster"] = "long_only"
    routes.insert(0, route)
    envoy_config.write_text(yaml.safe_dump(shown, sort_keys=False))


@pytest.mark.slow
def test_a_reserved_request_s_first_token_and_release_tell_its_agent_when_it_started_and_what_it_generated(
    tmp_path: Path, sp_model_path: Path
) -> None:
    """The picker reads every answer to a reserved request, JSON or streamed: its first bytes tell the
    agent the request started decoding (FirstToken), which the agent projects its end from, and its
    Release carries the generated tokens, which the agent learns its node's output lengths from
    (kvgate.agent.ledger); a stream without usage is released saying nothing."""
    with ExitStack() as stack:
        long_node = fast_sim(stack, tmp_path, "long", sp_model_path)
        chat_node = fast_sim(stack, tmp_path, "interactive", sp_model_path)
        model = f"tokenizer: {sp_model_path}, interactive_max_tokens: 1024"
        listener, gate, long_agent = picker_stack(stack, tmp_path, (long_node, chat_node), model, {})
        prompt = text_with_tokens(sp_model_path, 3_000)
        whole = post(listener, CHAT, chat(prompt, max_tokens=40), timeout=60)
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        streamed = post(listener, CHAT, chat(prompt + " again", max_tokens=40, **usage), timeout=60)
        bare = post(listener, CHAT, chat(prompt + " once more", max_tokens=40, stream=True), timeout=60)
        metrics = long_agent.metrics_port
        until(
            lambda: counted(page(metrics), "kvgate_agent_reservations_total", event="released") == 3,
            "the three reservations released",
        )
        told = counted(page(metrics), "kvgate_agent_reservations_total", event="released", reason="answer")
        started = counted(page(metrics), "kvgate_agent_reservations_total", event="first_token", reason="")
        assert gate.metrics_port is not None
        timed = counted(page(gate.metrics_port), "kvgate_gate_picker_first_token_seconds_count", pool="long")

    assert whole.status == streamed.status == bare.status == 200
    assert started == 3, "each reserved answer's first bytes told its agent"
    assert timed == 3, "and timed by the gate, in the long pool's series"
    assert whole.headers.get("x-kvgate-reason") == "long"
    assert whole.json()["usage"]["completion_tokens"] == 40
    assert told == 2, "the JSON answer and the stream with usage were told; the bare stream was not"
