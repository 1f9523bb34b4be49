"""Envoy bootstraps of the two demo runs, with the ports of this run filled in.

The baseline is a plain Envoy as most deployments start: one shared pool, round-robin, no health
checks, no outlier detection, no retries. The kvgate run uses the repository's `envoy/envoy.yaml`
unchanged except for addresses: listener, admin, gate and the endpoints of each pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvgate.errors import ConfigError

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


def kvgate_bootstrap(
    repo_config: Path, listen_port: int, admin_port: int, gate_port: int, pools: Mapping[str, Sequence[int]]
) -> dict[str, Any]:
    """`repo_config` with this run's ports. `pools` maps a cluster name (interactive, long_context,
    async) to its node ports; clusters not named keep their own endpoints (ORIGINAL_DST has none)."""
    try:
        config: dict[str, Any] = yaml.safe_load(repo_config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the Envoy config {repo_config}: {exc}") from exc
    try:
        config["admin"]["address"] = _address(admin_port)
        resources = config["static_resources"]
        (listener,) = resources["listeners"]
        listener["address"] = _address(listen_port)
        clusters = {c["name"]: c for c in resources["clusters"]}
        clusters["kvgate_gate"]["load_assignment"] = _load_assignment("kvgate_gate", [gate_port])
        for name, ports in pools.items():
            clusters[name]["load_assignment"] = _load_assignment(name, ports)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{repo_config} lacks what the demo rewrites (admin, one listener, clusters kvgate_gate, "
            f"{', '.join(pools)}): {exc!r}"
        ) from exc
    return config


def write_yaml(config: Mapping[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    return path
