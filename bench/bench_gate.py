"""The gate's cost through the real Envoy: no ext_proc vs a trivial ext_proc vs the kvgate gate,
with two round trips per request (envoy/envoy.yaml) and with one (envoy/envoy-one-trip.yaml).

One Envoy serves the listeners, all with the same routes: (a) without the ext_proc filter; (b) and
(c) the shipped two-round-trip listener pointed at bench/trivial_extproc.py and at `kvgate gate`;
(b1) and (c1) the one-round-trip listener pointed at the same two servers (and (e), the one-trip
listener without ext_proc, for bench/bench_body.py). The same 2 KB short-chat load goes through each
of the five: p50/p99 at 400 req/s (two interleaved rounds, so background load on the shared cores
hits all alike), the highest rate that keeps p99 under 10 ms, and the CPU each process spends per
request. Targets (issue 2): the gate adds <= 0.5 ms p50 and <= 1.5 ms p99 over (a) at 400 req/s, and
holds >= 90% of the trivial server's highest rate. Goals (issue 23), over the trivial server in the
same set-up: p50 <= +0.10 ms, p99 <= +0.20 ms, CPU per request <= 1.10x, highest rate >= 0.95x.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import http.client
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import uvloop
import yaml
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from bench.gc_watch import summary as gc_summary
from bench.loadgen import LoadResult, http_request, percentile, run_load, serve_upstreams
from bench.trivial_extproc import TrivialPicker, TrivialProcessor
from kvgate.config import Config
from kvgate.gate.admission import Admission
from kvgate.gate.picker import EndpointPicker
from kvgate.gate.pipeline import Pipeline
from kvgate.gate.processor import ATTRIBUTES_NAMESPACE, ExternalProcessor, header_attribute
from kvgate.harness.envoy import LOCAL_PORTS, render_envoy
from kvgate.harness.processes import ProcessGroup, find_envoy, wait_for_port
from kvgate.headroom.snapshot import CapacitySource, NodeHeadroom, NodeRole, NodeView
from kvgate.localports import free_port
from kvgate.telemetry import DecisionSpans, GateMetrics

ROOT = Path(__file__).resolve().parent.parent
ENVOY_YAML = ROOT / "envoy" / "envoy.yaml"
PATH = "/v1/chat/completions"
BASE_RATE = 400.0
ROUNDS = 2
STEP_S = 3.0
SEARCH_STEP_S = 2.5
RATE_GRID = 100
RATE_CAP = 4800
TARGET_P50_MS, TARGET_P99_MS, TARGET_RATE_RATIO = 0.5, 1.5, 0.9
# Issue 23: what the gate may add over the trivial server in the same set-up.
OVER_P50_MS, OVER_P99_MS, OVER_CPU_RATIO, OVER_RATE_RATIO = 0.10, 0.20, 1.10, 0.95
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
BUSY_LOAD = 1.0
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
ONE_TRIP_YAML = ROOT / "envoy" / "envoy-one-trip.yaml"
GATE_VARIANTS = ("a", "b", "c", "b1", "c1")
GC_LOG = "gate-gc.json"


def chat_body(size: int = 2048) -> bytes:
    """A short chat request of exactly `size` bytes: a system prompt and a user question."""
    sentence = "Please summarise the quarterly report and list the three main risks it names. "
    frame = {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": ""},
        ],
        "temperature": 0.2,
    }
    room = size - len(json.dumps(frame).encode())
    frame["messages"][1]["content"] = (sentence * (room // len(sentence) + 1))[:room]  # type: ignore[index]
    body = json.dumps(frame).encode()
    assert len(body) == size
    return body


@dataclass(frozen=True, slots=True)
class Variant:
    key: str
    label: str
    port: int
    ext_proc_pid: int | None


@dataclass
class Tally:
    """One variant's 400 req/s figures summed over rounds."""

    latencies: list[float] = field(default_factory=list)
    completed: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)
    lag_p99_s: float = 0.0

    def add(self, result: LoadResult, cpu_s: dict[str, float]) -> None:
        self.latencies.extend(result.latencies_s)
        self.completed += result.completed
        self.lag_p99_s = max(self.lag_p99_s, result.lag_p99_s)
        for name, seconds in cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds

    def ms(self, q: float) -> float:
        return percentile(self.latencies, q) * 1000

    def cpu_us_per_request(self, name: str) -> float:
        return self.cpu_s.get(name, 0.0) / max(1, self.completed) * 1e6


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (the comm field may hold spaces: split after ')')."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def envoy_config(ports: dict[str, int], tmp: Path) -> Path:
    """The shipped envoy.yaml with free ports, plus the one-round-trip listener of
    envoy-one-trip.yaml (same clusters), a trivial-ext_proc copy of each and a plain listener."""
    local = {name: port for name, port in ports.items() if name in LOCAL_PORTS}
    shipped = yaml.safe_load(render_envoy(ENVOY_YAML, tmp / "shipped.yaml", local).read_text())
    one_trip = yaml.safe_load(render_envoy(ONE_TRIP_YAML, tmp / "one-trip.yaml", local).read_text())
    resources = shipped["static_resources"]
    gate_listener = resources["listeners"][0]
    one_trip_listener = _listener_copy(
        one_trip["static_resources"]["listeners"][0], "bench_one_trip", ports["listener1"]
    )
    gate_cluster = next(c for c in resources["clusters"] if c["name"] == "kvgate_gate")

    trivial_cluster = copy.deepcopy(gate_cluster)
    trivial_cluster["name"] = trivial_cluster["load_assignment"]["cluster_name"] = "bench_trivial"
    endpoint = trivial_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"]["port_value"] = ports["trivial"]
    resources["clusters"].append(trivial_cluster)

    trivial_listener = _listener_copy(gate_listener, "bench_trivial", ports["trivial_listener"])
    trivial_one_trip = _listener_copy(one_trip_listener, "bench_trivial_one_trip", ports["trivial_listener1"])
    for listener in (trivial_listener, trivial_one_trip):
        for http_filter in _http_filters(listener):
            if http_filter["name"] == EXT_PROC_FILTER:
                http_filter["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "bench_trivial"
    plain_listener = _listener_copy(gate_listener, "bench_plain", ports["plain_listener"])
    # The one-trip listener without ext_proc: Envoy holds each body whole (its buffer filter), as it
    # must for any ext_proc server that reads bodies, and sends it on.
    buffered_listener = _listener_copy(one_trip_listener, "bench_buffered", ports["buffered_listener"])
    for listener in (plain_listener, buffered_listener):
        filters = _http_filters(listener)
        filters[:] = [f for f in filters if f["name"] != EXT_PROC_FILTER]
    resources["listeners"] += [
        trivial_listener,
        plain_listener,
        one_trip_listener,
        trivial_one_trip,
        buffered_listener,
    ]

    path = tmp / "envoy.yaml"
    path.write_text(yaml.safe_dump(shipped))
    return path


def _listener_copy(listener: dict[str, Any], name: str, port: int) -> dict[str, Any]:
    clone = copy.deepcopy(listener)
    clone["name"] = name
    clone["address"]["socket_address"]["port_value"] = port
    return clone


def _http_filters(listener: dict[str, Any]) -> list[dict[str, Any]]:
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict[str, Any]] = manager["http_filters"]
    return filters


