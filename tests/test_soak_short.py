"""A short soak (bench/bench_soak.py): mixed traffic through the real Envoy to a two-worker gate while
an agent is restarted and gate workers are killed. Nothing may be lost, nothing leaked, and no
process that lives through the run may grow much."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The benchmarks live beside tests/, not in the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_soak import print_report, run_soak

pytestmark = pytest.mark.slow

TRAFFIC_S = 22.0
RATE = 6.0
LEASE_S = 8.0


def test_short_soak_loses_nothing_and_leaks_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = run_soak(TRAFFIC_S, RATE, tmp_path, lease_s=LEASE_S)
    with capsys.disabled():
        print_report(report)

    assert report.sent == int(TRAFFIC_S * RATE)
    assert report.agent_restarts >= 2
    assert report.worker_kills >= 1
    assert report.lost == 0, report.outcomes
    assert report.unexpected_refusals == 0, report.outcomes
    # Every kind was answered the way it should be at least once: the stack really served the mix.
    assert report.outcomes["short"].get("ok", 0) > 0
    assert report.outcomes["long"].get("ok", 0) > 0
    assert report.outcomes["too_long"].get("refused 413 too_long", 0) > 0
    assert report.outcomes["malformed"].get("refused 400 invalid_request", 0) > 0
    assert report.outcomes["gzip_short"].get("ok", 0) > 0
    assert report.leaked == 0, (report.reserved_after_drain, report.reserved_after_lease)

    survivors = [row for row in report.rss if float(row["lifetime_s"]) >= TRAFFIC_S * 0.9]
    roles = {row["role"] for row in survivors}
    assert {"envoy", "gate", "agent-long-0", "sim-interactive"} <= roles
    for row in survivors:
        first, last = float(row["first_quarter_mib"]), float(row["last_quarter_mib"])
        assert last - first < max(16.0, 0.25 * first), row
