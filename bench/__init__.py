"""kvgate's benchmarks: `python -m bench [NAME ...]` runs bench/bench_NAME.py's main() for each."""
