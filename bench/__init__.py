"""kvgate's benchmarks: `python -m bench [NAME ...]` runs bench/bench_NAME.py's main() for each."""

# The baselines (bench/trivial_extproc.py, the bare gRPC servers) on the transport kvgate's own
# processes use, chosen before grpc's import (kvgate.grpc_transport).
import kvgate  # noqa: F401
