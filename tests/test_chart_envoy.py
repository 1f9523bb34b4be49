"""The chart's standalone Envoy bootstrap: valid for the real Envoy, equal to `kvgate envoy-config`'s,
and working end to end with the gate and fake pools on 127.0.0.1."""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sentencepiece
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.extensions.compression.gzip.decompressor.v3 import gzip_pb2  # noqa: F401  (Any types in the bootstrap)
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2  # noqa: F401  (Any types in the bootstrap)
from envoy.extensions.filters.http.decompressor.v3 import decompressor_pb2  # noqa: F401
from envoy.extensions.filters.http.ext_authz.v3 import ext_authz_pb2  # noqa: F401
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401  (Any types in the bootstrap)
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.filters.http.health_check.v3 import health_check_pb2  # noqa: F401
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (  # noqa: F401
    header_mutation_pb2 as early_header_mutation_pb2,
)
from envoy.extensions.resource_monitors.downstream_connections.v3 import downstream_connections_pb2  # noqa: F401
from envoy.extensions.resource_monitors.fixed_heap.v3 import fixed_heap_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format
from test_chart import (
    STRIPPED_HEADERS,
    Helm,
    HelmFailed,
    check_request_decompressor,
    check_response_headers,
    one,
    real_helm,
    standalone,
)

from kvgate.config import parse_config
from kvgate.envoyconfig.cli import register
from kvgate.envoyconfig.limits import Limits
from kvgate.envoyconfig.routepolicy import RoutePolicy
from kvgate.envoyconfig.settings import HostPort, envoy_settings
from kvgate.errors import ConfigError
from kvgate.gate.processor import request_attributes
from kvgate.harness.client import chat, post
from kvgate.harness.stack import envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

ENVOY = Path(sys.executable).parent / "envoy"
VALIDATE_TIMEOUT_S = 60


@pytest.fixture(scope="session")
def helm() -> Helm:
    return real_helm()


def chart_bootstrap(helm: Helm, values: dict[str, Any]) -> dict[str, Any]:
    config_map = one(helm.render(values), "ConfigMap", "-envoy")
    bootstrap: dict[str, Any] = yaml.safe_load(config_map["data"]["envoy.yaml"])
    return bootstrap


