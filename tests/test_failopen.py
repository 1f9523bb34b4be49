"""Failing open by size (issue 31): a request the gate did not answer (down, or late past Envoy's
message_timeout) goes to the interactive pool only when its body certainly fits there; a bigger one,
one of unknown size (chunked) or a compressed one gets 503 gate_unavailable with Retry-After, or the
long pool unreserved with `--fail-open-long long-pool`. Rendered and shipped configs agree, and the real
Envoy does it with both shipped configs."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import yaml
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.config.route.v3 import route_components_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
)
from google.protobuf import json_format
from test_chart import CHART, Helm, by_kind, one, real_helm, standalone
from test_chart_envoy import chart_bootstrap
from test_envoy_trust import rendered
from test_envoyconfig_routes import run_cli
from test_gate_holds import with_message_timeout

from kvgate.config import parse_config
from kvgate.envoyconfig.routepolicy import RoutePolicy
from kvgate.envoyconfig.settings import HostPort, envoy_settings
from kvgate.envoyconfig.unanswered import interactive_limit, unsafe_bytes
from kvgate.estimate.calibration import most_tokens_per_byte
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.stack import envoy_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
POOLS = ("interactive", "long", "async")
# The default interactive_max_tokens at the shipped calibrations' one token per byte.
UNSAFE_BYTES = 4096
EG_VALUES = CHART / "ci" / "envoy-gateway-values.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"


def routes_of(bootstrap: dict[str, Any], host: int = 0) -> list[dict[str, Any]]:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes: list[dict[str, Any]] = manager["route_config"]["virtual_hosts"][host]["routes"]
    return routes


def unanswered_routes(routes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The routes that apply only where the gate did not answer: no pool header, or no pool metadata."""
    found = []
    for route in routes:
        match = route["match"]
        no_header = {"name": "x-kvgate-pool", "present_match": False} in match.get("headers", [])
        no_metadata = any(m.get("invert") for m in match.get("dynamic_metadata", []))
        if no_header or no_metadata:
            found.append(route)
    return found


def canonical(route: dict[str, Any]) -> dict[str, Any]:
    """Through Envoy's own protobuf, so `4096` and `'4096'` or key order cannot differ."""
    message = json_format.ParseDict(route, route_components_pb2.Route())
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


# --- the threshold ----------------------------------------------------------------------------------------


def test_a_body_under_the_threshold_certainly_fits_the_interactive_pool() -> None:
    # Every shipped calibration's certainty rule: at most one token per byte (+ 1).
    assert most_tokens_per_byte() == 1.0
    assert unsafe_bytes(4096, 1.0) == UNSAFE_BYTES
    # At half a token per byte, 8,190 bytes take at most 4,096 tokens; 8,191 may take more.
    assert unsafe_bytes(4096, 0.5) == 8191
    config = parse_config(
        "default_model: {interactive_max_tokens: 8192, max_total_tokens: 32768}\n"
        "models:\n"
        "  - {match: small-*, interactive_max_tokens: 2048}\n"
        "  - {match: other-*, interactive_max_tokens: 1024, pools: {interactive: other}}\n"
    )
    # The smallest limit among the models whose short requests go to that pool.
    assert interactive_limit(config, "interactive") == 2048
    assert interactive_limit(config, "other") == 1024
    assert interactive_limit(config, "long") is None


def test_no_model_sends_short_requests_to_the_default_pool_so_nothing_is_split() -> None:
    pools = {"interactive": HostPort("a", 1), "long": HostPort("b", 2)}
    settings = envoy_settings(parse_config(""), pools, listen=HostPort("0.0.0.0", 1), default_pool="long")
    assert settings.unanswered is None


