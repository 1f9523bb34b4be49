"""Cutting a long prompt into its prefix chain (placement.prefix_affinity), timed in this process.

The gate cuts every long prompt it places with prefix affinity (kvgate.request.prefix): blocks of 256
tokens' worth of bytes, each hash chained on the one before. Baseline, measured in the same run: one
blake2b over the same bytes, the least any chain over them costs. Target: well under a millisecond
for a 32k-token prompt (the figure a test once held to 2 ms of wall clock).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from collections.abc import Callable

from kvgate.request.prefix import prefix_chain
from kvgate.sim.tokens import make_prompt

BLOCK_TOKENS = 256
MAX_BLOCKS = 1024
REPEATS = 200


def _times(call: Callable[[], object]) -> list[float]:
    call()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)


def main() -> None:
    print(f"bench_prefix (blocks of {BLOCK_TOKENS} tokens, at most {MAX_BLOCKS}; {REPEATS} runs each)")
    for tokens in (8_000, 32_000, 128_000):
        texts = [make_prompt(tokens, random.Random(tokens))]
        cut = _times(lambda texts=texts, tokens=tokens: prefix_chain(texts, tokens, BLOCK_TOKENS, MAX_BLOCKS))
        data = texts[0].encode()
        whole = _times(lambda data=data: hashlib.blake2b(data, digest_size=8).digest())
        p50, p99 = statistics.median(cut), cut[min(len(cut) - 1, round(len(cut) * 0.99))]
        once = statistics.median(whole)
        print(
            f"  {tokens:>7,} tokens ({len(data) // 1024} KiB): chain p50 {p50 * 1000:.3f} ms, "
            f"p99 {p99 * 1000:.3f} ms; one hash of the bytes p50 {once * 1000:.3f} ms (x{p50 / once:.1f})"
        )


if __name__ == "__main__":
    main()
