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
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from bench.bench_gate import Servicer, chat_body, envoy_messages, gate_config_text, gate_servicer

CALLS = 300
EVICT_BYTES = 32 * 1024 * 1024


async def _median_us(stage: Callable[[], Awaitable[object]], evict: np.ndarray | None) -> float:
    """The median µs of CALLS awaits of `stage`, each after a write over `evict` when one is given."""
    times = []
    for _ in range(CALLS):
        if evict is not None:
            evict += 1
        started = time.perf_counter()
        await stage()
        times.append(time.perf_counter() - started)
    times.sort()
    return times[CALLS // 2] * 1e6


def _awaitable(call: Callable[[], object]) -> Callable[[], Awaitable[object]]:
    async def stage() -> object:
        return call()

    return stage


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
        priority = config.admission.priority_header
        head = head_from_attributes(message, priority)
        assert head is not None and head.api is not None
        api = head.api
        shape = parse_body(api, body)
        model = config.default_model
        estimator = pipeline._estimators[model]
        estimate = estimator.estimate_sync(shape, thresholds(model))
        route = decide(estimate.prompt_tokens, estimate.output_tokens, model)
        extra: dict[str, str | float] = {"method": "fast", "prompt_tokens": estimate.prompt_tokens}
        identity = responses.Identity(head.tenant, pipeline.priority(head), priority)

        def through(server: Servicer) -> Callable[[], Awaitable[object]]:
            async def stream() -> AsyncIterator[ProcessingRequest]:
                yield ProcessingRequest.FromString(raw)

            async def stage() -> None:
                async for response in server.Process(stream(), None):
                    response.SerializeToString()

            return stage

        calls: list[tuple[str, Callable[[], object]]] = [
            ("parse the gRPC message", lambda: ProcessingRequest.FromString(raw)),
            ("the request head from its attributes", lambda: head_from_attributes(message, priority)),
            ("parse the body (msgspec, typed)", lambda: parse_body(api, body)),
            ("fast estimate and band", lambda: estimator.fast_band(shape)),
            ("decision", lambda: decide(estimate.prompt_tokens, estimate.output_tokens, model)),
            (
                "the answer (route, metadata)",
                lambda: responses.route_after_body(route, [], extra, "kvgate", identity=identity),
            ),
        ]
        stages = [(name, _awaitable(call)) for name, call in calls]
        stages += [("the gate's whole Process", through(gate))]
        stages += [("the trivial server's whole Process", through(TrivialProcessor()))]
        evict = np.zeros(EVICT_BYTES, dtype=np.uint8)

        async def measure() -> list[tuple[str, float, float]]:
            return [
                (name, await _median_us(stage, None), await _median_us(stage, evict))
                for name, stage in stages
            ]

        return loop.run_until_complete(measure())
    finally:
        loop.close()
        pipeline.close()


def main() -> None:
    with ProcessPoolExecutor(max_workers=1) as pool:
        costs = pool.submit(stage_costs).result()
    print(f"one 2 KB chat, one trip, median of {CALLS} calls, µs: warm caches / cold caches")
    for name, warm, cold in costs:
        print(f"  {name:<38}{warm:8.1f}{cold:9.1f}")
