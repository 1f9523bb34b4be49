"""The pure packages (request shape, estimation, policy) import nothing of gRPC, Envoy or asyncio I/O.

Walks the imports of every module in those packages, so the rule holds without anyone remembering it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "kvgate"
PURE_PACKAGES = ("request", "policy")
# Plain-data modules of I/O packages that the policy reads (no gRPC inside them either).
PURE_SHARED = {"kvgate.headroom.snapshot", "kvgate.headroom.settings"}
FORBIDDEN = ("grpc", "envoy", "xds", "kvgate._proto", "kvgate.gate", "kvgate.headroom", "aiohttp", "asyncio")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_pure_packages_stay_pure() -> None:
    offenders = []
    for package in PURE_PACKAGES:
        for path in (SRC / package).rglob("*.py"):
            for name in imported_modules(path):
                if name in PURE_SHARED:
                    continue
                if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN):
                    offenders.append(f"{path.relative_to(SRC)} imports {name}")
    assert not offenders, offenders


def test_only_adapters_import_envoy_types() -> None:
    allowed = {"gate", "headroom", "_proto", "envoyconfig", "demo"}
    offenders = []
    for path in SRC.rglob("*.py"):
        top = path.relative_to(SRC).parts[0]
        if top in allowed:
            continue
        for name in imported_modules(path):
            if name.startswith(("envoy.", "grpc")):
                offenders.append(f"{path.relative_to(SRC)} imports {name}")
    assert not offenders, offenders