def gate_config_text(max_total_tokens: int | None = None) -> str:
    """Default limits (or the total limit given); the default model gets a real sentencepiece tokenizer
    when one is installed."""
    entries: dict[str, str | int] = {} if max_total_tokens is None else {"max_total_tokens": max_total_tokens}
    with contextlib.suppress(ImportError):
        import mistral_common

        model = Path(mistral_common.__file__).parent / "data" / "mistral_instruct_tokenizer_240323.model.v3"
        if model.exists():
            entries["tokenizer"] = str(model)
    return yaml.safe_dump({"default_model": entries}) if entries else "{}\n"


@contextlib.contextmanager
def running_stack(
    tmp: Path, gate_config: str | None = None
) -> Iterator[tuple[dict[str, Variant], dict[str, int]]]:
    """Upstreams, the gate, the trivial server and one Envoy; yields the variants by key and process
    ids. The gate runs `gate_config` (default: gate_config_text())."""
    listeners = ("listener", "listener1", "trivial_listener", "trivial_listener1", "plain_listener")
    names = (*listeners, "buffered_listener", "gate", "trivial", "admin")
    ports = {name: free_port() for name in (*names, "metrics", "interactive", "long", "async")}
    upstream = multiprocessing.get_context("spawn").Process(
        target=serve_upstreams, args=({p: ports[p] for p in ("interactive", "long", "async")},), daemon=True
    )
    upstream.start()
    (tmp / "kvgate.yaml").write_text(gate_config or gate_config_text())
    group = ProcessGroup(tmp)
    try:
        # Metrics stay on, as `kvgate gate` runs by default, on a free port.
        gate_argv = ["--config", str(tmp / "kvgate.yaml"), "--listen", f"127.0.0.1:{ports['gate']}"]
        gate_argv += ["--metrics-listen", f"127.0.0.1:{ports['metrics']}"]
        # Every collection timed once it serves (bench/gc_watch.py), read by gc_summary().
        watch = [sys.executable, "-m", "bench.gc_watch", str(tmp / GC_LOG)]
        gate = group.start("gate", [*watch, "gate", *gate_argv])
        trivial_argv = ["-m", "bench.trivial_extproc", "--listen", f"127.0.0.1:{ports['trivial']}"]
        trivial = group.start("trivial", [sys.executable, *trivial_argv])
        envoy_argv = ["-c", str(envoy_config(ports, tmp)), "--disable-hot-restart", "--log-level", "warning"]
        envoy = group.start("envoy", [str(find_envoy()), *envoy_argv])
        for service, port in ((gate, "gate"), (trivial, "trivial"), (envoy, "listener")):
            service.wait_listening(ports[port])
        # Envoy's first listener is up: wait for the others and the upstreams.
        for port in (*listeners[1:], "buffered_listener", "interactive"):
            wait_for_port(ports[port])
        variants = [
            Variant("a", "(a) Envoy, no ext_proc", ports["plain_listener"], None),
            Variant("b", "(b) + trivial, 2 trips", ports["trivial_listener"], trivial.process.pid),
            Variant("c", "(c) + kvgate, 2 trips", ports["listener"], gate.process.pid),
            Variant("b1", "(b1) + trivial, 1 trip", ports["trivial_listener1"], trivial.process.pid),
            Variant("c1", "(c1) + kvgate, 1 trip", ports["listener1"], gate.process.pid),
            Variant("e", "(e) Envoy + buffer, no ext_proc", ports["buffered_listener"], None),
        ]
        pids = {"envoy": envoy.process.pid, "upstream": upstream.pid or 0, "loadgen": os.getpid()}
        yield {variant.key: variant for variant in variants}, pids
    finally:
        group.stop_all()
        upstream.terminate()
        upstream.join(5)