# --- rendered and shipped -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("shipped", "trips"), [("envoy.yaml", "2"), ("envoy-one-trip.yaml", "1")])
def test_shipped_and_rendered_fail_open_routes_agree(tmp_path: Path, shipped: str, trips: str) -> None:
    ours = routes_of(yaml.safe_load((ROOT / "envoy" / shipped).read_text()))
    theirs = routes_of(rendered(tmp_path, "--round-trips", trips))
    for routes in (ours, theirs):
        found = unanswered_routes(routes)
        assert len(found) == 3
        # Right before the catch-all, after every pool route.
        assert routes[-4:-1] == found
        assert [r["match"]["headers"][-1]["name"] for r in found] == [
            "content-length",
            "content-length",
            "content-encoding",
        ]
    assert [canonical(r) for r in unanswered_routes(ours)] == [
        canonical(r) for r in unanswered_routes(theirs)
    ]
    (sized, *_) = unanswered_routes(ours)
    assert sized["match"]["headers"][-1]["range_match"] == {"start": UNSAFE_BYTES, "end": 2**63 - 1}


def test_the_long_pool_switch_sends_them_there_unreserved(tmp_path: Path) -> None:
    for trips in ("1", "2"):
        routes = unanswered_routes(
            routes_of(rendered(tmp_path, "--round-trips", trips, "--fail-open-long", "long-pool"))
        )
        assert [r["route"]["cluster"] for r in routes] == ["pool_long"] * 3
        assert not [r for r in routes if "direct_response" in r or "response_headers_to_add" in r]


def test_failing_closed_renders_no_fail_open_routes(tmp_path: Path) -> None:
    assert unanswered_routes(routes_of(rendered(tmp_path, "--fail-closed"))) == []


def test_route_policy_paths_carry_their_policy_on_their_fail_open_routes() -> None:
    """Before the gate answers, a big request's route is a fail-open route: the gate reads its policy
    from there (ExtProcPerRoute gRPC metadata)."""
    from kvgate.envoyconfig.bootstrap import render_bootstrap

    pools = {"interactive": HostPort("a", 1), "long": HostPort("b", 2)}
    policies = [
        RoutePolicy(name="chat", path_prefix="/v1/chat", max_total_tokens=4096),
        RoutePolicy(name="strict", hosts=("strict.local",), max_total_tokens=2000),
    ]
    settings = envoy_settings(parse_config(""), pools, listen=HostPort("0.0.0.0", 1), route_policies=policies)
    bootstrap = render_bootstrap(settings)
    chat_routes = [r for r in routes_of(bootstrap) if r["match"].get("path_separated_prefix") == "/v1/chat"]
    found = unanswered_routes(chat_routes)
    assert len(found) == 3
    for route in found:
        overrides = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
        assert overrides["grpc_initial_metadata"] == [{"key": "x-kvgate-max-total-tokens", "value": "4096"}]
    # The host's policy is its virtual host's, over all of its routes.
    assert len(unanswered_routes(routes_of(bootstrap, host=1))) == 6


# --- through the real Envoy ---------------------------------------------------------------------------------

# Envoy's per-message deadline in the late-gate runs, shorter than the shipped 5 s to keep them short.
MESSAGE_TIMEOUT_S = 0.5


