"""The baseline run's Envoy: a plain Envoy as most deployments start it.

One shared pool, round-robin, no health checks, no outlier detection, no retries. (The kvgate runs
use the repository's `envoy/envoy-one-trip.yaml` unchanged but for its ports: kvgate.harness.envoy.)
`rate_limited` adds what a team without kvgate reaches for to keep tenants apart: Envoy's local rate
limit, one token bucket of requests per tenant.
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
