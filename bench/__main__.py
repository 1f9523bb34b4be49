"""Run the benchmarks: every bench/bench_*.py module's main() in name order, or only those named.

    python -m bench              all of them but the long ones (soak: 10 minutes; fairness_vllm: real
                                 engines, about 25 minutes)
    python -m bench gate         bench/bench_gate.py only
    python -m bench soak         the soak run

A benchmark that fails prints its error; the others still run, and the exit status is non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREFIX = "bench_"
# Run only when named: too long for `make bench`.
ON_REQUEST = frozenset({"soak", "fairness_vllm"})


def available() -> list[str]:
    return sorted(path.stem.removeprefix(PREFIX) for path in HERE.glob(f"{PREFIX}*.py"))


def run_one(name: str) -> bool:
    print(f"=== {name} " + "=" * max(0, 66 - len(name)), flush=True)
    started = time.monotonic()
    try:
        module = importlib.import_module(f"bench.{PREFIX}{name}")
        module.main()
    except Exception:  # one broken benchmark must not hide the others' figures
        traceback.print_exc(file=sys.stdout)
        print(f"--- {name}: FAILED after {time.monotonic() - started:.1f} s", flush=True)
        return False
    print(f"--- {name}: {time.monotonic() - started:.1f} s", flush=True)
    return True


def main() -> int:
    names = available()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benchmarks to run (of: {', '.join(names)})"
    )
    chosen = parser.parse_args().names or [name for name in names if name not in ON_REQUEST]
    unknown = [name for name in chosen if name not in names]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(names)}")
    results = [run_one(name) for name in chosen]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