def envoy_validate(bootstrap: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    result = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=VALIDATE_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def canonical(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """Both renderings through Envoy's own protobuf, so `2s` and `2.000s` or key order cannot differ."""
    message = json_format.ParseDict(bootstrap, bootstrap_pb2.Bootstrap())
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


# Every shape of entry: a host's policy, a path on that host, paths for every host (one shared with the
# host: the host's values win key by key), a second host set, a wildcard host.
ROUTE_POLICIES: list[dict[str, Any]] = [
    {"name": "strict", "hosts": ["strict.example.com", "strict.local"], "maxTotalTokens": 2000},
    {
        "name": "strict-chat",
        "hosts": ["strict.local", "strict.example.com"],
        "pathPrefix": "/v1/chat",
        "async": "never",
    },
    {"name": "chat", "pathPrefix": "/v1/chat", "interactiveMaxTokens": 4096, "maxTotalTokens": 4096},
    {
        "name": "batch",
        "pathPrefix": "/v1/batch/chat/completions",
        "modelPolicy": "batch",
        "defaultOutputTokens": 0,
    },
    {
        "name": "tenants",
        "hosts": ["*.tenants.example.com"],
        "pathPrefix": "/v1/completions",
        "async": "allow",
    },
]
TENANT_CLASS_POLICIES = [
    {"name": "partners", "hosts": ["partners.example.com"], "tenantClass": "partners"},
    {
        "name": "partners-trial",
        "hosts": ["partners.example.com"],
        "pathPrefix": "/trial",
        "tenantClass": "trial",
    },
    {
        "name": "partners-strict",
        "hosts": ["partners.example.com"],
        "pathPrefix": "/v1/chat",
        "maxTotalTokens": 8000,
    },
    {"name": "trial", "pathPrefix": "/trial", "tenantClass": "trial"},
]
CAMEL_TO_SNAKE = {
    "pathPrefix": "path_prefix",
    "interactiveMaxTokens": "interactive_max_tokens",
    "maxTotalTokens": "max_total_tokens",
    "defaultOutputTokens": "default_output_tokens",
    "modelPolicy": "model_policy",
    "async": "async_",
    "tenantClass": "tenant_class",
}


def route_policy(entry: dict[str, Any]) -> RoutePolicy:
    """A chart envoy.routePolicies entry as `kvgate envoy-config` takes it."""
    fields = {CAMEL_TO_SNAKE.get(key, key): value for key, value in entry.items()}
    return RoutePolicy(**fields | {"hosts": tuple(entry.get("hosts", ()))})


BOOTSTRAP_CASES: dict[str, dict[str, Any]] = {
    "defaults": standalone(),
    "three-pools": standalone(
        envoy={
            "pools": {"async": {"address": "batch.models.svc.cluster.local", "port": 8080}},
            "messageTimeoutMs": 1500,
            "failOpen": False,
            "routeTimeoutSeconds": 900,
        }
    ),
    "custom-pool-names": standalone(
        gate={
            "config": {
                "request": {"max_body_bytes": 8 * 1024 * 1024},
                "models": [{"match": "big-*", "pools": {"long": "long-big"}}],
            }
        },
        envoy={"pools": {"long-big": {"address": "vllm-big.models.svc.cluster.local", "port": 8000}}},
    ),
    "one-trip": standalone(
        gate={"config": {"admission": {"priority_header": "X-Team-Priority"}}},
        envoy={
            "pools": {"async": {"address": "batch.models.svc.cluster.local", "port": 8080}},
            "standalone": {"roundTrips": 1},
        },
    ),
    # auth.method none, as `kvgate envoy-config` renders without --auth (test_chart_security covers auth).
    "queue": standalone(
        queue={"enabled": True, "unauthenticated": True, "port": 8080},
        gate={"config": {"queue": {"max_hold_s": 120.5}}},
    ),
    "queue-one-trip": standalone(
        queue={"enabled": True, "unauthenticated": True}, envoy={"standalone": {"roundTrips": 1}}
    ),
    "route-policies": standalone(
        gate={"config": {"policies": {"batch": {"async_mode": "prefer", "max_total_tokens": 32768}}}},
        queue={"enabled": True, "unauthenticated": True},
        envoy={"routePolicies": ROUTE_POLICIES},
    ),
    # Classed routes to the queue carry their class: a path's own, else its virtual host's.
    **{
        f"tenant-classes{suffix}": standalone(
            gate={"config": {"fairness": {"classes": {"partners": {"weight": 3}, "trial": {"weight": 0.5}}}}},
            queue={"enabled": True, "unauthenticated": True},
            envoy={"routePolicies": TENANT_CLASS_POLICIES, "standalone": {"roundTrips": trips}},
        )
        for suffix, trips in (("", 2), ("-one-trip", 1))
    },
    "route-policies-one-trip": standalone(
        gate={"config": {"policies": {"batch": {"async_mode": "prefer"}}}},
        envoy={"routePolicies": ROUTE_POLICIES, "standalone": {"roundTrips": 1}},
    ),
    # Failing open by size: the smallest interactive limit of the models sharing the default pool
    # (an entry inherits default_model's), and the long-pool switch.
    "fail-open-long-pool": standalone(
        gate={
            "config": {
                "default_model": {"interactive_max_tokens": 8192, "max_total_tokens": 32768},
                "models": [
                    {"match": "small-*", "interactive_max_tokens": 2048},
                    {"match": "other-*", "interactive_max_tokens": 1024, "pools": {"interactive": "other"}},
                ],
            }
        },
        envoy={
            "pools": {"other": {"address": "vllm-other.models.svc.cluster.local", "port": 8000}},
            "failOpenLong": "long-pool",
            "routePolicies": ROUTE_POLICIES[2:3],
        },
    ),
    "fail-open-long-pool-one-trip": standalone(
        envoy={"failOpenLong": "long-pool", "standalone": {"roundTrips": 1}},
    ),
}


@pytest.mark.parametrize("case", sorted(BOOTSTRAP_CASES))
def test_chart_bootstrap_passes_envoy_validate(helm: Helm, case: str, tmp_path: Path) -> None:
    envoy_validate(chart_bootstrap(helm, BOOTSTRAP_CASES[case]), tmp_path)


def python_bootstrap(values: dict[str, Any]) -> dict[str, Any]:
    """`kvgate envoy-config` for the settings a values dict gives the chart."""
    from kvgate.envoyconfig.bootstrap import render_bootstrap

    gate_values = values.get("gate", {})
    config = parse_config(yaml.safe_dump(gate_values.get("config", {})))
    envoy = values["envoy"]
    queue = values.get("queue", {})
    settings = envoy_settings(
        config,
        {name: HostPort(pool["address"], pool["port"]) for name, pool in envoy["pools"].items()},
        listen=HostPort("0.0.0.0", 10000),
        gate=HostPort("rel-kvgate-gate-headless.llm.svc.cluster.local", 9002),
        message_timeout_ms=envoy.get("messageTimeoutMs", 5000),
        max_message_timeout_ms=envoy.get("maxMessageTimeoutMs", 60_000),
        fail_open=envoy.get("failOpen", True),
        fail_open_long=envoy.get("failOpenLong", "refuse"),
        route_timeout_seconds=envoy.get("routeTimeoutSeconds", 0),
        round_trips=envoy.get("standalone", {}).get("roundTrips", 2),
        queue=(
            HostPort("rel-kvgate-queue.llm.svc.cluster.local", queue.get("port", 8003))
            if queue.get("enabled")
            else None
        ),
        route_policies=[route_policy(entry) for entry in envoy.get("routePolicies", [])],
        # The chart's defaults: its Envoy's heap budget is 80% of its 2 GiB memory limit.
        limits=Limits(max_heap_bytes=int(2 * 1024**3 * 0.8)),
    )
    return render_bootstrap(settings)


@pytest.mark.parametrize("case", sorted(BOOTSTRAP_CASES))
def test_chart_and_envoy_config_render_the_same_bootstrap(helm: Helm, case: str) -> None:
    values = BOOTSTRAP_CASES[case]
    assert canonical(chart_bootstrap(helm, values)) == canonical(python_bootstrap(values))


@pytest.mark.parametrize(
    ("admission", "envoy", "refused"),
    [
        ({}, {"messageTimeoutMs": 1500}, None),  # holds: asks for more time at 1 s, + 0.5 s
        ({}, {"messageTimeoutMs": 1499}, r"envoy\.messageTimeoutMs \(1499\) must be at least 1500 ms"),
        ({"max_wait_s": 2.2}, {"messageTimeoutMs": 1600}, None),  # 1.1 + 0.5 s, not 1,601 ms
        ({"max_wait_s": 0}, {"messageTimeoutMs": 550}, None),  # the ask comes at 50 ms at the soonest
        ({"max_wait_s": 0}, {"messageTimeoutMs": 549}, r"must be at least 550 ms"),
        ({"max_wait_s": 4, "max_hold_s": 0}, {"messageTimeoutMs": 4500}, None),  # no holding: the whole wait
        (
            {"max_wait_s": 4, "max_hold_s": 4},
            {"messageTimeoutMs": 4499},
            r"answers a long request within gate\.config\.admission\.max_wait_s \(4 s\)",
        ),
        ({"max_hold_s": 60}, {"maxMessageTimeoutMs": 65_000}, None),
        (
            {"max_hold_s": 60},
            {"maxMessageTimeoutMs": 64_999},
            r"envoy\.maxMessageTimeoutMs \(64999\) must be at least 65000 ms: the gate holds",
        ),
    ],
    ids=[
        "ask-fits",
        "ask-late",
        "ask-in-decimal",
        "soonest-ask-fits",
        "soonest-ask-late",
        "whole-wait-fits",
        "whole-wait-late",
        "hold-fits",
        "hold-past-max",
    ],
)
def test_chart_and_envoy_config_refuse_the_same_gate_timeouts(
    helm: Helm, admission: dict[str, Any], envoy: dict[str, Any], refused: str | None
) -> None:
    """Envoy fails a request open when the gate's answer comes after messageTimeoutMs, and ignores an
    ask to hold past maxMessageTimeoutMs: the chart and `kvgate envoy-config` refuse the same values."""
    values = standalone(gate={"config": {"admission": admission}}, envoy=envoy)
    if refused is None:
        assert canonical(chart_bootstrap(helm, values)) == canonical(python_bootstrap(values))
        return
    with pytest.raises(HelmFailed, match=refused):
        helm.render(values)
    with pytest.raises(ConfigError, match="must be at least"):
        python_bootstrap(values)


@pytest.mark.parametrize("case", ["three-pools", "one-trip", "queue-one-trip", "route-policies"])
def test_envoy_config_bootstrap_passes_envoy_validate(case: str, tmp_path: Path) -> None:
    envoy_validate(python_bootstrap(BOOTSTRAP_CASES[case]), tmp_path)


def test_bootstrap_routes_pins_and_strips(helm: Helm) -> None:
    bootstrap = chart_bootstrap(helm, BOOTSTRAP_CASES["three-pools"])
    ingress = bootstrap["static_resources"]["listeners"][0]
    manager = ingress["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes] == [
        "pool_async",
        "kvgate_pinned",
        "pool_long",
        "pool_interactive",
    ]
    assert "headers" not in routes[-1]["match"], "the catch-all must come last"
    assert routes[1]["match"]["headers"][1] == {"name": "x-kvgate-endpoint", "present_match": True}
    mutations = manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert [m["remove"] for m in mutations] == STRIPPED_HEADERS
    assert [f["name"] for f in manager["http_filters"]] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.decompressor",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    check_request_decompressor(manager["http_filters"][1])
    check_response_headers(manager["route_config"]["response_headers_to_add"])
    ext_proc = http_filter(manager, "envoy.filters.http.ext_proc")
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ingress["per_connection_buffer_limit_bytes"] == 32 * 1024 * 1024 + 1024 * 1024
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    gate_address = clusters["kvgate_gate"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert (
        gate_address["address"]["socket_address"]["address"]
        == "rel-kvgate-gate-headless.llm.svc.cluster.local"
    )
    assert clusters["kvgate_pinned"]["original_dst_lb_config"]["http_header_name"] == "x-kvgate-endpoint"


def ingress_manager(bootstrap: dict[str, Any]) -> dict[str, Any]:
    ingress = bootstrap["static_resources"]["listeners"][0]
    manager: dict[str, Any] = ingress["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


def http_filter(manager: dict[str, Any], name: str) -> dict[str, Any]:
    """The typed_config of the HTTP filter `name`."""
    (config,) = [f["typed_config"] for f in manager["http_filters"] if f["name"] == name]
    return config  # type: ignore[no-any-return]


def test_one_trip_bootstrap_sends_the_body_alone_and_routes_on_metadata(helm: Helm) -> None:
    manager = ingress_manager(chart_bootstrap(helm, BOOTSTRAP_CASES["one-trip"]))
    assert [f["name"] for f in manager["http_filters"]] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.decompressor",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.buffer",
        "envoy.filters.http.router",
    ]
    check_response_headers(manager["route_config"]["response_headers_to_add"])
    ext_proc = http_filter(manager, "envoy.filters.http.ext_proc")
    assert ext_proc["processing_mode"]["request_header_mode"] == "SKIP"
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["request_attributes"] == list(request_attributes("X-Team-Priority"))
    assert "request.headers['x-team-priority']" in ext_proc["request_attributes"]
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["kvgate"]
    buffer = http_filter(manager, "envoy.filters.http.buffer")
    assert buffer["max_request_bytes"] == 32 * 1024 * 1024 + 1024 * 1024
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    pinned = routes[1]["match"]
    assert routes[1]["route"]["cluster"] == "kvgate_pinned"
    assert "headers" not in pinned
    assert pinned["dynamic_metadata"] == [
        {"filter": "kvgate", "path": [{"key": "pool"}], "value": {"string_match": {"exact": "long"}}},
        {"filter": "kvgate", "path": [{"key": "endpoint"}], "value": {"present_match": True}},
    ]
    added = {
        h["header"]["key"]: (h["header"]["value"], h["append_action"])
        for h in manager["route_config"]["request_headers_to_add"]
    }
    assert added == {
        "x-kvgate-pool": ("%DYNAMIC_METADATA(kvgate:pool)%", "OVERWRITE_IF_EXISTS_OR_ADD"),
        "x-kvgate-endpoint": ("%DYNAMIC_METADATA(kvgate:endpoint)%", "OVERWRITE_IF_EXISTS_OR_ADD"),
        "x-kvgate-tokens": ("%DYNAMIC_METADATA(kvgate:tokens)%", "OVERWRITE_IF_EXISTS_OR_ADD"),
        "x-kvgate-reason": ("%DYNAMIC_METADATA(kvgate:reason)%", "OVERWRITE_IF_EXISTS_OR_ADD"),
        # The gate's reservation id replaces a client's own (the engine's KV events name the reservation).
        "x-session-id": ("%DYNAMIC_METADATA(kvgate:session)%", "OVERWRITE_IF_EXISTS_OR_ADD"),
        # The priority the gate admitted with, for the queue (the case's own priority header).
        "x-team-priority": ("%DYNAMIC_METADATA(kvgate:priority)%", "OVERWRITE_IF_EXISTS_OR_ADD"),
    }


@pytest.mark.parametrize("round_trips", [1, 2])
def test_envoy_config_uses_the_gates_metadata_namespace(round_trips: int) -> None:
    from kvgate.envoyconfig.bootstrap import render_bootstrap

    config = parse_config("server: {metadata_namespace: acme.kvgate}\n")
    pools = {"interactive": HostPort("a", 1), "long": HostPort("b", 2)}
    settings = envoy_settings(config, pools, listen=HostPort("0.0.0.0", 10000), round_trips=round_trips)
    manager = ingress_manager(render_bootstrap(settings))
    ext_proc = http_filter(manager, "envoy.filters.http.ext_proc")
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["acme.kvgate"]
    pinned = manager["route_config"]["virtual_hosts"][0]["routes"][0]["match"]
    if round_trips == 1:
        assert {m["filter"] for m in pinned["dynamic_metadata"]} == {"acme.kvgate"}
        added = manager["route_config"]["request_headers_to_add"][0]["header"]
        assert added == {"key": "x-kvgate-pool", "value": "%DYNAMIC_METADATA(acme.kvgate:pool)%"}
    else:
        assert "dynamic_metadata" not in pinned
        assert "request_headers_to_add" not in manager["route_config"]
        assert "request_attributes" not in ext_proc


def test_queue_api_bypasses_the_gate_and_held_requests_outwait_envoys_idle_timeout(helm: Helm) -> None:
    routes = ingress_manager(chart_bootstrap(helm, BOOTSTRAP_CASES["queue"]))["route_config"][
        "virtual_hosts"
    ][0]["routes"]
    api = routes[:3]
    assert [r["match"] for r in api] == [
        {"path_separated_prefix": "/v1/files"},
        {"path_separated_prefix": "/v1/batches"},
        {"path_separated_prefix": "/v1/kvgate/jobs"},
    ]
    for route in api:
        assert route["route"]["cluster"] == "pool_async"
        assert route["typed_per_filter_config"] == {
            "envoy.filters.http.ext_proc": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True,
            },
            # Uploads reach the queue as sent (it refuses compressed ones): nothing caps these routes.
            "envoy.filters.http.decompressor": {
                "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                "disabled": True,
            },
        }
    # Routes without an upstream answer themselves (the gate did not answer: kvgate.envoyconfig.unanswered).
    routed = [r for r in routes if "route" in r]
    (to_queue,) = [r for r in routed[3:] if r["route"]["cluster"] == "pool_async"]
    assert to_queue["match"]["headers"][0]["string_match"] == {"exact": "async"}
    assert to_queue["route"]["idle_timeout"] == "151s", "queue.max_hold_s 120.5, rounded up, + 30 s"
    assert not [r for r in routed if r["route"]["cluster"] != "pool_async" and "idle_timeout" in r["route"]]
    bootstrap = chart_bootstrap(helm, BOOTSTRAP_CASES["queue"])
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    address = clusters["pool_async"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"
    ]
    assert address["socket_address"] == {
        "address": "rel-kvgate-queue.llm.svc.cluster.local",
        "port_value": 8080,
    }


def test_one_trip_queue_api_skips_the_buffer_too(helm: Helm) -> None:
    routes = ingress_manager(chart_bootstrap(helm, BOOTSTRAP_CASES["queue-one-trip"]))["route_config"][
        "virtual_hosts"
    ][0]["routes"]
    for route in routes[:3]:
        assert route["typed_per_filter_config"]["envoy.filters.http.buffer"] == {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
            "disabled": True,
        }


def policy_of(typed_per_filter_config: dict[str, Any]) -> dict[str, str]:
    overrides = typed_per_filter_config["envoy.filters.http.ext_proc"]["overrides"]
    return {m["key"]: m["value"] for m in overrides["grpc_initial_metadata"]}


def test_route_policies_become_virtual_hosts_and_routes(helm: Helm) -> None:
    route_config = ingress_manager(chart_bootstrap(helm, BOOTSTRAP_CASES["route-policies"]))["route_config"]
    hosts = {v["name"]: v for v in route_config["virtual_hosts"]}
    assert list(hosts) == ["pools", "policy-strict", "policy-tenants"]
    assert hosts["pools"]["domains"] == ["*"] and "typed_per_filter_config" not in hosts["pools"]
    strict = hosts["policy-strict"]
    # Ports and trailing dots are stripped from the Host before matching (test_chart_security).
    assert strict["domains"] == ["strict.example.com", "strict.local"]
    assert policy_of(strict["typed_per_filter_config"]) == {"x-kvgate-max-total-tokens": "2000"}
    assert "typed_per_filter_config" not in hosts["policy-tenants"]

    def path_sets(host: dict[str, Any]) -> dict[str, dict[str, str]]:
        found: dict[str, dict[str, str]] = {}
        for route in host["routes"]:
            prefix = route["match"].get("path_separated_prefix")
            if prefix and prefix not in ("/v1/files", "/v1/batches", "/v1/kvgate/jobs"):
                policy = policy_of(route["typed_per_filter_config"])
                assert found.setdefault(prefix, policy) == policy, "every route of a path carries its policy"
        return found

    chat = {"x-kvgate-interactive-max-tokens": "4096", "x-kvgate-max-total-tokens": "4096"}
    batch = {"x-kvgate-default-output-tokens": "0", "x-kvgate-model-policy": "batch"}
    assert path_sets(hosts["pools"]) == {"/v1/batch/chat/completions": batch, "/v1/chat": chat}
    # The host's own entry for /v1/chat wins over the every-host one, key by key; Envoy then lays the
    # route's values over the virtual host's max-total 2000.
    assert path_sets(strict) == {
        "/v1/batch/chat/completions": batch,
        "/v1/chat": chat | {"x-kvgate-async": "never"},
    }
    assert path_sets(hosts["policy-tenants"]) == {
        "/v1/batch/chat/completions": batch,
        "/v1/completions": {"x-kvgate-async": "allow"},
        "/v1/chat": chat,
    }
    prefixes = [r["match"].get("path_separated_prefix") for r in hosts["policy-tenants"]["routes"]]
    order = [
        p for i, p in enumerate(prefixes) if p and p not in prefixes[:i] and not p.startswith("/v1/files")
    ]
    assert order[-3:] == ["/v1/batch/chat/completions", "/v1/completions", "/v1/chat"], "longest prefix first"
    assert "path_separated_prefix" not in hosts["pools"]["routes"][-1]["match"], "the catch-all comes last"


def test_chart_schema_rejects_other_round_trips(helm: Helm) -> None:
    with pytest.raises(HelmFailed, match=r"at '/envoy/standalone/roundTrips': value must be one of 1, 2"):
        helm.render(standalone(envoy={"standalone": {"roundTrips": 3}}))


# --- `kvgate envoy-config` ---------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["envoy-config", *argv])
    code: int = args.func(args)
    return code


def test_cli_writes_a_bootstrap_for_the_gates_config(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("server: {listen: '0.0.0.0:9100'}\nrequest: {max_body_bytes: 1048576}\n")
    output = tmp_path / "envoy.yaml"
    code = run_cli(
        [
            *("--config", str(config), "--pool", "interactive=10.0.0.5:8000", "--pool", "long=10.0.0.6:8000"),
            *("--listen", "127.0.0.1:10080", "--output", str(output)),
        ]
    )
    assert code == 0
    bootstrap = yaml.safe_load(output.read_text())
    ingress = bootstrap["static_resources"]["listeners"][0]
    assert ingress["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10080}
    assert ingress["per_connection_buffer_limit_bytes"] == 2 * 1024 * 1024
    gate = bootstrap["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert gate["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9100}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--pool", "interactive=a:1"],
            r"routes to pool\(s\) long but no address was given \(add --pool long=",
        ),
        (["--pool", "interactive=a:1", "--pool", "long=b"], r"--pool long: expected host:port, got 'b'"),
        (["--pool", "interactive=a:1", "--pool", "interactive=a:2"], r"pool 'interactive' given twice"),
        (
            ["--pool", "interactive=a:1", "--pool", "long=b:2", "--default-pool", "x"],
            r"default pool 'x' has no",
        ),
        (
            ["--pool", "interactive=a:1", "--pool", "long=b:2", "--output", "/nonexistent/envoy.yaml"],
            r"--output /nonexistent/envoy.yaml: cannot write: No such file or directory",
        ),
    ],
)
def test_cli_errors_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_cli(argv)


def test_cli_renders_one_round_trip(tmp_path: Path) -> None:
    output = tmp_path / "envoy.yaml"
    pools = ("--pool", "interactive=10.0.0.5:8000", "--pool", "long=10.0.0.6:8000")
    assert run_cli([*pools, "--round-trips", "1", "--output", str(output)]) == 0
    ext_proc = http_filter(ingress_manager(yaml.safe_load(output.read_text())), "envoy.filters.http.ext_proc")
    assert ext_proc["processing_mode"]["request_header_mode"] == "SKIP"
    assert ext_proc["request_attributes"] == list(request_attributes("x-kvgate-priority"))


def test_cli_refuses_other_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["--pool", "interactive=a:1", "--pool", "long=b:2", "--round-trips", "3"])
    assert exit_info.value.code == 2
    assert "argument --round-trips: invalid choice: 3" in capsys.readouterr().err


