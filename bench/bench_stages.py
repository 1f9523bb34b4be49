"""Each stage of the gate's work on one 2 KB chat, with warm caches and with cold ones.

Through Envoy at 400 req/s the gate shares two cores with Envoy, the load generator and the upstream,
which evict its caches between requests: the same work then costs several times what a loop of it
costs (the servicer's `Process`, about 120 µs warm, is some 300 µs of the gate's CPU per request
under load). Here every stage runs 300 times alone, and again with a 32 MiB write between calls,
which leaves nothing of the stage in the caches; the median of each is printed, beside the trivial
server's whole Process. In a child process (the gate's metrics set process-wide state). About 30 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from bench.bench_gate import Servicer, chat_body, envoy_messages, gate_config_text, gate_servicer

CALLS = 300
EVICT_BYTES = 32 * 1024 * 1024


def _median_us(stage: Callable[[], object], evict: np.ndarray | None) -> float:
    times = []
    for _ in range(CALLS):
        if evict is not None:
            evict += 1
        started = time.perf_counter()
        stage()
        times.append(time.perf_counter() - started)
    times.sort()
    return times[CALLS // 2] * 1e6


def stage_costs() -> list[tuple[str, float, float]]:
    from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

    from bench.trivial_extproc import TrivialProcessor
    from kvgate.config import parse_config
    from kvgate.gate import responses
    from kvgate.gate.pipeline import Pipeline, estimator_factory
    from kvgate.gate.processor import head_from_attributes
    from kvgate.policy import decide, thresholds
    from kvgate.request import parse_body

    config = parse_config(gate_config_text())
    pipeline = Pipeline(config, estimator_factory())
    loop = asyncio.new_event_loop()
    try:
        gate = gate_servicer(config, pipeline)
        body = chat_body()
        raw = envoy_messages(body, 1)[0]
        message = ProcessingRequest.FromString(raw)
        head = head_from_attributes(message, config.admission.priority_header)
        assert head is not None and head.api is not None
        api = head.api
        shape = parse_body(api, body)
        model = config.default_model
        estimator = pipeline._estimators[model]
        estimate = estimator.estimate_sync(shape, thresholds(model))
        route = decide(estimate.prompt_tokens, estimate.output_tokens, model)
        extra: dict[str, str | float] = {"method": "fast", "prompt_tokens": estimate.prompt_tokens}

        def through(server: Servicer, evict: np.ndarray | None) -> float:
            """The median µs of a whole Process, timed inside the event loop."""

            async def stream() -> AsyncIterator[ProcessingRequest]:
                yield ProcessingRequest.FromString(raw)

            async def timed() -> float:
                times = []
                for _ in range(CALLS):
                    if evict is not None:
                        evict[:] += 1
                    started = time.perf_counter()
                    async for response in server.Process(stream(), None):
                        response.SerializeToString()
                    times.append(time.perf_counter() - started)
                times.sort()
                return times[CALLS // 2] * 1e6

            return loop.run_until_complete(timed())

        stages: list[tuple[str, Callable[[], object]]] = [
            ("parse the gRPC message", lambda: ProcessingRequest.FromString(raw)),
            ("the request head from its attributes", lambda: head_from_attributes(message, "x-priority")),
            ("parse the body (msgspec, typed)", lambda: parse_body(api, body)),
            ("fast estimate and band", lambda: estimator.fast_band(shape)),
            ("decision", lambda: decide(estimate.prompt_tokens, estimate.output_tokens, model)),
            ("the answer (route, metadata)", lambda: responses.route_after_body(route, [], extra, "kvgate")),
        ]
        costs = []
        evict = np.zeros(EVICT_BYTES, dtype=np.uint8)
        for name, stage in stages:
            costs.append((name, _median_us(stage, None), _median_us(stage, evict)))
        servers: list[tuple[str, Servicer]] = [("gate", gate), ("trivial server", TrivialProcessor())]
        for name, server in servers:
            costs.append((f"the {name}'s whole Process", through(server, None), through(server, evict)))
        return costs
    finally:
        loop.close()
        pipeline.close()


def main() -> None:
    with ProcessPoolExecutor(max_workers=1) as pool:
        costs = pool.submit(stage_costs).result()
    print(f"one 2 KB chat, one trip, median of {CALLS} calls, µs: warm caches / cold caches")
    for name, warm, cold in costs:
        print(f"  {name:<38}{warm:8.1f}{cold:9.1f}")
