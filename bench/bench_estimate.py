"""Token estimation against the exact tokenizers, measured in the same run.

1. Fast-estimate error per tokenizer (sentencepiece v1 and v3, tekken) and per kind of text on the
   held-out corpus, at 4k-32k tokens, against the targets (mean <= 4%, worst <= 15%), and at 200-4k
   tokens; without a tokenizer (the generic calibrations) against each tokenizer family; and how often
   the band misses the exact count of trap texts (blobs, data URLs, emoji, number tables, runs of any
   character, held-out text; pieces of 16 bytes to 46 KB, put together as the property tests do).
   Long texts, read through windows at random places, 100 reads each: how far the estimate moves from
   read to read and whether the band holds the count, on held-out texts and on texts laid out around
   the fixed places the windows had before 2026-12-06 (prose there, costly text between). The trace
   replay's first 1,500 prompts as its gate reads them: exact counts, CPU, error.
2. Class errors in auto mode (fast, exact only near a threshold) on held-out requests whose totals
   sit just under and just over each threshold; and without a tokenizer, requests on the unsafe side.
3. Decision cost in auto mode against always counting exactly, on two request mixes.
4. Event-loop stall while a ~200k-token request is counted exactly: in the estimator's worker
   process, in a thread, and on the loop itself.
5. What the fast estimate's reading costs: a text past FULL_SCAN_BYTES against one 50 times longer
   (constant time), and 600 short messages read as one against read one by one.

Only the estimator's public interface is used for 2 and 3, so the same functions measure an older
kvgate (put its src first on PYTHONPATH) on the same requests.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mistral_common

from kvgate.config import ModelConfig
from kvgate.demo.tokenizer import prompt_blocks, tokenizer_file
from kvgate.demo.trace import read_trace, trace_file
from kvgate.estimate import PromptCosts, build_estimator, calibration, local_estimator
from kvgate.estimate.estimator import Estimator
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.estimate.fast import FastEstimator
from kvgate.estimate.features import FULL_SCAN_BYTES, WINDOW_BYTES, WINDOWS
from kvgate.policy.classify import TokenClass, classify, thresholds
from kvgate.request.shape import Api, RequestShape

HELDOUT = Path(__file__).resolve().parent.parent / "tests" / "corpus" / "heldout"
KINDS = ("english", "code", "chinese", "compact_json", "pretty_json", "tools", "other", "mixed")
DATA = Path(mistral_common.__file__).parent / "data"
TOKENIZERS = {
    "sentencepiece v1": DATA / "tokenizer.model.v1",
    "sentencepiece v3": DATA / "mistral_instruct_tokenizer_240323.model.v3",
    "tekken 240718": DATA / "tekken_240718.json",
}
# The tokenizer of the cost and stall measurements (as before this benchmark covered several).
TOKENIZER = TOKENIZERS["sentencepiece v3"]
MODEL = ModelConfig()
LIMITS = thresholds(MODEL)
TARGET_MEAN = 0.04
TARGET_WORST = 0.15
PIECE_TOKENS = (4500, 9000, 18000, 30000)
MIN_TOKENS, MAX_TOKENS = 4000, 32000
# Short pieces: side by side, at most SHORT_PIECES of each size per kind.
SHORT_PIECE_TOKENS = (300, 1000, 3000)
SHORT_MIN_TOKENS, SHORT_MAX_TOKENS = 200, 4000
SHORT_PIECES = 40
TRAP_TEXTS = 600
# Long held-out texts (past FULL_SCAN_BYTES: read through windows) and how many reads of each.
LONG_CHARS = (120_000, 200_000)
WINDOW_DRAWS = 100
# The trace replay's prompts, with what its scenario (src/kvgate/demo/scenarios/trace.yaml) gives the
# gate: the nodes' tokenizer, interactive_max_tokens and max_total_tokens.
TRACE = "mooncake_conversation_first_half"
TRACE_TOKENIZER = "tekken_240911.json"
TRACE_LIMITS = (4096, 131072)
TRACE_REQUESTS = 1500
CASE_SIZES = (500, 4000, 16000, 32000)
# Where a case's exact total lands relative to a threshold.
OFFSETS = (-0.08, -0.03, -0.01, -0.002, 0.002, 0.01, 0.03, 0.08)
REQUESTS = 160
STALL_TOKENS = 200_000
TICK = 0.0005


@functools.cache
def text(kind: str) -> str:
    return (HELDOUT / f"{kind}.txt").read_text("utf-8")


@functools.cache
def counter_for(path: Path) -> Callable[[str], int]:
    return load_counter(TokenizerFile.open(path)).count


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def _shape(texts: tuple[str, ...], budget: int | None = None) -> RequestShape:
    return RequestShape(Api.CHAT, None, texts, messages=len(texts), output_budget=budget)


def pieces(kind: str, count: Callable[[str], int], short: bool = False) -> Iterator[tuple[str, int]]:
    """Held-out pieces of 4k-32k tokens (cut at the kind's mean characters per token, half overlapping),
    or short ones of 200-4k tokens (side by side), with their exact counts."""
    body = text(kind)
    ratio = len(body) / count(body)
    low, high = (SHORT_MIN_TOKENS, SHORT_MAX_TOKENS) if short else (MIN_TOKENS, MAX_TOKENS)
    for size in SHORT_PIECE_TOKENS if short else PIECE_TOKENS:
        length = round(size * ratio)
        starts = range(0, len(body) - length + 1, length if short else max(length // 2, 1))
        for start in starts[:SHORT_PIECES] if short else starts:
            piece = body[start : start + length]
            exact = count(piece)
            if low <= exact <= high:
                yield piece, exact


def error_table(
    fast: FastEstimator, count: Callable[[str], int], short: bool = False
) -> list[tuple[str, list[float], int, float]]:
    """Per kind: the relative errors, how many exact counts fell outside the band, its mean half-width."""
    rows = []
    for kind in KINDS:
        errors, outside, widths = [], 0, []
        for piece, exact in pieces(kind, count, short):
            band = fast.estimate(piece)
            errors.append((band.tokens - exact) / exact)
            outside += not band.low <= exact <= band.high
            widths.append((band.high - band.low) / 2 / band.tokens)
        rows.append((kind, errors, outside, statistics.mean(widths)))
    return rows


def print_errors(title: str, rows: list[tuple[str, list[float], int, float]], targets: bool) -> None:
    print(title)
    print(f"  {'kind':13} {'pieces':>6} {'mean':>6} {'worst':>6} {'bias':>6} {'band ±':>7} {'outside':>7}")
    everything = []
    for kind, errors, outside, width in rows:
        sizes = [abs(e) for e in errors]
        everything += sizes
        print(
            f"  {kind:13} {len(errors):>6} {statistics.mean(sizes):>6.1%} {max(sizes):>6.1%} "
            f"{statistics.mean(errors):>+6.1%} {width:>7.0%} {outside:>7}"
        )
    print(f"  {'all':13} {len(everything):>6} {statistics.mean(everything):>6.1%} {max(everything):>6.1%}")
    if targets:
        missed = [
            f"{kind} {statistics.mean(map(abs, e)):.1%}/{max(map(abs, e)):.1%}"
            for kind, e, _, _ in rows
            if statistics.mean(map(abs, e)) > TARGET_MEAN or max(map(abs, e)) > TARGET_WORST
        ]
        verdict = "met for every kind" if not missed else "MISSED: " + ", ".join(missed)
        print(f"  target mean <= {TARGET_MEAN:.0%}, worst <= {TARGET_WORST:.0%}: {verdict}")


def fast_errors() -> None:
    generic = FastEstimator(*calibration.generic())
    for name, path in TOKENIZERS.items():
        fast = FastEstimator(calibration.for_tokenizer(TokenizerFile.open(path)))
        rows = error_table(fast, counter_for(path))
        print_errors(f"fast estimate vs exact, {name}, held-out pieces of 4k-32k tokens:", rows, True)
        rows = error_table(fast, counter_for(path), short=True)
        print_errors(f"fast estimate vs exact, {name}, held-out pieces of 200-4k tokens:", rows, False)
    for name in ("sentencepiece v3", "tekken 240718"):
        rows = error_table(generic, counter_for(TOKENIZERS[name]))
        print_errors(f"no tokenizer (generic calibrations) vs exact {name}:", rows, False)


def _trap_blob(size: int) -> str:
    return base64.b64encode(bytes(i * 7 % 251 for i in range(size * 3 // 4))).decode()[:size]


def _trap_table(size: int) -> str:
    row = "  ".join(f"{(i * 7919) % 10**7:>9}" for i in range(8)) + "\n"
    return (row * (size // len(row) + 1))[:size]


def _trap_character(rng: random.Random) -> str:
    """Any character: ASCII (whitespace and controls too), 2-, 3- or 4-byte, as likely as each other."""
    low, high = rng.choice([(0, 0x80), (0x80, 0x800), (0x800, 0x10000), (0x10000, 0x110000)])
    code = rng.randrange(low, high)
    return "\ufffd" if 0xD800 <= code < 0xE000 else chr(code)


def trap_texts(rng: random.Random, count: int) -> Iterator[str]:
    """Texts of 1-5 pieces of 16 bytes to 46 KB (log-uniform): base64, a data URL, emoji, a number
    table, a run of one character, held-out text of a kind (the property tests' traps)."""
    traps: dict[str, Callable[[int], str]] = {
        "base64": _trap_blob,
        "data url": lambda size: "data:image/png;base64," + _trap_blob(size),
        "emoji": lambda size: "".join(chr(0x1F300 + i * 37 % 0x350) for i in range(size // 4)),
        "table": _trap_table,
    }
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 5)):
            size = round(2 ** rng.uniform(4, 15.5))
            choice = rng.choice([*traps, "run", "text"])
            if choice == "run":
                parts.append(_trap_character(rng) * size)
            elif choice == "text":
                start = rng.randrange(100000)
                parts.append(text(rng.choice(KINDS))[start : start + size])
            else:
                parts.append(traps[choice](size))
        yield "".join(parts)


def trap_misses(name: str, fast: FastEstimator, count: Callable[[str], int]) -> None:
    above, below, short, reach = 0, 0, 0, []
    for body in trap_texts(random.Random(5), TRAP_TEXTS):
        exact = count(body)
        band = fast.estimate(body)
        above += exact > band.high
        below += exact < band.low
        short = max(short, exact - band.high)
        reach.append((band.high - exact) / max(exact, 1))
    print(
        f"  {name:40} {TRAP_TEXTS} texts  above the high {above:>3} (by {short:>4} tokens at most)  "
        f"below the low {below:>3}  median high {statistics.median(reach):+.0%} of the count"
    )


def trap_bands() -> None:
    print("band on trap texts (exact counts above the high make a long request look short):")
    for name, path in TOKENIZERS.items():
        trap_misses(
            name, FastEstimator(calibration.for_tokenizer(TokenizerFile.open(path))), counter_for(path)
        )
    generic = FastEstimator(*calibration.generic())
    for name in ("sentencepiece v3", "tekken 240718"):
        trap_misses(f"no tokenizer vs {name}", generic, counter_for(TOKENIZERS[name]))


def cases(count: Callable[[str], int]) -> Iterator[tuple[str, int, tuple[str, ...]]]:
    """Every kind at every size in CASE_SIZES, at three places in its held-out text."""
    for kind in KINDS:
        body = text(kind)
        ratio = len(body) / count(body)
        for size in CASE_SIZES:
            length = round(size * ratio)
            for offset in range(3):
                start = offset * length // 2
                if start + length <= len(body):
                    yield kind, size, (body[start : start + length],)


def class_errors(name: str, estimator: Estimator, truth: Estimator, count: Callable[[str], int]) -> None:
    """Auto-mode classes against exact ones, with budgets that put each total near a threshold."""
    checked = wrong = exact_used = unsafe = 0
    for _, _, texts in cases(count):
        prompt = truth.count_sync(_shape(texts)).prompt_tokens
        budgets = [None] + [round(limit * (1 + o)) - prompt for limit in LIMITS for o in OFFSETS]
        for budget in budgets:
            if budget is not None and budget < 0:
                continue
            shape = _shape(texts, budget)
            auto = estimator.estimate_sync(shape, LIMITS)
            ours = classify(auto.total, MODEL)
            theirs = classify(prompt + truth.output_tokens(shape), MODEL)
            checked += 1
            exact_used += auto.method == "exact"
            wrong += ours is not theirs
            unsafe += (ours is TokenClass.INTERACTIVE and theirs is not TokenClass.INTERACTIVE) or (
                ours is TokenClass.TOO_LONG and theirs is not TokenClass.TOO_LONG
            )
    print(
        f"  {name:40} {checked:>5} requests  class errors {wrong:>4}  unsafe {unsafe:>3}  "
        f"exact counts {exact_used / checked:>4.0%}"
    )


def class_errors_all() -> None:
    print("class decisions near the thresholds (held-out requests, totals within 8% of each threshold):")
    for name, path in TOKENIZERS.items():
        estimator = local_estimator(path, PromptCosts())
        class_errors(f"auto mode, {name}", estimator, estimator, counter_for(path))
    generic = local_estimator(None, PromptCosts())
    for name in ("sentencepiece v3", "tekken 240718"):
        path = TOKENIZERS[name]
        class_errors(
            f"no tokenizer, truth {name}", generic, local_estimator(path, PromptCosts()), counter_for(path)
        )


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
    """The field report's traffic: mostly 500-1,000-token chats, a few long documents, every kind."""
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


def decision_cost(name: str, estimator: Estimator, shapes: list[RequestShape]) -> float:
    """Prints and returns auto mode's mean CPU seconds per decision (the thread's CPU time: the exact
    counts run in the calling thread here)."""
    auto_costs, exact_costs = [], []
    exact_used = wrong = 0
    for shape in shapes:
        started = time.thread_time()
        auto = estimator.estimate_sync(shape, LIMITS)
        auto_costs.append(time.thread_time() - started)
        started = time.thread_time()
        exact = estimator.count_sync(shape)
        exact_costs.append(time.thread_time() - started)
        exact_used += auto.method == "exact"
        wrong += classify(auto.total, MODEL) is not classify(exact.total, MODEL)
    auto_costs.sort()
    p50 = auto_costs[len(auto_costs) // 2]
    p99 = auto_costs[min(len(auto_costs) - 1, round(len(auto_costs) * 0.99))]
    mean_auto, mean_exact = statistics.mean(auto_costs), statistics.mean(exact_costs)
    print(
        f"decision CPU, {name} ({len(shapes)} requests; exact counts in {exact_used}, class errors {wrong}):"
    )
    print(f"  auto mode    mean {_ms(mean_auto)}  p50 {_ms(p50)}  p99 {_ms(p99)}")
    print(f"  always exact mean {_ms(mean_exact)}  p50 {_ms(statistics.median(exact_costs))}")
    print(f"  auto / always-exact (mean): {mean_auto / mean_exact:.1%}")
    return mean_auto


def costs(tokenizer: Path = TOKENIZER) -> None:
    estimator = local_estimator(tokenizer, PromptCosts())
    for shape in field_mix(random.Random(1))[:40]:  # warm caches and the tokenizer
        estimator.estimate_sync(shape, LIMITS)
    decision_cost(
        f"spread mix, 300 to 48k tokens, {tokenizer.name}", estimator, spread_mix(random.Random(11))
    )
    decision_cost(f"field mix, 80% short chats, {tokenizer.name}", estimator, field_mix(random.Random(12)))


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


def event_loop_stall() -> None:
    body = text("english")
    shape = _shape((body * math.ceil(STALL_TOKENS / counter_for(TOKENIZER)(body)),), 1000)
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


def _median_s(call: Callable[[], object], runs: int = 50) -> float:
    call()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def fast_read_costs() -> None:
    fast = FastEstimator(calibration.for_tokenizer(TokenizerFile.open(TOKENIZER)))
    body = text("english")
    small = body[: FULL_SCAN_BYTES * 2]
    big = small * 50
    messages = [body[i : i + 300] for i in range(0, 300 * 600, 300)]
    small_s, big_s = _median_s(lambda: fast.estimate(small)), _median_s(lambda: fast.estimate(big))
    joined_s = _median_s(lambda: fast.estimate_all(messages))
    apart_s = _median_s(lambda: [fast.estimate(m) for m in messages], runs=10)
    print("fast estimate, reading cost (median of 50 runs):")
    print(
        f"  a {len(small.encode()) // 1024} KiB text {_ms(small_s)}; 50 times longer {_ms(big_s)} "
        f"(x{big_s / small_s:.1f}: the same windows are read past {FULL_SCAN_BYTES // 1024} KiB)"
    )
    print(
        f"  600 messages of 300 characters as one read {_ms(joined_s)}; read one by one {_ms(apart_s)} "
        f"(x{apart_s / joined_s:.0f})"
    )


def _laid_out(length: int, place: str, rest: str) -> str:
    """`rest` repeated to `length` characters, with `place` where the windows sat before 2026-12-06
    (WINDOWS places evenly spaced from the first character to the last)."""
    chars = list((rest * (length // len(rest) + 1))[:length])
    step = (length - WINDOW_BYTES) / (WINDOWS - 1)
    for i in range(WINDOWS):
        start = round(i * step)
        chars[start : start + WINDOW_BYTES] = (place * WINDOW_BYTES)[:WINDOW_BYTES]
    return "".join(chars)


def laid_out_texts() -> dict[str, str]:
    """Held-out English at the fixed places and costly text between: random characters (ASCII, read
    through byte windows) and CJK (read through character windows). The tests read them too."""
    rng = random.Random(1)
    scattered = "".join(chr(rng.randrange(33, 127)) if i % 7 else " " for i in range(5003))
    prose = text("english")[:WINDOW_BYTES]
    return {
        "random chars, English at 32 places": _laid_out(120_000, prose, scattered),
        "CJK, English at 32 places": _laid_out(40_000, prose, "中文字"),
    }


def window_draws() -> None:
    """How a long text's estimate moves from one read to the next (each draws its windows afresh),
    and whether its band holds the count: held-out texts, and texts laid out around fixed windows."""
    fast = FastEstimator(calibration.for_tokenizer(TokenizerFile.open(TOKENIZER)))
    count = counter_for(TOKENIZER)
    print(f"long texts read through windows, {WINDOW_DRAWS} reads each (sentencepiece v3):")
    print(f"  {'text':34} {'exact':>7} {'mean':>6} {'sd':>5} {'band ±':>7} {'outside':>7}")
    bodies = [
        (f"{kind} {size // 1000}k chars", (text(kind) * 5)[:size]) for kind in KINDS for size in LONG_CHARS
    ]
    bodies += laid_out_texts().items()
    for name, body in bodies:
        exact = count(body)
        bands = [fast.estimate(body) for _ in range(WINDOW_DRAWS)]
        errors = [(band.tokens - exact) / exact for band in bands]
        outside = sum(not band.low <= exact <= band.high for band in bands)
        width = statistics.mean((band.high - band.low) / 2 / exact for band in bands)
        print(
            f"  {name:34} {exact:>7} {statistics.mean(errors):>+6.1%} {statistics.pstdev(errors):>5.1%} "
            f"{width:>7.0%} {outside:>7}"
        )


def trace_prompts() -> None:
    """The Mooncake replay's first prompts as the gate of `kvgate demo --trace` reads them (its
    tokenizer, its thresholds): how many are read through windows, how many counted exactly, the
    CPU a request and the fast estimate's error."""
    requests = read_trace(trace_file(TRACE))[:TRACE_REQUESTS]
    blocks = prompt_blocks(TRACE_TOKENIZER)
    estimator = local_estimator(tokenizer_file(TRACE_TOKENIZER), PromptCosts())
    sampled = exact = 0
    errors, cpu_s = [], 0.0
    for request in requests:
        prompt = blocks.prompt(request.hash_ids, request.input_tokens)
        sampled += len(prompt) > FULL_SCAN_BYTES
        shape = _shape((prompt,), request.output_tokens)
        started = time.process_time()
        estimate = estimator.estimate_sync(shape, TRACE_LIMITS)
        cpu_s += time.process_time() - started
        exact += estimate.method == "exact"
        if estimate.method == "fast":
            errors.append(estimate.prompt_tokens / request.input_tokens - 1)
    print(
        f"{TRACE} prompts ({TRACE_TOKENIZER}, thresholds {TRACE_LIMITS}): {len(requests)} requests, "
        f"{sampled} read through windows, {exact} counted exactly, {_ms(cpu_s / len(requests))} a request; "
        f"fast error mean {statistics.mean(errors):+.1%}, sd {statistics.pstdev(errors):.1%}"
    )


def main() -> None:
    print(f"thresholds {LIMITS}; default output budget {MODEL.default_output_tokens}")
    fast_read_costs()
    fast_errors()
    window_draws()
    trace_prompts()
    trap_bands()
    class_errors_all()
    for path in (TOKENIZER, TOKENIZERS["tekken 240718"]):
        costs(path)
    event_loop_stall()


if __name__ == "__main__":
    main()
