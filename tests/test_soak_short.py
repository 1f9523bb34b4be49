"""A short soak (bench/bench_soak.py): mixed traffic through the real Envoy to a two-worker gate while
an agent is restarted and gate workers are killed. Nothing may be lost, nothing leaked, and no
process that lives through the run may grow much."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

TRAFFIC_S = 22.0
RATE = 6.0
LEASE_S = 8.0


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "bench.bench_soak", "--seconds", str(TRAFFIC_S), "--rate", str(RATE)]
    argv += ["--lease-s", str(LEASE_S), "--out", str(tmp_path)]
    # Run as a user runs it (from the checkout); its report goes to the test's output as it comes.
    done = subprocess.run(argv, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0
    report = json.loads((tmp_path / "report.json").read_text())

    assert report["sent"] == int(TRAFFIC_S * RATE)
    assert report["agent_restarts"] >= 2
    assert report["worker_kills"] >= 1
    assert report["lost"] == 0, report["outcomes"]
    assert report["unexpected_refusals"] == 0, report["outcomes"]
    # Every kind was answered the way it should be at least once: the stack really served the mix.
    outcomes = report["outcomes"]
    assert outcomes["short"].get("ok", 0) > 0
    assert outcomes["long"].get("ok", 0) > 0
    assert outcomes["too_long"].get("refused 413 too_long", 0) > 0
    assert outcomes["malformed"].get("refused 400 invalid_request", 0) > 0
    assert outcomes["gzip_short"].get("ok", 0) > 0
    leaked = sum(report["reserved_after_lease"].values())
    assert leaked == 0, (report["reserved_after_drain"], report["reserved_after_lease"])

    survivors = [row for row in report["rss"] if float(row["lifetime_s"]) >= TRAFFIC_S * 0.9]
    roles = {row["role"] for row in survivors}
    assert {"envoy", "gate", "agent-long-0", "sim-interactive"} <= roles
    for row in survivors:
        first, last = float(row["first_quarter_mib"]), float(row["last_quarter_mib"])
        assert last - first < max(16.0, 0.25 * first), row
