"""The baseline run's Envoy: a plain Envoy as most deployments start it.

One shared pool, round-robin, no health checks, no outlier detection, no retries. (The kvgate runs
use the repository's `envoy/envoy-one-trip.yaml` unchanged but for its ports: kvgate.harness.envoy.)
`rate_limited` adds what a team without kvgate reaches for to keep tenants apart: Envoy's local rate
limit, one token bucket of requests per tenant. `gate_replicas` turns a kvgate run's Envoy into the
front of two gate replicas with one tenant's traffic on one of them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvgate.names import TENANT_HEADER  # where envoy/envoy-jwt.yaml's jwt_authn puts the verified tenant

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_LOCAL_RATELIMIT = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
_EXT_PROC = "envoy.filters.http.ext_proc"
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_JWT_AUTHN = "envoy.filters.http.jwt_authn"
_GATE_CLUSTER = "kvgate_gate"
_PINNED_GATE_CLUSTER = "kvgate_gate_pinned"
_ASYNC_CLUSTER = "async"  # kvgate queue's replicas, in a kvgate run
# A replica that stops answering leaves its cluster's rotation at the next check. no_traffic_interval:
# Envoy checks a cluster it has not yet sent traffic to only every 60 s by default, and the ext_proc
# streams' cluster counts as such.
_HEALTH_CHECK = {
    "timeout": "1s",
    "interval": "0.5s",
    "no_traffic_interval": "0.5s",
    "unhealthy_threshold": 1,
    "healthy_threshold": 1,
}
# Envoy 1.40 refuses a bucket refilled more often: "local rate limit descriptor token bucket fill timer
# must be >= 50ms" (`envoy --mode validate`).
_MIN_FILL_INTERVAL_S = 0.05
# Big enough for a 32k-token prompt (about 128 KiB) with room to spare, as in envoy/envoy.yaml.
_BUFFER_LIMIT = 32 * 1024 * 1024


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _load_assignment(name: str, ports: Sequence[int]) -> dict[str, Any]:
    endpoints = [{"lb_endpoints": [{"endpoint": {"address": _address(p)}} for p in ports]}] if ports else []
    return {"cluster_name": name, "endpoints": endpoints}


def baseline_bootstrap(listen_port: int, admin_port: int, node_ports: Sequence[int]) -> dict[str, Any]:
    route = {"match": {"prefix": "/"}, "route": {"cluster": "shared", "timeout": "300s"}}
    manager = {
        "@type": _HCM,
        "stat_prefix": "baseline",
        "route_config": {
            "name": "shared",
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": [route]}],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    listener = {
        "name": "baseline",
        "address": _address(listen_port),
        "per_connection_buffer_limit_bytes": _BUFFER_LIMIT,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }
    cluster = {
        "name": "shared",
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "1s",
        "load_assignment": _load_assignment("shared", node_ports),
    }
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def rate_limited(bootstrap: Mapping[str, Any], per_tenant: Mapping[str, float]) -> dict[str, Any]:
    """`bootstrap` (baseline_bootstrap's) with Envoy's local rate limit ahead of the router: each tenant
    named in `per_tenant` gets its own bucket of that many requests a second, keyed by the verified
    tenant header; a request over it gets Envoy's own 429. Requests without a tenant are not limited."""
    config: dict[str, Any] = copy.deepcopy(dict(bootstrap))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    unlimited = {"max_tokens": 1_000_000, "tokens_per_fill": 1_000_000, "fill_interval": "1s"}
    always = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}, "runtime_key": "tenant_rate"}
    limit = {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": _LOCAL_RATELIMIT,
            "stat_prefix": "tenant_rate",
            "token_bucket": unlimited,
            "filter_enabled": always,
            "filter_enforced": always,
            "descriptors": [
                {"entries": [{"key": "tenant", "value": tenant}], "token_bucket": _bucket(rate)}
                for tenant, rate in per_tenant.items()
            ],
            "rate_limits": [
                {"actions": [{"request_headers": {"header_name": TENANT_HEADER, "descriptor_key": "tenant"}}]}
            ],
        },
    }
    manager["http_filters"] = [limit, *manager["http_filters"]]
    return config


def _bucket(requests_per_s: float) -> dict[str, Any]:
    """One request per 1/rate seconds, with a second's worth of burst."""
    interval_s = max(_MIN_FILL_INTERVAL_S, 1 / requests_per_s)
    burst = max(1, math.ceil(requests_per_s))
    return {"max_tokens": burst, "tokens_per_fill": 1, "fill_interval": f"{interval_s:.3f}s"}


def write_yaml(config: Mapping[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    return path


def gate_replicas(config: Mapping[str, Any], pinned_tenant: str, pinned_port: int) -> dict[str, Any]:
    """`config` (a rendered kvgate Envoy config whose gate cluster lists every gate replica and whose
    async cluster every queue replica, with envoy/envoy-jwt.yaml's jwt_authn first) with the replicas
    health-checked, so that a dead one leaves the rotation within a second, and `pinned_tenant`'s
    requests processed by the replica on `pinned_port` alone: an uneven split, one tenant's load on one
    replica. Each route gets a copy
    ahead of it that matches the tenant's verified header and names a cluster of that replica as its
    ext_proc service (ExtProcPerRoute overrides.grpc_service). jwt_authn clears the route cache after it
    sets the header (clear_route_cache), so the copy is the route ext_proc sees."""
    edited: dict[str, Any] = copy.deepcopy(dict(config))
    resources = edited["static_resources"]
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = {f["name"]: f["typed_config"] for f in manager["http_filters"]}
    filters[_JWT_AUTHN]["providers"]["kvgate"]["clear_route_cache"] = True
    clusters = {c["name"]: c for c in resources["clusters"]}
    gate = clusters[_GATE_CLUSTER]
    gate["health_checks"] = [{**_HEALTH_CHECK, "grpc_health_check": {}}]
    if _ASYNC_CLUSTER in clusters:
        clusters[_ASYNC_CLUSTER]["health_checks"] = [
            {**_HEALTH_CHECK, "http_health_check": {"path": "/health"}}
        ]
    pinned = copy.deepcopy(gate)
    pinned["name"] = _PINNED_GATE_CLUSTER
    pinned["load_assignment"] = _load_assignment(_PINNED_GATE_CLUSTER, [pinned_port])
    resources["clusters"].append(pinned)
    service = copy.deepcopy(filters[_EXT_PROC]["grpc_service"])
    service["envoy_grpc"]["cluster_name"] = _PINNED_GATE_CLUSTER
    host = manager["route_config"]["virtual_hosts"][0]
    host["routes"] = [r for route in host["routes"] for r in (_pinned(route, pinned_tenant, service), route)]
    return edited


def _pinned(route: Mapping[str, Any], tenant: str, service: Mapping[str, Any]) -> dict[str, Any]:
    """`route` for `tenant`'s requests alone, processed by `service` (unless the route turns ext_proc off)."""
    pinned: dict[str, Any] = copy.deepcopy(dict(route))
    pinned["match"].setdefault("headers", []).append(
        {"name": TENANT_HEADER, "string_match": {"exact": tenant}}
    )
    per_filter = pinned.setdefault("typed_per_filter_config", {})
    own = per_filter.setdefault(_EXT_PROC, {"@type": _EXT_PROC_PER_ROUTE, "overrides": {}})
    if "overrides" in own:
        own["overrides"]["grpc_service"] = copy.deepcopy(dict(service))
    return pinned
