"""A shipped Envoy config (envoy/*.yaml) with this run's ports: the README's local layout remapped.

The shipped files use fixed local ports (LOCAL_PORTS: listener 10000, gate 9002, pools 8001-8003,
admin 9901). `render_envoy` replaces each with the run's port, and where a pool has several nodes,
replaces that pool's one endpoint with one endpoint per node, so the file runs as shipped otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvgate.harness.processes import ChildError

LOCAL_PORTS = {
    "listener": 10000,
    "gate": 9002,
    "interactive": 8001,
    "long": 8002,
    "async": 8003,
    "admin": 9901,
}


def render_envoy(source: Path, path: Path, ports: Mapping[str, int | Sequence[int]]) -> Path:
    """Write `source` to `path` with LOCAL_PORTS[name] replaced by `ports[name]` (a port, or the ports
    of a pool's nodes) for every name given; other ports are left as they are."""
    unknown = set(ports) - LOCAL_PORTS.keys()
    if unknown:
        raise ValueError(
            f"render_envoy: no local port named {sorted(unknown)} (known: {sorted(LOCAL_PORTS)})"
        )
    remap = {
        LOCAL_PORTS[name]: [value] if isinstance(value, int) else list(value) for name, value in ports.items()
    }
    try:
        config = yaml.safe_load(source.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ChildError(f"cannot read the Envoy config {source}: {exc}") from exc
    seen: set[int] = set()
    _walk(config, remap, seen)
    missing = sorted(name for name in ports if LOCAL_PORTS[name] not in seen)
    if missing:
        raise ChildError(
            f"{source} does not follow the local layout: no port for {', '.join(missing)} "
            f"({', '.join(str(LOCAL_PORTS[name]) for name in missing)})"
        )
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _walk(node: Any, remap: Mapping[int, list[int]], seen: set[int]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "lb_endpoints" and isinstance(value, list):
                node[key] = [spread for endpoint in value for spread in _spread(endpoint, remap, seen)]
            elif key == "port_value" and value in remap:
                seen.add(value)
                node[key] = remap[value][0]
            else:
                _walk(value, remap, seen)
    elif isinstance(node, list):
        for value in node:
            _walk(value, remap, seen)


def _spread(endpoint: Any, remap: Mapping[int, list[int]], seen: set[int]) -> list[Any]:
    """One endpoint per port of the pool it stands for."""
    try:
        port = endpoint["endpoint"]["address"]["socket_address"]["port_value"]
    except (KeyError, TypeError):
        _walk(endpoint, remap, seen)
        return [endpoint]
    if port not in remap:
        return [endpoint]
    seen.add(port)
    spread = []
    for new_port in remap[port]:
        copied = copy.deepcopy(endpoint)
        copied["endpoint"]["address"]["socket_address"]["port_value"] = new_port
        spread.append(copied)
    return spread