def check_routing(variant: Variant, body: bytes, pool: str = "interactive") -> None:
    """One request through the variant: 200, and the pool header the upstream saw is the expected one
    (`pool` through an ext_proc server, none without)."""
    conn = http.client.HTTPConnection("127.0.0.1", variant.port, timeout=10)
    try:
        conn.request("POST", PATH, body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        reply = response.read()
    finally:
        conn.close()
    expected = "-" if variant.ext_proc_pid is None else pool
    if response.status != 200 or json.loads(reply)["x-kvgate-pool"] != expected:
        raise RuntimeError(f"{variant.label}: unexpected answer {response.status} {reply!r}")


async def measure_base_rate(
    variants: list[Variant],
    pids: dict[str, int],
    payload: bytes,
    *,
    rate: float = BASE_RATE,
    step_s: float = STEP_S,
    warm_s: float = 1.0,
) -> dict[str, Tally]:
    """Warm every variant up, then run a step of `rate` req/s ROUNDS times, interleaving the variants
    (bench/bench_floor.py runs it at the Mooncake replay's rate)."""
    for variant in variants:
        await run_load("127.0.0.1", variant.port, payload, rate, warm_s)
    tallies = {variant.key: Tally() for variant in variants}
    for _ in range(ROUNDS):
        for variant in variants:
            watched = dict(pids)
            if variant.ext_proc_pid is not None:
                watched["ext_proc"] = variant.ext_proc_pid
            before = {name: cpu_seconds(pid) for name, pid in watched.items()}
            result = await run_load("127.0.0.1", variant.port, payload, rate, step_s)
            spent = {name: cpu_seconds(pid) - before[name] for name, pid in watched.items()}
            tallies[variant.key].add(result, spent)
    return tallies


async def highest_rate(variant: Variant, payload: bytes, base_held: bool) -> tuple[int, str]:
    """The highest rate on a RATE_GRID req/s grid with p99 < 10 ms: double from 400, then bisect."""
    trail = []
    if not base_held:
        # The base measurement may have met a burst from another process: ask the search's own test.
        held, p99_ms = await holds(variant, payload, int(BASE_RATE))
        trail.append(f"{BASE_RATE:.0f} {'ok' if held else 'no'} ({p99_ms:.1f})")
        if not held:
            fallback = int(BASE_RATE) // 2
            held, p99_ms = await holds(variant, payload, fallback)
            trail.append(f"{fallback} {'ok' if held else 'no'} ({p99_ms:.1f})")
            return (fallback if held else 0), ", ".join(trail)
    passing, failing = int(BASE_RATE), RATE_CAP + RATE_GRID
    rate = min(2 * passing, RATE_CAP)
    while failing - passing > RATE_GRID and rate > passing:
        held, p99_ms = await holds(variant, payload, rate)
        trail.append(f"{rate} {'ok' if held else 'no'} ({p99_ms:.1f})")
        if held:
            passing = rate
        else:
            failing = rate
        doubled = min(2 * passing, RATE_CAP) if failing > RATE_CAP else 0
        rate = doubled or (passing + failing) // 2 // RATE_GRID * RATE_GRID
    return passing, ", ".join(trail)


async def holds(variant: Variant, payload: bytes, rate: int) -> tuple[bool, float]:
    """Whether the variant keeps p99 < 10 ms at `rate`: a failed step gets one more try, because a
    burst from another process on the shared cores can spoil a single step."""
    p99_ms = 0.0
    for _ in range(2):
        result = await run_load("127.0.0.1", variant.port, payload, rate, SEARCH_STEP_S, give_up_early=True)
        p99_ms = result.p99_ms
        if result.holds():
            return True, p99_ms
        await asyncio.sleep(0.5)  # let the backlog of an overload drain
    return False, p99_ms


def envoy_messages(body: bytes, round_trips: int) -> list[bytes]:
    """The messages Envoy sends for one chat request, serialized: headers and body with two round
    trips; with one, the body alone, carrying the request attributes envoy-one-trip.yaml asks for."""
    if round_trips == 1:
        message = ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))
        fields = message.attributes[ATTRIBUTES_NAMESPACE].fields
        fields["request.path"].string_value = PATH
        fields["request.method"].string_value = "POST"
        fields["request.id"].string_value = "5f0c6a58-2d47-4d8e-9b3f-2f4f8d5f4b7e"
        fields[header_attribute("content-type")].string_value = "application/json"
        return [message.SerializeToString()]
    headers = {
        ":authority": "127.0.0.1:10000",
        ":path": PATH,
        ":method": "POST",
        ":scheme": "http",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "user-agent": "bench",
        "x-forwarded-proto": "http",
        "x-request-id": "5f0c6a58-2d47-4d8e-9b3f-2f4f8d5f4b7e",
    }
    head = HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])
    )
    return [
        ProcessingRequest(request_headers=head).SerializeToString(),
        ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)).SerializeToString(),
    ]


