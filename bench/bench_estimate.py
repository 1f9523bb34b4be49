"""Token estimation against the exact tokenizer, measured in the same run.

1. Fast-estimate error per text kind on the held-out corpus (bytes/4 alongside, the common default).
2. Decision cost in auto mode (fast, exact only near a threshold, counting stopped once certain)
   against always counting exactly, on two request mixes.
3. Event-loop stall while a ~200k-token request is counted exactly: in the estimator's worker
   process, in a thread, and on the loop itself.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mistral_common

from kvgate.config import ModelConfig
from kvgate.estimate import PromptCosts, build_estimator, calibration, local_estimator
from kvgate.estimate.estimator import Estimator
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.estimate.fast import FastEstimator
from kvgate.policy.classify import classify, thresholds
from kvgate.request.shape import Api, RequestShape

HELDOUT = Path(__file__).resolve().parent.parent / "tests" / "corpus" / "heldout"
KINDS = ("english", "code", "chinese", "json", "other")
TOKENIZER = Path(mistral_common.__file__).parent / "data" / "mistral_instruct_tokenizer_240323.model.v3"
MODEL = ModelConfig()
LIMITS = thresholds(MODEL)
REQUESTS = 160
STALL_TOKENS = 200_000
TICK = 0.0005


@functools.cache
def text(kind: str) -> str:
    return (HELDOUT / f"{kind}.txt").read_text("utf-8")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def _shape(texts: tuple[str, ...], budget: int | None = None) -> RequestShape:
    return RequestShape(Api.CHAT, None, texts, messages=len(texts), output_budget=budget)


def error_per_kind(estimator: Estimator, count: Callable[[str], int]) -> None:
    print("fast estimate error vs exact, held-out corpus (pieces of >= 4k tokens):")
    print(f"  {'kind':10} {'pieces':>6} {'mean':>7} {'worst':>7}   {'bytes/4 mean':>12} {'worst':>7}")
    overall = []
    for kind in KINDS:
        body = text(kind)
        ratio = len(body) / count(body)
        errors, naive = [], []
        for size in (4000, 8000, 16000, 32000):
            length = round(size * ratio)
            for start in range(0, len(body) - length + 1, max(length // 2, 1)):
                piece = body[start : start + length]
                exact = count(piece)
                errors.append(abs(estimator.fast_band(_shape((piece,))).tokens - exact) / exact)
                naive.append(abs(len(piece.encode()) / 4 - exact) / exact)
        overall += errors
        print(
            f"  {kind:10} {len(errors):>6} {statistics.mean(errors):>7.1%} {max(errors):>7.1%}"
            f"   {statistics.mean(naive):>12.1%} {max(naive):>7.1%}"
        )
    print(f"  {'all':10} {len(overall):>6} {statistics.mean(overall):>7.1%} {max(overall):>7.1%}")


def spread_mix(rng: random.Random) -> list[RequestShape]:
    """Sizes log-uniform from 300 to 48k tokens, every kind: many land near a threshold."""
    shapes = []
    for _ in range(REQUESTS):
        kind = rng.choice(KINDS)
        chars = round(math.exp(rng.uniform(math.log(300), math.log(48000))) * 3.2)
        body = text(kind)
        start = rng.randrange(0, max(1, len(body) - chars))
        shapes.append(_shape((body[start : start + chars],), rng.choice([None, 256, 2048])))
    return shapes


def field_mix(rng: random.Random) -> list[RequestShape]:
    """The field report's traffic: mostly 500-1,000-token chats, a few long documents."""
    shapes = []
    for _ in range(REQUESTS):
        draw = rng.random()
        tokens = (
            rng.uniform(500, 1000)
            if draw < 0.8
            else rng.uniform(2000, 8000)
            if draw < 0.9
            else rng.uniform(8000, 40000)
        )
        kind = rng.choice(KINDS)
        body = text(kind)
        chars = round(tokens * 3.2)
        start = rng.randrange(0, max(1, len(body) - chars))
        shapes.append(_shape((body[start : start + chars],), rng.choice([None, 512])))
    return shapes