def test_grpc_limit_below_the_body_limit_is_refused() -> None:
    config = parse_config("server: {max_message_bytes: 2097152}\nrequest: {max_body_bytes: 2097152}\n")
    pools = {"interactive": HostPort("a", 1), "long": HostPort("b", 2)}
    with pytest.raises(ConfigError, match=r"server\.max_message_bytes \(2097152\) must exceed"):
        envoy_settings(config, pools, listen=HostPort("0.0.0.0", 10000))


# --- end to end: the rendered bootstrap, the gate and fake pools on 127.0.0.1 ----------------------------

SENTENCE = "The scheduler admits a request only when the node can hold its whole context in KV cache. "


def text_of_about(model: Path, tokens: int) -> str:
    """A text of roughly `tokens` tokens: the tests keep far from the thresholds, so roughly is enough."""
    per_sentence = len(sentencepiece.SentencePieceProcessor(model_file=str(model)).encode(SENTENCE))
    return SENTENCE * (tokens // per_sentence)


@pytest.fixture(scope="module", params=[2, 1], ids=["two-trips", "one-trip"])
def chart_stack(
    request: pytest.FixtureRequest, helm: Helm, tmp_path_factory: pytest.TempPathFactory, sp_model_path: Path
) -> Iterator[dict[str, int]]:
    tmp = tmp_path_factory.mktemp("chart-e2e")
    ports = {
        name: free_port() for name in ("listener", "ready", "admin", "gate", "interactive", "long", "async")
    }
    pools = {name: {"address": "127.0.0.1", "port": ports[name]} for name in ("interactive", "long", "async")}
    values = {
        "gate": {"port": ports["gate"], "workers": 1, "drainSeconds": 5},
        # No agents here, so no agent certificates for the gate to load.
        "agent": {"enabled": False},
        "tls": {"agents": {"enabled": False, "clientAuth": False}},
        "envoy": {
            "mode": "standalone",
            "pools": pools,
            "standalone": {
                "listenAddress": "127.0.0.1",
                "listenPort": ports["listener"],
                "readyPort": ports["ready"],
                "adminPort": ports["admin"],
                "gateAddress": "127.0.0.1",
                "roundTrips": request.param,
            },
            "routePolicies": [{"name": "strict", "hosts": ["strict.local"], "maxTotalTokens": 2000}],
        },
    }
    docs = helm.render(values)
    bootstrap = tmp / "envoy.yaml"
    bootstrap.write_text(one(docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"])
    config_text = one(docs, "ConfigMap", "-gate")["data"]["kvgate.yaml"]
    upstreams = Upstreams({pool: ports[pool] for pool in pools})
    upstreams.start()
    envoy = envoy_process(bootstrap, tmp, ports["admin"], ports["listener"])
    try:
        with gate_process(config_text, tmp, ports["gate"], ["--tokenizer", str(sp_model_path)]):
            yield ports
    finally:
        envoy.stop()
        upstreams.stop()


@pytest.mark.slow
def test_rendered_bootstrap_routes_through_the_gate(chart_stack: dict[str, int], sp_model_path: Path) -> None:
    listener = chart_stack["listener"]
    short = post(listener, "/v1/chat/completions", chat(text_of_about(sp_model_path, 600)))
    assert short.status == 200, short.body
    assert short.json()["pool"] == "interactive"
    # The gate's decision comes back to the client, from its metadata.
    assert short.headers["x-kvgate-pool"] == "interactive"
    assert short.headers["x-kvgate-reason"] == "short"
    assert 600 < int(short.headers["x-kvgate-tokens"]) < 4096
    long = post(listener, "/v1/chat/completions", chat(text_of_about(sp_model_path, 8000)))
    assert long.status == 200, long.body
    assert long.json()["pool"] == "long"
    assert long.headers["x-kvgate-pool"] == "long"
    # gzip: Envoy inflates it before the gate, and the upstream gets the plain body.
    body = chat(text_of_about(sp_model_path, 8000))
    inflated = post(listener, "/v1/chat/completions", gzip.compress(body), {"content-encoding": "gzip"})
    assert inflated.status == 200, inflated.body
    assert inflated.json() == {"pool": "long", "body_bytes": len(body)}
    forged = post(
        listener,
        "/v1/chat/completions",
        chat(text_of_about(sp_model_path, 600)),
        {"x-kvgate-pool": "async", "x-kvgate-endpoint": f"127.0.0.1:{chart_stack['long']}"},
    )
    assert forged.json()["pool"] == "interactive", "a client-sent x-kvgate-* header must not pick the pool"
    too_long = post(listener, "/v1/chat/completions", chat(text_of_about(sp_model_path, 24000)))
    assert too_long.status == 413
    assert too_long.headers["x-kvgate-reason"] == "too_long"
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    ready = post(chart_stack["ready"], "/ready", None)  # type: ignore[arg-type]
    assert ready.status == 200


@pytest.mark.slow
def test_a_host_policy_refuses_what_the_default_host_routes(
    chart_stack: dict[str, int], sp_model_path: Path
) -> None:
    """The same 3,000-token request: 413 on strict.local (the virtual host's gRPC metadata lowers the
    gate's limit to 2,000 tokens), routed on any other host."""
    listener = chart_stack["listener"]
    body = chat(text_of_about(sp_model_path, 3000))
    routed = post(listener, "/v1/chat/completions", body)
    assert routed.status == 200, routed.body
    assert routed.headers["x-kvgate-pool"] == "interactive"
    refused = post(listener, "/v1/chat/completions", body, {"host": f"strict.local:{listener}"})
    assert refused.status == 413, refused.body
    assert refused.headers["x-kvgate-reason"] == "too_long"
    assert 2000 < int(refused.headers["x-kvgate-tokens"]) < 4096