# A streamed chat answer as vLLM sends it: one SSE event per token or so.
SSE_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1764000000,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}\n\n'
)
STREAMED_CHUNKS = 200


def picker_messages(body: bytes, chunks: int) -> list[bytes]:
    """What an InferencePool's Envoy sends the picker for one streamed chat (envoy-inferencepool.yaml,
    FULL_DUPLEX_STREAMED both ways): headers, the body, the response headers and `chunks` SSE events."""
    headers, _ = envoy_messages(body, 2)
    first = ProcessingRequest.FromString(headers)
    first.request_headers.end_of_stream = False
    first.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    answer = HttpHeaders(
        headers=HeaderMap(
            headers=[
                HeaderValue(key=":status", raw_value=b"200"),
                HeaderValue(key="content-type", raw_value=b"text/event-stream"),
            ]
        )
    )
    events = [
        ProcessingRequest(response_body=HttpBody(body=SSE_CHUNK, end_of_stream=i == chunks - 1))
        for i in range(chunks)
    ] or [ProcessingRequest(response_body=HttpBody(body=b"", end_of_stream=True))]
    return [
        first.SerializeToString(),
        ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)).SerializeToString(),
        ProcessingRequest(response_headers=answer).SerializeToString(),
        *(event.SerializeToString() for event in events),
    ]


