"""The replay report's routing CPU, by process and in a fixed part and a per-request part (pure)."""

from __future__ import annotations

import asyncio
import os

from kvgate.demo.cpu import idle_cpu_per_s
from kvgate.demo.trace_report import cpu_split, format_trace_table, summarize_trace_run


def test_the_idle_rate_is_charged_for_the_metered_seconds_and_the_rest_is_per_request() -> None:
    # 100 requests over 20 s: the agent spends 0.05 s a second idle (1 s of its 1.2 s), Envoy nothing.
    split = cpu_split({"envoy": 0.3, "gate": 0.9, "agent-0": 1.2}, {"agent-0": 0.05, "gate": 0.01}, 20, 100)
    assert split["routing_cpu_split"]["agent-0"] == {
        "ms_per_request": 12.0,
        "fixed_ms_per_s": 50.0,
        "fixed_ms_per_request": 10.0,
        "variable_ms_per_request": 2.0,
    }
    assert split["routing_cpu_split"]["envoy"]["fixed_ms_per_request"] == 0.0
    assert split["routing_cpu_fixed_ms_per_s"] == 60.0
    assert split["routing_cpu_fixed_ms_per_request"] == 12.0
    assert split["routing_cpu_variable_ms_per_request"] == 3.0 + 7.0 + 2.0
    # The same trace twice as fast is metered half as long: its fixed share per request halves.
    faster = cpu_split({"envoy": 0.3, "gate": 0.8, "agent-0": 0.7}, {"agent-0": 0.05, "gate": 0.01}, 10, 100)
    assert faster["routing_cpu_fixed_ms_per_request"] == 6.0
    assert faster["routing_cpu_variable_ms_per_request"] == split["routing_cpu_variable_ms_per_request"]


def test_a_process_is_never_charged_more_fixed_cpu_than_it_spent() -> None:
    split = cpu_split({"queue": 0.1}, {"queue": 0.05}, 10, 10)["routing_cpu_split"]["queue"]
    assert split["fixed_ms_per_request"] == 10.0 and split["variable_ms_per_request"] == 0.0


def test_the_table_prints_the_split_by_process_and_old_reports_still_print() -> None:
    summary = summarize_trace_run(
        [], {}, {"envoy": 0.2, "gate": 0.4}, 6.0, idle_cpu_per_s={"gate": 0.01}, metered_s=10
    )
    peer = summarize_trace_run([], {}, {"router": 0.1}, 6.0, idle_cpu_per_s={}, metered_s=10)
    old = summarize_trace_run([], {}, {"envoy": 0.2}, 6.0)
    assert "routing_cpu_split" not in old
    table = format_trace_table({"runs": {"kvgate": summary, "smg": peer, "old": old}})
    gate_row = next(line for line in table.splitlines() if line.strip().startswith("gate ms/request"))
    assert "400.00 (100.00 + 300.00)" in gate_row and gate_row.rstrip().endswith("-")
    assert any(line.strip().startswith("router ms/request") for line in table.splitlines())
    assert "variable ms/request" in table


def test_the_idle_rate_is_cpu_seconds_per_second() -> None:
    assert asyncio.run(idle_cpu_per_s({"me": os.getpid()}, 0.05))["me"] >= 0
