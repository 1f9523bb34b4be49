"""`kvgate demo --faults`: the spec, and what each fault is charged with (kvgate.demo.faults)."""

from __future__ import annotations

import pytest

from kvgate.demo.faults import Fault, Injected, fault_figures, fault_lines, parse_faults
from kvgate.demo.load import Result
from kvgate.demo.scenario import Planned
from kvgate.errors import ConfigError

INTERACTIVE = frozenset({"interactive-0"})


def test_a_spec_names_targets_times_and_signals() -> None:
    assert parse_faults("node:50s:term, gate:8,agent:22.5s", 60) == (
        Fault("gate", 8.0),
        Fault("agent", 22.5),
        Fault("node", 50.0, "TERM"),
    )


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("gate", "'gate' is not TARGET:SECONDS"),
        ("envoy:5s", "the target is one of gate, agent, queue, node"),
        ("gate:5s:HUP", "the signal is KILL or TERM"),
        ("gate:90s", "comes after the replay's 60 s"),
        ("gate:-1s", "'gate:-1s' is not TARGET:SECONDS"),
    ],
)
def test_a_bad_spec_is_a_config_error_naming_the_part(spec: str, names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        parse_faults(spec, 60)


def request(
    index: int,
    sent_s: float,
    outcome: str = "ok",
    *,
    ended_after_s: float = 1.0,
    node: str | None = "long-0",
    reason: str | None = "long",
    prompt: int = 20_000,
    status: int | None = 200,
) -> Result:
    kind = "long" if prompt > 4096 else "short"
    planned = Planned(sent_s, kind, prompt, 100, index)  # type: ignore[arg-type]
    return Result(
        planned,
        sent_s,
        outcome,  # type: ignore[arg-type]
        status,
        finished_s=ended_after_s,
        node=node,
        gate_reason=reason,
    )


def figures(injected: list[Injected], results: list[Result]) -> list[dict[str, object]]:
    return fault_figures(
        injected, results, interactive_nodes=INTERACTIVE, interactive_max_tokens=4096, first_s=0.0
    )


def test_lost_requests_are_charged_to_the_latest_fault_and_told_apart_by_what_was_in_flight() -> None:
    gate = Injected(Fault("gate", 40.0), 40.0, 46.0, None, 50_000, 31.5)
    node = Injected(Fault("node", 100.0), 100.0, 106.0, "long-0", None, None)
    results = [
        request(0, 10.0, "lost", ended_after_s=5.0),  # lost before any fault: nobody's
        request(1, 39.0, "lost", ended_after_s=2.0),  # in flight on the gate when it died
        request(2, 41.0, "lost", ended_after_s=0.5),  # sent to a dead gate: not in flight
        request(3, 99.0, "lost", ended_after_s=3.0, node="long-0"),  # on the killed node
        request(4, 99.5, "lost", ended_after_s=3.0, node="long-1"),  # on another node
    ]
    gate_figures, node_figures = figures([gate, node], results)
    assert (gate_figures["lost"], gate_figures["lost_not_in_flight"]) == (2, 1)
    assert (node_figures["lost"], node_figures["lost_not_in_flight"]) == (2, 1)
    assert gate_figures["held_tokens"] == 50_000 and gate_figures["held_tokens_back_s"] == 31.5
    assert (gate_figures["at_s"], gate_figures["restarted_after_s"]) == (40.0, 6.0)


def test_a_long_prompt_that_failed_open_to_an_interactive_node_is_counted() -> None:
    gate = Injected(Fault("gate", 40.0), 40.0, 46.0, None, None, None)
    results = [
        request(0, 41.0, node="interactive-0", reason=""),  # served there without the gate's answer
        request(1, 42.0, "other", node="interactive-0", reason="", status=400),  # refused for length
        request(2, 43.0, node="interactive-0", reason="long"),  # lent by the gate: fine
        request(3, 44.0, node="interactive-0", reason="", prompt=800),  # chat failing open: fine
    ]
    (gate_figures,) = figures([gate], results)
    assert gate_figures["long_to_interactive"] == 2


def test_admission_is_back_once_a_window_admits_the_pre_fault_share() -> None:
    killed = 60.0
    results = [request(i, float(i)) for i in range(30, 60)]  # all admitted before
    results += [request(100 + i, 60.0 + i, "503", reason=None, status=503) for i in range(12)]  # refused
    results += [request(200 + i, 72.0 + i, node="long-1") for i in range(30)]  # admitted again
    agent = Injected(Fault("agent", killed), killed, 66.0, "long-0", None, None)
    (agent_figures,) = figures([agent], results)
    # The window from 71 s admits 9 of 10: 90 % of the share before, the bar.
    assert agent_figures["admission_back_s"] == 11.0
    undisturbed = [request(i, float(i)) for i in range(30, 110)]
    (calm,) = figures([agent], undisturbed)
    assert calm["admission_back_s"] == 0.0
    assert "admission back after 0.0 s" in fault_lines({"kvgate_prefix_off": {"faults": [calm]}})
