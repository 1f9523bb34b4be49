"""Serving the gate: the grpc.aio server, its health service, worker processes and graceful drain."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import signal
import time
from collections.abc import Callable

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvgate.allocator import keep_big_buffers
from kvgate.config import Config
from kvgate.config.headroom import HeadroomSettings
from kvgate.gate.admission import Admission, HeadroomSource
from kvgate.gate.loop_lag import PROBES_PER_LIMIT, LoopLag
from kvgate.gate.picker import EndpointPicker
from kvgate.gate.pipeline import Pipeline, estimator_factory
from kvgate.gate.processor import ExternalProcessor
from kvgate.gate.soft_pool import SoftPool
from kvgate.headroom.credentials import ChannelSecurity, add_port
from kvgate.headroom.view import HeadroomView
from kvgate.telemetry import (
    ESTIMATE_CORRECTION,
    EVENT_LOOP_LAG,
    EXACT_COUNTS_PENDING,
    DecisionSpans,
    GateMetrics,
    observe,
    observe_admission,
    start_otlp,
    start_prometheus,
)
from kvgate.tls import describe

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The server as a whole, ext_proc, and the two an endpoint picker's gateway and Kubernetes probes ask
# for (gateway-api-inference-extension docs/proposals/004-endpoint-picker-protocol, "Health").
HEALTH_SERVICES = ("", EXT_PROC_SERVICE, "liveness", "readiness")
_RESTART_BACKOFF_S = 1.0


def _grpc_options(config: Config) -> list[tuple[str, int]]:
    limit = config.server.max_message_bytes
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # Several worker processes share one port; a lone worker must not silently share it.
        ("grpc.so_reuseport", 1 if config.server.workers > 1 else 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ]


async def serve(
    config: Config,
    metrics_listen: str | None = None,
    otlp_endpoint: str | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), then drain in-flight streams for drain_seconds."""
    # Handlers first: a SIGTERM that arrives as soon as the port opens still drains cleanly.
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    start_prometheus(metrics_listen)
    start_otlp(otlp_endpoint, "kvgate-gate")
    telemetry = GateMetrics()
    long_view, interactive_view = _view(config, config.headroom), _view(config, config.interactive_headroom)
    views = [view for view in (long_view, interactive_view) if view is not None]
    long = _long_source(config, long_view, interactive_view)
    lag = LoopLag(config.admission.max_loop_lag_s / PROBES_PER_LIMIT)
    probing = asyncio.create_task(lag.run(), name="kvgate-loop-lag")
    observe(
        telemetry.meter,
        EVENT_LOOP_LAG,
        "s",
        "How late the gate's event loop runs its work: past admission.max_loop_lag_s long requests are "
        "answered at once (503 gateway_overloaded, or the async pool)",
        lambda: [(lag.current_s(), {})],
    )
    admission = (
        Admission(
            config.admission,
            long,
            interactive_view,
            telemetry,
            lease_s=_lease_s(config),
            loop_lag=lag.current_s,
            fairness=config.fairness,
            reports_first_token=config.server.protocol == "endpoint-picker",
            picker_endpoints=config.server.picker_endpoints,
        )
        if views
        else None
    )
    for view in views:
        await view.start()
    if admission is not None:
        observe_admission(telemetry.meter, admission.gauges)
        await admission.start()
    pipeline = Pipeline(config, estimator_factory(), admission, telemetry=telemetry)
    observe(
        telemetry.meter,
        EXACT_COUNTS_PENDING,
        "{request}",
        "Exact token counts waiting or running",
        lambda: [(pipeline.exact_counts_pending(), {})],
    )
    observe(
        telemetry.meter,
        ESTIMATE_CORRECTION,
        "1",
        "What the fast token estimate is multiplied by, learnt from the exact counts of this traffic",
        pipeline.estimate_corrections,
    )
    server = grpc.aio.server(options=_grpc_options(config))
    speaks = EndpointPicker if config.server.protocol == "endpoint-picker" else ExternalProcessor
    processor = speaks(pipeline, config, telemetry, DecisionSpans())
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    add_port(server, config.server.listen, "server.listen", config.tls.server, "tls.server")
    await server.start()
    for service in HEALTH_SERVICES:
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    freeze_startup_heap()
    log.info(
        "gate listening on %s (%s, config %s)",
        config.server.listen,
        describe(config.tls.server),
        config.source,
    )

    await stop.wait()
    log.info("draining for up to %.0f s", config.server.drain_seconds)
    await health.enter_graceful_shutdown()
    await server.stop(grace=config.server.drain_seconds)
    await processor.drain_agent_calls()
    if admission is not None:
        await admission.stop()
    for view in views:
        await view.stop()
    probing.cancel()
    pipeline.close()
    log.info("gate stopped")