class _OneEngine:
    """The interactive pool as admission sees it: one healthy engine, as its agent would report it."""

    def __init__(self) -> None:
        headroom = NodeHeadroom(
            node="n", endpoint="10.0.0.1:8000", seq=1, sample_time_unix_ns=0, capacity_tokens=100_000,
            safety_ratio=0.9, used_tokens=0, reserved_tokens=0, reservations=0, headroom_tokens=90_000,
            healthy=True, reason="", capacity_source=CapacitySource.ENGINE, kv_usage=0.0, running=0,
            waiting=0, preemptions_total=0, gpus=(), period_ms=100, role=NodeRole.INTERACTIVE,
        )  # fmt: skip
        self._nodes = (NodeView("127.0.0.1:2", headroom, 0.0, True, True, True),)

    def snapshot(self) -> tuple[NodeView, ...]:
        return self._nodes


def picker_config_text() -> str:
    config = yaml.safe_load(gate_config_text())
    config["server"] = {"protocol": "endpoint-picker"}
    # Named for the config's checks; the bench hands admission its own view (_OneEngine).
    config["headroom"] = {"agents": ["127.0.0.1:1"]}
    config["interactive_headroom"] = {"agents": ["127.0.0.1:2"]}
    return yaml.safe_dump(config)


def gate_servicer(config: Config, pipeline: Pipeline) -> ExternalProcessor:
    """The gate's servicer, built as kvgate.gate.server.serve builds it, without agents (in process,
    with the gate's metrics on)."""
    return ExternalProcessor(pipeline, config, GateMetrics(), DecisionSpans())


class Servicer(Protocol):
    """What the in-process measurement needs of an ext_proc servicer."""

    def Process(  # the gRPC method name
        self, requests: AsyncIterator[ProcessingRequest], context: Any
    ) -> AsyncIterator[ProcessingResponse]: ...


async def _per_request_s(
    servicer: Servicer, messages: list[bytes], count: int = 50, batches: int = 40
) -> float:
    """CPU seconds per request through `servicer.Process`: the best of many short batches, in this
    process's CPU time, because other processes on the shared cores only ever add time."""

    async def stream() -> AsyncIterator[ProcessingRequest]:
        for raw in messages:
            yield ProcessingRequest.FromString(raw)

    best = math.inf
    for _ in range(batches):
        started = time.process_time()
        for _ in range(count):
            async for response in servicer.Process(stream(), None):
                response.SerializeToString()
        best = min(best, (time.process_time() - started) / count)
    return best


