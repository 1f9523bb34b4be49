"""A short soak (bench/bench_soak.py): mixed traffic through the real Envoy to a two-worker gate while
an agent is restarted, the whole gate is killed, a gate worker is killed, a node is killed and the
gate is stopped gracefully, each started again. Nothing may fail but what a fault was under way for,
nothing may be lost, nothing leaked, no renewal lapse in steady state, a dead gate's reservations
must be free within a lease and a renewal period, and no process that lives through the run may grow
much."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

# Long enough for one fault of each kind (bench/soak_faults.py: one every 6 s at the least).
TRAFFIC_S = 40.0
RATE = 6.0
LEASE_S = 8.0
FAULTS = {"agent", "gate_kill", "worker", "node", "gate_term"}


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "bench.bench_soak", "--seconds", str(TRAFFIC_S), "--rate", str(RATE)]
    argv += ["--lease-s", str(LEASE_S), "--out", str(tmp_path)]
    # Run as a user runs it (from the checkout); its report goes to the test's output as it comes.
    done = subprocess.run(argv, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0
    report = json.loads((tmp_path / "report.json").read_text())

    assert report["sent"] == int(TRAFFIC_S * RATE)
    assert set(report["fault_counts"]) == FAULTS
    assert report["lost"] == 0, report["outcomes"]
    assert report["unexpected_refusals"] == 0, report["outcomes"]
    # Requests may fail while a fault is under way (a long prompt fails open while the gate is down),
    # never before any fault or once the killed process is back.
    failures = report["failures_by_fault"]
    assert "steady" not in failures, failures
    assert all("after_back" not in phases for phases in failures.values()), failures
    assert report["lapsed_by_fault"].get("steady", 0) == 0, report["lapsed_by_fault"]
    assert report["agent_events"].get("renewed", 0) > 0
    for fault in report["faults"]:
        assert fault["exit_code"] in (None, 0), fault  # a SIGTERMed gate drains and exits cleanly
        if fault["holders"]:
            assert fault["held_free_after_s"] is not None, fault
            assert fault["held_free_after_s"] <= report["held_free_bound_s"], fault
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
    # The gate is restarted on purpose; the agent and the engine of long-0 never are.
    assert {"envoy", "agent-long-0", "sim-long-0", "sim-interactive"} <= roles
    for row in survivors:
        first, last = float(row["first_quarter_mib"]), float(row["last_quarter_mib"])
        assert last - first < max(16.0, 0.25 * first), row