def freeze_startup_heap() -> None:
    """Keep the objects of start-up (modules, protobuf classes, tokenizer and estimator tables, metric
    instruments: some 50,000) out of every later garbage collection.

    grpc.aio leaves a few objects per stream in reference cycles, so the collector runs every twenty
    or so requests, and every 15-25 s at 400 req/s a full collection. Over the whole start-up heap a
    full collection held the event loop for 40-46 ms of CPU (measured with gc.callbacks in the gate
    under `bench gate`'s load): every request that arrived meanwhile waited, the p99 tail over the
    trivial server, which has a small heap. Frozen, a full collection took 1-2 ms.
    """
    gc.collect()
    gc.freeze()


def _view(config: Config, settings: HeadroomSettings) -> HeadroomView | None:
    """The view of one pool's agents; None when none are configured (then long requests of that
    pool go unchecked)."""
    if not settings.agents and not settings.dns:
        return None
    agents_tls = config.tls.agents
    # One each: a ChannelSecurity reports a file change once, to the view that reconnects.
    return HeadroomView(settings, security=ChannelSecurity(agents_tls) if agents_tls.enabled else None)


def _long_source(
    config: Config, long: HeadroomView | None, interactive: HeadroomView | None
) -> HeadroomSource | None:
    """Where long requests reserve: the long pool's agents, then, with soft_pools.borrow, the
    interactive pool's agents that lend (kvgate.gate.soft_pool)."""
    if long is None or interactive is None or not config.soft_pools.borrow:
        return long
    return SoftPool(long, interactive)


def _lease_s(config: Config) -> float:
    """The shortest lease of the pools a long request may reserve in: renewals keep pace with it."""
    if config.soft_pools.borrow:
        return min(config.headroom.lease_s, config.interactive_headroom.lease_s)
    return config.headroom.lease_s


def run_worker(config: Config, metrics_listen: str | None, otlp_endpoint: str | None) -> None:
    keep_big_buffers()
    uvloop.run(serve(config, metrics_listen, otlp_endpoint))


def run_gate(config: Config, metrics_listen: str | None, otlp_endpoint: str | None = None) -> int:
    """Run one worker in this process, or supervise `workers` processes sharing the port.

    Worker i serves its metrics on the metrics port + i (Prometheus scrapes each worker).
    """
    config.tls.check_files()
    if config.server.workers == 1:
        run_worker(config, metrics_listen, otlp_endpoint)
        return 0
    # Load every tokenizer once here so a bad path fails the command, not each worker in a restart loop.
    Pipeline(config, estimator_factory()).close()
    spawn_index = itertools.count()

    def spawn() -> multiprocessing.process.BaseProcess:
        index = next(spawn_index) % config.server.workers
        return _spawn(config, _worker_metrics(metrics_listen, index), otlp_endpoint)

    return _supervise(
        spawn,
        config.server.workers,
        config.server.drain_seconds,
    )


def _worker_metrics(listen: str | None, index: int) -> str | None:
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    return f"{host}:{int(port) + index}"


def _spawn(
    config: Config, metrics_listen: str | None, otlp_endpoint: str | None
) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(
        target=run_worker, args=(config, metrics_listen, otlp_endpoint), name="kvgate-gate-worker"
    )
    process.start()
    return process


def _supervise(
    spawn: Callable[[], multiprocessing.process.BaseProcess], count: int, drain_seconds: float
) -> int:
    """Keep `count` workers alive; on SIGTERM pass it on and wait for their drain."""
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    workers = [spawn() for _ in range(count)]
    while not stopping:
        time.sleep(0.2)
        for i, worker in enumerate(workers):
            if not worker.is_alive() and not stopping:
                log.error("gate worker %s exited with %s; restarting", worker.pid, worker.exitcode)
                time.sleep(_RESTART_BACKOFF_S)
                workers[i] = spawn()
    for worker in workers:
        if worker.is_alive() and worker.pid is not None:
            worker.terminate()
    deadline = time.monotonic() + drain_seconds + 5
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
    return 0