class LateGate(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """An ext_proc server that answers every message past Envoy's deadline, sending the request to the
    long pool: Envoy must have failed open by then and ignore the answer."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.messages = 0
        self._lock = threading.Lock()

    def Process(self, requests: Iterator[ProcessingRequest], context: Any) -> Iterator[ProcessingResponse]:
        for request in requests:
            with self._lock:
                self.messages += 1
            time.sleep(self.delay_s)
            pool = HeaderMutation(
                set_headers=[HeaderValueOption(header=HeaderValue(key="x-kvgate-pool", raw_value=b"long"))]
            )
            common = CommonResponse(header_mutation=pool, clear_route_cache=True)
            if request.HasField("request_headers"):
                yield ProcessingResponse(request_headers=HeadersResponse(response=common))
            else:
                response = ProcessingResponse(request_body=BodyResponse(response=common))
                response.dynamic_metadata.fields["kvgate"].struct_value.fields["pool"].string_value = "long"
                yield response


Servicer = TypeVar("Servicer", bound=external_processor_pb2_grpc.ExternalProcessorServicer)


@contextlib.contextmanager
def serving(servicer: Servicer, port: int) -> Iterator[Servicer]:
    """`servicer` as the ext_proc server on 127.0.0.1:port, in place of the gate."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield servicer
    finally:
        server.stop(grace=None)


def late_gate(port: int) -> contextlib.AbstractContextManager[LateGate]:
    return serving(LateGate(delay_s=3 * MESSAGE_TIMEOUT_S), port)


@contextlib.contextmanager
def envoy_without_gate(config: Path, tmp: Path, ports: dict[str, int]) -> Iterator[Upstreams]:
    """Envoy with `config` and a recording upstream per pool; whatever serves ports['gate'] is the
    caller's (nothing: the gate is down)."""
    upstreams = Upstreams({pool: ports[pool] for pool in POOLS})
    upstreams.start()
    envoy = envoy_process(config, tmp, ports["admin"], ports["listener"])
    try:
        yield upstreams
    finally:
        envoy.stop()
        upstreams.stop()


def stack_ports() -> dict[str, int]:
    return {name: free_port() for name in (*POOLS, "listener", "gate", "admin")}


def post_chunked(port: int, body: bytes) -> Reply:
    """POST `body` with Transfer-Encoding: chunked, so with no Content-Length."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST", CHAT, body=iter([body]), headers={"content-type": "application/json"}, encode_chunked=True
        )
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


# About 1,000 tokens of English in about 5 KiB: a request the interactive pool would take, but whose
# body alone cannot prove it fits.
LONG_TEXT = "The scheduler admits a request only when the node can hold its whole context. " * 64
SMALL = chat("Say hello.")


def assert_gate_unavailable(reply: Reply) -> None:
    assert reply.status == 503, reply.body
    assert reply.headers["retry-after"] == "1"
    assert reply.headers["retry-after-ms"] == "1000"
    assert reply.headers["x-kvgate-reason"] == "gate_unavailable"
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["code"] == "gate_unavailable" and error["type"] == "server_error"
    assert "did not answer" in error["message"]


def check_fails_open_by_size(listener: int, upstreams: Upstreams) -> None:
    long_body = chat(LONG_TEXT)
    assert len(long_body) > UNSAFE_BYTES
    small = post(listener, CHAT, SMALL)
    assert small.status == 200 and small.json()["pool"] == "interactive", small.body
    assert "x-kvgate-pool" not in small.headers, "the gate did not decide"
    models = post(listener, "/v1/models", None)
    assert models.status == 200 and models.json()["pool"] == "interactive"
    assert_gate_unavailable(post(listener, CHAT, long_body))
    # Content-Length one byte under, and at, the threshold.
    under = post(listener, CHAT, SMALL[:-1] + b" " * (UNSAFE_BYTES - len(SMALL) - 1) + b"}")
    assert under.status == 200 and under.json() == {"pool": "interactive", "body_bytes": UNSAFE_BYTES - 1}
    assert_gate_unavailable(post(listener, CHAT, SMALL[:-1] + b" " * (UNSAFE_BYTES - len(SMALL)) + b"}"))
    # Unknown size, and a size that is not the prompt's.
    assert_gate_unavailable(post_chunked(listener, SMALL))
    assert_gate_unavailable(post(listener, CHAT, gzip.compress(SMALL), {"content-encoding": "gzip"}))
    assert [(r.pool, r.path) for r in upstreams.received] == [
        ("interactive", CHAT),
        ("interactive", "/v1/models"),
        ("interactive", CHAT),
    ]


ENVOY_FILES = pytest.mark.parametrize("envoy_file", ["envoy.yaml", "envoy-one-trip.yaml"])


@pytest.mark.slow
@ENVOY_FILES
def test_with_the_gate_down_only_small_bodies_fail_open(tmp_path: Path, envoy_file: str) -> None:
    ports = stack_ports()
    config = render_envoy(ROOT / "envoy" / envoy_file, tmp_path / "envoy.yaml", ports)
    with envoy_without_gate(config, tmp_path, ports) as upstreams:
        check_fails_open_by_size(ports["listener"], upstreams)


@pytest.mark.slow
@ENVOY_FILES
def test_with_the_gate_late_only_small_bodies_fail_open(tmp_path: Path, envoy_file: str) -> None:
    ports = stack_ports()
    config = render_envoy(ROOT / "envoy" / envoy_file, tmp_path / "envoy.yaml", ports)
    with_message_timeout(config, MESSAGE_TIMEOUT_S)
    with late_gate(ports["gate"]) as gate, envoy_without_gate(config, tmp_path, ports) as upstreams:
        check_fails_open_by_size(ports["listener"], upstreams)
        assert gate.messages >= 5, "Envoy asked the gate, then stopped waiting"


@pytest.mark.slow
@pytest.mark.parametrize("trips", ["2", "1"])
def test_the_long_pool_switch_sends_long_bodies_to_the_long_pool(tmp_path: Path, trips: str) -> None:
    ports = stack_ports()
    output = tmp_path / "envoy.yaml"
    argv = [
        *(f"--pool={pool}=127.0.0.1:{ports[pool]}" for pool in POOLS),
        *("--gate", f"127.0.0.1:{ports['gate']}", "--listen", f"127.0.0.1:{ports['listener']}"),
        *("--ready-port", str(free_port()), "--admin-port", str(ports["admin"])),
        *("--round-trips", trips, "--fail-open-long", "long-pool", "--output", str(output)),
    ]
    assert run_cli(argv) == 0
    with envoy_without_gate(output, tmp_path, ports) as upstreams:
        listener = ports["listener"]
        assert post(listener, CHAT, SMALL).json()["pool"] == "interactive"
        long = post(listener, CHAT, chat(LONG_TEXT))
        assert long.status == 200 and long.json()["pool"] == "long", long.body
        assert post_chunked(listener, SMALL).json()["pool"] == "long"
        # Unreserved: nothing pins it to a node.
        assert "x-kvgate-endpoint" not in upstreams.received[-1].headers


# --- the chart's three Envoy modes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm() -> Helm:
    return real_helm()


def test_the_standalone_chart_renders_the_routes(helm: Helm) -> None:
    routes = routes_of(chart_bootstrap(helm, standalone()))
    found = unanswered_routes(routes)
    assert routes[-4:-1] == found and len(found) == 3
    assert found[0]["match"]["headers"][-1]["range_match"] == {"start": UNSAFE_BYTES, "end": 2**63 - 1}
    assert all(r["direct_response"]["status"] == 503 for r in found)
    assert unanswered_routes(routes_of(chart_bootstrap(helm, standalone(envoy={"failOpen": False})))) == []


def istio_inserted(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        p
        for p in one(docs, "EnvoyFilter")["spec"]["configPatches"]
        if p["applyTo"] == "HTTP_ROUTE" and p["patch"]["operation"] == "INSERT_BEFORE"
    ]


def test_istio_inserts_the_routes_before_each_catch_all(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "istio-values.yaml")
    services = by_kind(docs, "VirtualService")
    catch_alls = {
        r["name"]: r
        for spec in services
        for r in spec["spec"]["http"]
        if r["name"].endswith("pool-interactive")
    }
    merged = {
        p["match"]["routeConfiguration"]["vhost"]["route"]["name"]: p["patch"]["value"][
            "typed_per_filter_config"
        ]
        for p in one(docs, "EnvoyFilter")["spec"]["configPatches"]
        if p["patch"]["operation"] == "MERGE"
        and "typed_per_filter_config" in p["patch"].get("value", {})
        and "overrides" in p["patch"]["value"]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]
    }
    inserted = istio_inserted(docs)
    by_catch_all: dict[str, list[dict[str, Any]]] = {}
    for patch in inserted:
        name = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
        by_catch_all.setdefault(name, []).append(patch["patch"]["value"])
    assert set(by_catch_all) == set(catch_alls), "three routes before every catch-all"
    for name, values in by_catch_all.items():
        assert [v["match"]["headers"][-1]["name"] for v in values] == [
            "content-length",
            "content-length",
            "content-encoding",
        ]
        for value in values:
            assert value["match"]["headers"][0] == {"name": "x-kvgate-pool", "present_match": False}
            assert value["direct_response"]["status"] == 503
            # The policy the gate reads before it answers: the catch-all's.
            assert value.get("typed_per_filter_config") == merged.get(name), name
        assert values[0]["match"]["headers"][1]["range_match"]["start"] == UNSAFE_BYTES
        path = catch_alls[name].get("match", [{}])[0].get("uri")
        assert ("path_separated_prefix" in values[0]["match"]) == (path is not None)
    long_pool = helm.render({"envoy": {"failOpenLong": "long-pool"}}, CHART / "ci" / "istio-values.yaml")
    clusters = {p["patch"]["value"]["route"]["cluster"] for p in istio_inserted(long_pool)}
    assert clusters == {"outbound|8000||vllm-long.models.svc.cluster.local"}
    closed = helm.render({"envoy": {"failOpen": False}}, CHART / "ci" / "istio-values.yaml")
    assert istio_inserted(closed) == []


def eg_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = one(docs, "HTTPRoute", "-pools")["spec"]["rules"]
    return rules


def header_names(rule: dict[str, Any]) -> list[list[str]]:
    """Per match of an HTTPRoute rule, the headers it matches on."""
    return [[h["name"] for h in match.get("headers", [])] for match in rule.get("matches", [{}])]


def test_envoy_gateway_adds_a_fail_open_rule_the_gates_answers_outrank(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "envoy-gateway-values.yaml")
    rules = eg_rules(docs)
    fail_open = [r for r in rules if header_names(r) == [["content-length"], ["content-encoding"]]]
    assert len(fail_open) == 2, "one per route set"
    for rule in fail_open:
        index = rules.index(rule)
        assert header_names(rules[index + 1]) == [[]], "the catch-all right after"
        # One header match each, where every rule for the gate's answer has two (Envoy Gateway orders
        # rules of a path by their number of header matches).
        answered = rules[index - 3 : index]
        assert [r["matches"][0]["headers"][0]["value"] for r in answered] == ["async", "long", "interactive"]
        assert all(header_names(r) == [["x-kvgate-pool", "x-kvgate-reason"]] for r in answered)
        extension, headers = rule["filters"]
        assert extension["extensionRef"]["name"] == "rel-kvgate-gate-unavailable"
        assert {h["name"]: h["value"] for h in headers["responseHeaderModifier"]["set"]} == {
            "x-kvgate-reason": "gate_unavailable",
            "retry-after": "1",
            "x-kvgate-retry-after-ms": "1000",
            "retry-after-ms": "1000",
        }
    answer = one(docs, "HTTPRouteFilter")["spec"]["directResponse"]
    assert answer["statusCode"] == 503 and answer["contentType"] == "application/json"
    assert json.loads(answer["body"]["inline"])["error"]["code"] == "gate_unavailable"
    switched = [
        r
        for r in eg_rules(helm.render({"envoy": {"failOpenLong": "long-pool"}}, EG_VALUES))
        if ["content-length"] in header_names(r)
    ]
    assert [r["backendRefs"][0]["name"] for r in switched] == ["vllm-long", "vllm-long"]
    closed = helm.render({"envoy": {"failOpen": False}}, EG_VALUES)
    assert not by_kind(closed, "HTTPRouteFilter")
    assert not [r for r in eg_rules(closed) if ["content-length"] in header_names(r)]


@pytest.mark.parametrize("tokens", [4096, 1000, 999, 8192, 131072])
def test_envoy_gateways_content_length_regex_matches_exactly_the_unsafe_sizes(
    helm: Helm, tokens: int
) -> None:
    values = {"gate": {"config": {"default_model": {"interactive_max_tokens": tokens}}}}
    if tokens > 16384:
        values["gate"]["config"]["default_model"]["max_total_tokens"] = tokens
    rule = next(r for r in eg_rules(helm.render(values, EG_VALUES)) if "filters" in r)
    pattern = rule["matches"][0]["headers"][0]["value"]
    threshold = unsafe_bytes(tokens, most_tokens_per_byte())
    for size in [*range(threshold - 1200, threshold + 1200), 0, 9, 10**12]:
        if size >= 0:
            assert bool(re.fullmatch(pattern, str(size))) == (size >= threshold), (pattern, size)
