"""Instructions per request of the gate's and the trivial server's Process, counted by valgrind.

Timings on a shared 2-core VM move by 20-40% between runs (`bench gate` prints the same servicer work
as 112-171 µs within minutes); an instruction count does not move at all, so a change to the hot path
is measured here to the percent and then confirmed in time by `bench gate`. Each figure is a pair of
runs of one process under `valgrind --tool=callgrind`: start-up and WARM_UP requests, then the same
plus REQUESTS more; the difference over REQUESTS is what one request costs (the one-trip and the
two-trip messages of bench_gate.envoy_messages, a 2 KB chat, through Process, the answer serialized;
no gRPC, which costs both servers alike).

Needs valgrind (Debian: `apt-get install valgrind`); about three minutes on two cores. The servicers
run against whatever `kvgate` is first on the path, so `PYTHONPATH=OLD_CHECKOUT/src` counts an older
gate with this harness.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from bench.bench_gate import ROOT, Servicer, chat_body, envoy_messages, gate_config_text, gate_servicer

WARM_UP = 30
REQUESTS = 200
SERVERS = ("gate", "trivial")
TRIPS = (1, 2)
_COLLECTED = re.compile(rb"Collected\s*:\s*(\d+)")


def serve_requests(server_name: str, trips: int, count: int) -> None:
    """Start-up, then WARM_UP + `count` requests through one server's Process (run under valgrind)."""
    from bench.trivial_extproc import TrivialProcessor
    from kvgate.config import parse_config
    from kvgate.gate.pipeline import Pipeline, estimator_factory

    async def run() -> None:
        config = parse_config(gate_config_text())
        # The trivial server runs without the gate's pipeline, whose estimator keeps a worker process
        # and a thread that would add their own instructions.
        pipeline = Pipeline(config, estimator_factory()) if server_name == "gate" else None
        try:
            server: Servicer = TrivialProcessor()
            if pipeline is not None:
                server = gate_servicer(config, pipeline)
            messages = envoy_messages(chat_body(), trips)

            async def stream() -> AsyncIterator[ProcessingRequest]:
                for raw in messages:
                    yield ProcessingRequest.FromString(raw)

            for _ in range(WARM_UP + count):
                async for response in server.Process(stream(), None):
                    response.SerializeToString()
        finally:
            if pipeline is not None:
                pipeline.close()

    uvloop.run(run())


def instructions(server_name: str, trips: int, count: int, tmp: Path) -> int:
    """Instructions valgrind counted in the main process of one run."""
    out = tmp / f"callgrind.{server_name}.{trips}.{count}"
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "bench.bench_instructions",
        server_name,
        str(trips),
        str(count),
    ]
    # A fixed hash seed: with a random one, dict and set layouts (and so the instructions) vary by run.
    # One BLAS thread: OpenBLAS's idle threads spin, and valgrind counts their spinning.
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, check=True)
    found = _COLLECTED.search(done.stderr)
    if found is None:
        raise RuntimeError(f"valgrind printed no instruction count: {done.stderr[-400:]!r}")
    return int(found.group(1))


def per_request(server_name: str, trips: int, tmp: Path) -> float:
    base, more = (instructions(server_name, trips, count, tmp) for count in (0, REQUESTS))
    return (more - base) / REQUESTS


def main() -> None:
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind); nothing measured")
        return
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = {
            (server, trips): pool.submit(per_request, server, trips, Path(tmp))
            for trips in TRIPS
            for server in SERVERS
        }
        counts = {key: job.result() for key, job in jobs.items()}
    print(f"instructions per 2 KB chat request through Process (valgrind, {REQUESTS} requests):")
    for trips in TRIPS:
        gate, trivial = counts[("gate", trips)], counts[("trivial", trips)]
        label = "1 trip" if trips == 1 else f"{trips} trips"
        print(
            f"  {label}: gate {gate / 1000:,.0f}k, trivial {trivial / 1000:,.0f}k, "
            f"the gate's own {(gate - trivial) / 1000:,.0f}k, ratio {gate / trivial:.2f}x"
        )


if __name__ == "__main__":
    if len(sys.argv) == 4:
        serve_requests(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