def servicer_costs(body: bytes) -> dict[str, float]:
    """µs per request of the gate's and the trivial servicer with two round trips and with one,
    driven directly without gRPC (keys: gate, trivial, gate1, trivial1).

    Runs in a child process: the gate's metrics (on, as `kvgate gate` runs by default) set the
    process-wide OpenTelemetry provider.
    """
    from kvgate.config import parse_config
    from kvgate.gate.pipeline import estimator_factory
    from kvgate.telemetry import start_prometheus

    start_prometheus(f"127.0.0.1:{free_port()}")

    async def measure() -> dict[str, float]:
        config = parse_config(gate_config_text())
        pipeline = Pipeline(config, estimator_factory())
        try:
            servers: dict[str, Servicer] = {
                "gate": gate_servicer(config, pipeline),
                "trivial": TrivialProcessor(),
            }
            costs = {}
            for trips, suffix in ((2, ""), (1, "1")):
                messages = envoy_messages(body, trips)
                for name, server in servers.items():
                    costs[name + suffix] = await _per_request_s(server, messages) * 1e6
            costs.update(await _picker_costs(body))
            return costs
        finally:
            pipeline.close()

    async def _picker_costs(body: bytes) -> dict[str, float]:
        """The picker and the trivial picker per request (no response body) and per streamed chunk."""
        config = parse_config(picker_config_text())
        admission = Admission(config.admission, None, _OneEngine(), GateMetrics())
        pipeline = Pipeline(config, estimator_factory(), admission)
        try:
            pickers: dict[str, Servicer] = {
                "picker": EndpointPicker(pipeline, config, GateMetrics(), DecisionSpans()),
                "trivial_picker": TrivialPicker(),
            }
            costs = {}
            for name, server in pickers.items():
                bare = await _per_request_s(server, picker_messages(body, 0))
                streamed = await _per_request_s(server, picker_messages(body, STREAMED_CHUNKS))
                costs[name] = bare * 1e6
                costs[name + "_chunk"] = max(0.0, streamed - bare) / STREAMED_CHUNKS * 1e6
            return costs
        finally:
            pipeline.close()

    return uvloop.run(measure())


def print_report(variants: list[Variant], tallies: dict[str, Tally], rates: dict[str, int]) -> None:
    base = tallies["a"]
    print(
        f"{'at 400 req/s':<26}{'p50 ms':>9}{'p99 ms':>9}{'+p50':>9}{'+p99':>9}{'max req/s':>11}"
        f"{'ext_proc':>10}{'envoy':>8}  (CPU µs/req)"
    )
    for variant in variants:
        tally = tallies[variant.key]
        added = variant.key != "a"
        extra_p50 = tally.ms(50) - base.ms(50)
        extra_p99 = tally.ms(99) - base.ms(99)
        ext_proc = f"{tally.cpu_us_per_request('ext_proc'):.0f}" if added else "-"
        cap = "+" if rates[variant.key] >= RATE_CAP else ""
        print(
            f"{variant.label:<26}{tally.ms(50):9.2f}{tally.ms(99):9.2f}{extra_p50:+9.2f}{extra_p99:+9.2f}"
            f"{rates[variant.key]:>10}{cap:1}{ext_proc:>10}{tally.cpu_us_per_request('envoy'):8.0f}"
        )
    for gate_key, trivial_key, trips in (("c", "b", "two round trips"), ("c1", "b1", "one round trip")):
        _print_verdicts(tallies, rates, gate_key, trivial_key, trips)
    print(
        f"one round trip vs two, max rate: gate {rates['c1']} vs {rates['c']}, "
        f"trivial {rates['b1']} vs {rates['b']}; the one-trip gate (c1) holds "
        f"{rates['c1'] / max(1, rates['b']):.2f}x the two-trip trivial server's (b)"
    )
    print(
        f"per request also: load generator {base.cpu_us_per_request('loadgen'):.0f} µs, "
        f"upstream {base.cpu_us_per_request('upstream'):.0f} µs; "
        f"send lag p99 {max(t.lag_p99_s for t in tallies.values()) * 1000:.2f} ms"
    )