def decision_cost(name: str, estimator: Estimator, shapes: list[RequestShape]) -> None:
    auto_costs, exact_costs = [], []
    exact_used = wrong = 0
    for shape in shapes:
        started = time.perf_counter()
        auto = estimator.estimate_sync(shape, LIMITS)
        auto_costs.append(time.perf_counter() - started)
        started = time.perf_counter()
        exact = estimator.count_sync(shape)
        exact_costs.append(time.perf_counter() - started)
        exact_used += auto.method == "exact"
        wrong += classify(auto.total, MODEL) is not classify(exact.total, MODEL)
    auto_costs.sort()
    p50 = auto_costs[len(auto_costs) // 2]
    p99 = auto_costs[min(len(auto_costs) - 1, round(len(auto_costs) * 0.99))]
    mean_auto, mean_exact = statistics.mean(auto_costs), statistics.mean(exact_costs)
    print(
        f"decision cost, {name} ({len(shapes)} requests; exact counts in {exact_used}, class errors {wrong}):"
    )
    print(f"  auto mode    mean {_ms(mean_auto)}  p50 {_ms(p50)}  p99 {_ms(p99)}")
    print(f"  always exact mean {_ms(mean_exact)}  p50 {_ms(statistics.median(exact_costs))}")
    print(f"  auto / always-exact (mean): {mean_auto / mean_exact:.1%}")


async def _gaps(task: asyncio.Future[object]) -> list[float]:
    """How late each 0.5 ms tick of the loop came while `task` ran."""
    gaps = []
    last = time.perf_counter()
    while not task.done():
        await asyncio.sleep(TICK)
        now = time.perf_counter()
        gaps.append(max(0.0, now - last - TICK))
        last = now
    return sorted(gaps)


def _stall_line(name: str, gaps: list[float], took: float) -> str:
    p99 = gaps[min(len(gaps) - 1, round(len(gaps) * 0.99))]
    return f"  {name:15} worst stall {_ms(gaps[-1])}  p99 {_ms(p99)}  ({took * 1000:.0f} ms)"


def event_loop_stall(count: Callable[[str], int]) -> None:
    body = text("english")
    shape = _shape((body * math.ceil(STALL_TOKENS / count(body)),), 1000)
    tokenizer = TokenizerFile.open(TOKENIZER)
    fast = FastEstimator(calibration.for_tokenizer(tokenizer))
    process = build_estimator(TOKENIZER, PromptCosts())
    threaded = Estimator(fast, tokenizer, PromptCosts(), ThreadPoolExecutor(1))
    total = process.count_sync(shape).total
    print(f"event-loop stall while a {total - 1000:,}-token prompt is counted exactly (limit at its total):")

    async def stall(estimator: Estimator | None) -> tuple[list[float], float]:
        if estimator is not None:
            await estimator.estimate(_shape((body[:60000],), 1000), LIMITS)  # warm the worker
        started = time.perf_counter()
        work = estimator.estimate(shape, (total - 1,)) if estimator else asyncio.sleep(0.4)
        task: asyncio.Future[object] = asyncio.ensure_future(work)
        gaps = await _gaps(task)
        await task
        return gaps, time.perf_counter() - started

    try:
        # The same ticker with nothing to count: what this machine's scheduling alone costs.
        for name, estimator in (
            ("idle loop", None),
            ("worker process", process),
            ("worker thread", threaded),
        ):
            gaps, took = asyncio.run(stall(estimator))
            print(_stall_line(name, gaps, took))
        started = time.perf_counter()
        process.estimate_sync(shape, (total - 1,))
        print(f"  {'on the loop':15} worst stall {_ms(time.perf_counter() - started)}")
    finally:
        process.close()
        threaded.close()


def main() -> None:
    counter = load_counter(TokenizerFile.open(TOKENIZER))
    estimator = local_estimator(TOKENIZER, PromptCosts())
    budget = MODEL.default_output_tokens
    print(f"tokenizer: {TOKENIZER.name}; thresholds {LIMITS}; default output budget {budget}")
    error_per_kind(estimator, counter.count)
    decision_cost("spread mix, 300 to 48k tokens", estimator, spread_mix(random.Random(11)))
    decision_cost("field mix, 80% short chats", estimator, field_mix(random.Random(12)))
    event_loop_stall(counter.count)


if __name__ == "__main__":
    main()
