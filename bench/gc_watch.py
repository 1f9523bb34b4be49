"""Run `kvgate ARGS` with every garbage collection timed, for the benchmarks.

    python -m bench.gc_watch OUT.json gate --config ...

A gc.callbacks hook takes the thread CPU time of each collection (the event loop's thread: the loop
waits for it) once the gate has frozen its start-up heap, that is once it serves; at exit OUT.json
holds, per generation, the collections' count and CPU seconds. `bench gate` prints them: a full
collection over the whole start-up heap was the gate's p99 tail (docs/benchmarks.md).
"""

from __future__ import annotations

import atexit
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvgate.cli import main as kvgate_main
from kvgate.gate import server
from kvgate.gate.server import freeze_startup_heap as freeze

_started = [0.0]
_serving = [False]
_seconds: dict[int, list[float]] = {0: [], 1: [], 2: []}


def _timed(phase: str, info: dict[str, Any]) -> None:
    # Nothing costly here: gc.get_freeze_count() walks the frozen heap (5 ms for the gate's).
    if phase == "start":
        _started[0] = time.thread_time()
    elif _serving[0]:
        _seconds[info["generation"]].append(time.thread_time() - _started[0])


def _freeze_then_watch() -> None:
    freeze()
    _serving[0] = True


def summary(path: Path) -> str:
    """One line from an OUT.json: count, median and largest CPU time of each generation's collections."""
    try:
        seconds = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"no collection times ({exc})"
    parts = []
    for generation, times in sorted(seconds.items()):
        ordered = sorted(times)
        if ordered:
            median, largest = ordered[len(ordered) // 2] * 1000, ordered[-1] * 1000
            parts.append(f"gen{generation} {len(ordered)} x {median:.2f} ms (max {largest:.2f})")
        else:
            parts.append(f"gen{generation} 0")
    return ", ".join(parts)


def main() -> None:
    out = Path(sys.argv[1])
    atexit.register(lambda: out.write_text(json.dumps(_seconds)))
    gc.callbacks.append(_timed)
    server.freeze_startup_heap = _freeze_then_watch
    sys.exit(kvgate_main(sys.argv[2:]))


if __name__ == "__main__":
    main()