def _print_verdicts(
    tallies: dict[str, Tally], rates: dict[str, int], gate_key: str, trivial_key: str, trips: str
) -> None:
    """Issue 2's targets for the gate in one set-up, against the trivial server in the same one."""
    base, gate, trivial = tallies["a"], tallies[gate_key], tallies[trivial_key]
    added_p50, added_p99 = gate.ms(50) - base.ms(50), gate.ms(99) - base.ms(99)
    ratio = rates[gate_key] / rates[trivial_key] if rates[trivial_key] else math.nan
    cpu_gate, cpu_trivial = gate.cpu_us_per_request("ext_proc"), trivial.cpu_us_per_request("ext_proc")
    print(
        f"{trips} ({gate_key} vs {trivial_key}): gate adds p50 {added_p50:+.2f} ms (target <= "
        f"{TARGET_P50_MS}): {_verdict(added_p50 <= TARGET_P50_MS)}; p99 {added_p99:+.2f} ms "
        f"(target <= {TARGET_P99_MS}): {_verdict(added_p99 <= TARGET_P99_MS)}"
    )
    # What the gate's own work adds on top of the floor the trivial server measures (issue 23's goals).
    over_p50, over_p99 = gate.ms(50) - trivial.ms(50), gate.ms(99) - trivial.ms(99)
    cpu_ratio = cpu_gate / max(1.0, cpu_trivial)
    print(
        f"  over the trivial server: p50 {over_p50:+.2f} ms (goal <= +{OVER_P50_MS}): "
        f"{_verdict(over_p50 <= OVER_P50_MS)}; p99 {over_p99:+.2f} ms (goal <= +{OVER_P99_MS}): "
        f"{_verdict(over_p99 <= OVER_P99_MS)}"
    )
    print(
        f"  max rate gate/trivial {rates[gate_key]}/{rates[trivial_key]} = {ratio:.2f} "
        f"(target >= {TARGET_RATE_RATIO}: {_verdict(ratio >= TARGET_RATE_RATIO)}, goal >= {OVER_RATE_RATIO}: "
        f"{_verdict(ratio >= OVER_RATE_RATIO)}); "
        f"ext_proc CPU per request: gate {cpu_gate:.0f} µs vs trivial {cpu_trivial:.0f} µs "
        f"= {cpu_ratio:.2f}x (goal <= {OVER_CPU_RATIO}x): {_verdict(cpu_ratio <= OVER_CPU_RATIO)}"
    )


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


async def _run(variants: list[Variant], pids: dict[str, int], payload: bytes) -> None:
    tallies = await measure_base_rate(variants, pids, payload)
    rates: dict[str, int] = {}
    for variant in variants:
        base_held = tallies[variant.key].ms(99) < 10
        rates[variant.key], trail = await highest_rate(variant, payload, base_held)
        print(f"  search {variant.key}: {trail}")
    print_report(variants, tallies, rates)


def main() -> None:
    body = chat_body()
    started = time.monotonic()
    version = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, check=True).stdout
    release = version.split("version:")[-1].split("/")[1] if "/" in version else "?"
    print(f"Envoy {release}, {len(body)}-byte chat bodies, open loop, keep-alive, {os.cpu_count()} cores")
    _warn_if_busy()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        with running_stack(Path(tmp)) as (by_key, pids):
            variants = [by_key[key] for key in GATE_VARIANTS]
            for variant in variants:
                check_routing(variant, body)
            print(
                f"gate pid {variants[2].ext_proc_pid}, trivial ext_proc pid {variants[1].ext_proc_pid}",
                flush=True,
            )
            uvloop.run(_run(variants, pids, http_request(PATH, body)))
        # Written by the gate as it exits.
        print(f"the gate's garbage collections while serving (CPU): {gc_summary(Path(tmp) / GC_LOG)}")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        costs = pool.submit(servicer_costs, body).result()
    print(
        "servicer work without gRPC (parse messages, Process, serialize), µs per request: "
        f"two round trips gate {costs['gate']:.0f}, trivial {costs['trivial']:.0f}; "
        f"one round trip gate {costs['gate1']:.0f}, trivial {costs['trivial1']:.0f}"
    )
    print(
        "endpoint picker (FULL_DUPLEX_STREAMED), µs: per request without a response body: picker "
        f"{costs['picker']:.0f}, trivial picker {costs['trivial_picker']:.0f}; per streamed response chunk: "
        f"picker {costs['picker_chunk']:.1f}, trivial picker {costs['trivial_picker_chunk']:.1f} "
        f"= {costs['picker_chunk'] / max(0.01, costs['trivial_picker_chunk']):.2f}x"
    )
    print(f"({time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end)")


def _warn_if_busy() -> None:
    """Before the run, the load average is other processes' (during it, it is also ours)."""
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} before the run")
    if load > BUSY_LOAD:
        print(f"WARNING: load average {load:.2f}: other processes share these cores; figures are inflated")
