"""The baseline run's Envoy: a plain Envoy as most deployments start it.

One shared pool, round-robin, no health checks, no outlier detection, no retries. (The kvgate runs
use the repository's `envoy/envoy-one-trip.yaml` unchanged but for its ports: kvgate.harness.envoy.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
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


def write_yaml(config: Mapping[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    return path
