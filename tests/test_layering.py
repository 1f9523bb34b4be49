"""The pure code imports nothing of gRPC, Envoy, HTTP or asyncio I/O, and only adapters see Envoy types.

A package whose docstring says it is pure (request, policy), or names its pure modules (estimate,
headroom, sim), is walked here module by module: every module is held to the rule except the I/O
modules named below, each with why. The rule holds without anyone remembering it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "kvgate"

# Per package: its I/O modules (relative dotted names), each with the reason it does I/O.
IO_MODULES: dict[str, dict[str, str]] = {
    "request": {},
    "policy": {},
    "estimate": {
        "__init__": "builds estimators, which start the counting worker processes",
        "pool": "the counting worker processes",
        "estimator": "awaits exact counts in an executor, off the event loop",
        "cli": "`kvgate estimate` / `kvgate calibrate`: files and stdin",
    },
    "headroom": {
        "client": "the gate's gRPC client of an agent",
        "credentials": "TLS files and gRPC channel credentials",
        "giveback": "tries a Release again after a pause (asyncio)",
        "ledger_stream": "Reserve, Release, Renew and FirstToken as messages on one gRPC stream",
        "protogen": "runs grpcio-tools",
        "resolve": "DNS",
        "view": "the gate's Subscribe streams, Reserve and Release",
        "wire": "protobuf conversion of the agent's messages",
    },
    "agent": {
        "server": "the agent's gRPC server",
        "metrics": "the agent's Prometheus endpoint",
        "subscribers": "each stream subscriber's asyncio mailbox and pacer",
        "cli": "`kvgate agent`",
        "in_process": "in-process agents behind the gate's asyncio interface, for tests",
        "sources.fake_engine": "a fake engine /metrics over HTTP, for tests",
        "sources.fake_nvml": "a scriptable pynvml stand-in with a hanging mode (threads)",
        "sources.nvml": "NVML calls on their own thread",
        "sources.scrape": "the engine's /metrics over HTTP/1.1",
        "sources.kv_events": "the engine's KV events over ZeroMQ, on their own thread",
    },
    "queue": {
        "__init__": "imports nothing, but names the package's I/O modules",
        "stores": "opens the store (SQLite file or PostgreSQL server)",
        "sqlite_db": "SQLite on a thread",
        "postgres_db": "PostgreSQL over psycopg",
        "store": "jobs in the store",
        "batchstore": "batches in the store",
        "filestore": "files in the store, chunk by chunk",
        "engines": "calls engines over HTTP",
        "runner": "runs a job on a node: Reserve, the engine call, Release",
        "dispatcher": "waits on agents and the store, dispatches",
        "live": "relays a running job to held clients (asyncio)",
        "app": "the queue's HTTP server",
        "batch_http": "the Batch API over HTTP",
        "files_http": "the Files API over HTTP",
        "intake": "builds estimators (worker processes)",
        "settle": "settles batches in the store",
        "metrics": "reads the store's figures for the metrics endpoint",
        "service": "wires the queue together",
        "cli": "`kvgate queue`",
    },
    "sim": {
        "__main__": "`python -m kvgate.sim`",
        "cli": "`kvgate sim`",
        "server": "the simulator's HTTP server",
    },
}
# Plain modules outside those packages that pure code may import.
SHARED = {
    "kvgate.config",
    "kvgate.config.headroom",
    "kvgate.config.queue",
    "kvgate.config.routekeys",
    "kvgate.addresses",
    "kvgate.digits",
    "kvgate.errors",
    "kvgate.names",
    "kvgate.bounds",
    "kvgate.quantiles",
}
# The floor: modules every package may stand on. They import only each other (and kvgate.config's
# own section modules), never a package above them.
FLOOR = SHARED | {"kvgate.tls", "kvgate.telemetry", "kvgate.localports", "kvgate.listening"}
# Packages that see an agent only through kvgate.headroom's contract, never the agent process's code.
AGENT_CLIENTS = ("gate", "policy", "queue", "headroom", "request", "estimate")
FORBIDDEN = (
    "grpc",
    "envoy",
    "xds",
    "aiohttp",
    "asyncio",
    "socket",
    "subprocess",
    "threading",
    "multiprocessing",
    "concurrent",
    "http",
    "urllib",
    "psycopg",
    "sqlite3",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("kvgate", *parts))


def is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (SRC / relative).with_suffix(".py").is_file() or (SRC / relative / "__init__.py").is_file()


def pure_modules() -> dict[str, Path]:
    found = {}
    for package, io_modules in IO_MODULES.items():
        for path in (SRC / package).rglob("*.py"):
            relative = ".".join(path.relative_to(SRC / package).with_suffix("").parts)
            if relative not in io_modules:
                found[module_name(path)] = path
    return found


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from kvgate.estimate import fast` depends on the module kvgate.estimate.fast.
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found = {name for name in submodules if name.startswith("kvgate.") and is_module(name)}
            names.update(found or {node.module})
    return names


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in SRC.rglob("*.py") if "_proto" not in path.parts}


def kvgate_imports(path: Path) -> set[str]:
    return {name for name in imported_modules(path) if name.startswith("kvgate.") or name == "kvgate"}


def test_the_floor_imports_nothing_above_it() -> None:
    offenders = [
        f"{name} imports {imported}"
        for name, path in sorted(all_modules().items())
        if name in FLOOR
        for imported in sorted(kvgate_imports(path))
        if imported not in FLOOR and imported != "kvgate"
    ]
    assert not offenders, offenders


def test_the_gate_policy_and_queue_never_import_the_agent() -> None:
    offenders = [
        f"{name} imports {imported}"
        for name, path in sorted(all_modules().items())
        if name.partition(".")[2].split(".")[0] in AGENT_CLIENTS
        for imported in sorted(kvgate_imports(path))
        if imported == "kvgate.agent" or imported.startswith("kvgate.agent.")
    ]
    assert not offenders, offenders


def test_no_import_circles() -> None:
    """A circle means two modules are one idea, or a contract that knows its implementations."""
    modules = all_modules()
    graph = {
        name: {i for i in kvgate_imports(path) if i in modules and i != name}
        for name, path in modules.items()
    }
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for imported in sorted(graph[name]):
            # A package's __init__ re-exporting its own modules is not a circle of ideas.
            if name.startswith(imported + "."):
                continue
            if state.get(imported) == 1:
                circles.append([*path[path.index(imported) :], imported])
            elif imported not in state:
                visit(imported)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, circles


def test_pure_modules_stay_pure() -> None:
    pure = pure_modules()
    offenders = []
    for name, path in sorted(pure.items()):
        for imported in imported_modules(path):
            if any(imported == bad or imported.startswith(bad + ".") for bad in FORBIDDEN):
                offenders.append(f"{name} imports {imported}")
            elif imported.startswith("kvgate.") and imported not in pure and imported not in SHARED:
                # `from kvgate.policy import X` names a package: its __init__ must be pure too.
                offenders.append(f"{name} imports {imported}, which is not pure")
    assert not offenders, offenders


def test_the_io_lists_name_real_modules_and_the_docstrings_claim_purity() -> None:
    for package, io_modules in IO_MODULES.items():
        for relative in io_modules:
            assert (SRC / package / (relative.replace(".", "/") + ".py")).is_file(), f"{package}.{relative}"
        docstring = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text())) or ""
        assert "pure" in docstring.lower(), f"kvgate.{package}'s docstring should say what is pure"


def test_only_adapters_import_envoy_types() -> None:
    allowed = {"gate", "headroom", "agent", "_proto", "envoyconfig", "demo", "harness"}
    offenders = []
    for path in SRC.rglob("*.py"):
        top = path.relative_to(SRC).parts[0]
        if top in allowed:
            continue
        for name in imported_modules(path):
            if name.startswith(("envoy.", "grpc")):
                offenders.append(f"{path.relative_to(SRC)} imports {name}")
    assert not offenders, offenders


# The gate's seam runs one way: the adapter (Envoy's messages in, ProcessingResponses out) uses the
# pipeline (which decides) and the few modules that shape its answers, nothing of the gate past them;
# the pipeline, and everything it stands on, knows nothing of the adapter or of Envoy.
GATE_ADAPTER = "kvgate.gate.processor"
GATE_ADAPTER_USES = {"kvgate.gate.pipeline", "kvgate.gate.responses", "kvgate.gate.holding"}
GATE_DECIDER = "kvgate.gate.pipeline"
ADAPTER_SIDE = {GATE_ADAPTER} | GATE_ADAPTER_USES - {GATE_DECIDER}


def seam_offenders(modules: dict[str, Path]) -> list[str]:
    offenders = [
        f"{GATE_ADAPTER} reaches past the pipeline into {imported}"
        for imported in sorted(kvgate_imports(modules[GATE_ADAPTER]))
        if imported.startswith("kvgate.gate.") and imported not in GATE_ADAPTER_USES
    ]
    seen, todo = set(), [GATE_DECIDER]
    while todo:  # everything the pipeline stands on, directly or not
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        imported = imported_modules(modules[name])
        offenders += [
            f"{name} (under the pipeline) imports {bad}"
            for bad in sorted(imported)
            if bad in ADAPTER_SIDE or bad.startswith(("envoy", "grpc"))
        ]
        todo += [i for i in imported if i.startswith("kvgate.")]
    return offenders


def test_the_gates_seam_runs_one_way() -> None:
    offenders = seam_offenders(all_modules())
    assert not offenders, offenders
