"""The `kvgate` command's own flags and the help every subcommand prints."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from kvgate.cli import build_parser, main


def help_of(command: str) -> str:
    parser = build_parser()
    if command:
        [subparsers] = [a for a in parser._actions if a.dest == "command"]
        assert isinstance(subparsers.choices, dict)
        parser = subparsers.choices[command]
    return " ".join(parser.format_help().split())


def test_version_names_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["--version"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvgate {importlib.metadata.version('kvgate')}"


def test_help_shows_each_option_s_default_once() -> None:
    agent = help_of("agent")
    assert "GPU sampling; fake simulates GPUs (default on)" in agent
    assert "lease when a gate names none (default 300.0)" in agent
    assert "KV cache dtype (default bf16)" in agent
    # Where the help already gives its default, nothing is added.
    assert "GPUs simulated with --nvml fake (default 8)" in agent and "(default 8) (default" not in agent
    assert "what to log (default info)" in help_of("")
    assert "most sequences in one batch (default 256)" in help_of("sim")
    assert "seed for output lengths and text (default 0)" in help_of("sim"), "a default of 0 is one"


@pytest.mark.parametrize(
    "command",
    ["", "gate", "agent", "status", "envoy-config", "estimate", "calibrate", "sim", "demo", "queue"],
)
def test_help_never_shows_an_empty_or_a_flag_s_default(command: str) -> None:
    text = help_of(command)
    assert not re.search(r"\(default (False|None|\[\]|\(\))\)", text), text
