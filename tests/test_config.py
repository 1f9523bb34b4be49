"""The kvgate YAML file: defaults, inheritance, and errors that name the file, line and key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.config import Config, load_config, parse_config
from kvgate.errors import ConfigError
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_empty_file_is_all_defaults() -> None:
    assert parse_config("") == Config(source="<string>")


def test_shipped_example_loads_and_matches_the_defaults() -> None:
    config = load_config(ROOT / "envoy" / "kvgate.yaml")
    assert dataclasses.replace(config, source="<defaults>") == Config()
    text = (ROOT / "envoy" / "kvgate.yaml").read_text()
    sections = {f.name for f in dataclasses.fields(Config)} - {"source"}
    assert not {s for s in sections if f"\n{s}:" not in text and f"\n# {s}:" not in text}, (
        "envoy/kvgate.yaml shows every section of kvgate.yaml, set or commented"
    )


def test_model_entries_inherit_from_default_model() -> None:
    config = parse_config(
        """
default_model:
  max_total_tokens: 32768
  pools: {long: long-a}
models:
  - match: "llama-*"
    interactive_max_tokens: 8192
"""
    )
    (entry,) = config.models
    assert entry.interactive_max_tokens == 8192
    assert entry.max_total_tokens == 32768
    assert entry.pools.long == "long-a"
    assert entry.pools.async_ == "async"


def test_retry_after_is_forecast_by_default_and_fixed_on_request() -> None:
    admission = Config().admission
    assert (admission.retry_after, admission.retry_after_s) == ("forecast", 2)
    bounds = (admission.retry_after_min_s, admission.retry_after_max_s, admission.retry_jitter)
    assert bounds == (0.5, 60, 0.1)
    fixed = parse_config("admission: {retry_after: fixed, retry_after_s: 3, retry_jitter: 0}\n").admission
    assert (fixed.retry_after, fixed.retry_after_s, fixed.retry_jitter) == ("fixed", 3, 0.0)


def test_layers_that_only_meet_per_request_load() -> None:
    """A policy may raise the interactive limit alone: it meets a total only on a request, where the
    total wins (kvgate.policy.route.effective_model)."""
    config = parse_config("policies: {wide: {interactive_max_tokens: 20000}}\n")
    assert config.policies["wide"].interactive_max_tokens == 20000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("server:\n  listen: x\n  wrokers: 2\n", "<string>:3: server.wrokers: unknown key"),
        (
            "default_model:\n  max_total_tokens: -5\n",
            "<string>:2: default_model.max_total_tokens: must be >= 1",
        ),
        ("default_model:\n  max_total_tokens: lots\n", "default_model.max_total_tokens: expected an integer"),
        ("request:\n  unparsed: drop\n", "request.unparsed: must be one of passthrough, reject"),
        (
            "models:\n  - interactive_max_tokens: 5\n",
            "<string>:2: models[0]: every model entry needs a 'match'",
        ),
        ("models:\n  - match: a\n    pools: {fast: x}\n", "<string>:3: models[0].pools.fast: unknown key"),
        (
            "default_model:\n  interactive_max_tokens: 20000\n",
            "<string>:2: default_model: interactive_max_tokens (20000) must not exceed "
            "max_total_tokens (16384)",
        ),
        (
            "models:\n  - match: a\n    max_total_tokens: 2000\n",
            "<string>:2: models[0]: interactive_max_tokens (4096) must not exceed max_total_tokens (2000)",
        ),
        (
            "policies:\n  chat:\n    interactive_max_tokens: 9000\n    max_total_tokens: 3000\n",
            "<string>:3: policies.chat: interactive_max_tokens (9000) must not exceed "
            "max_total_tokens (3000)",
        ),
        (
            "default_model:\n  max_total_tokens: 2000000000\n",
            "<string>:2: default_model.max_total_tokens: must be <= 1000000000, got 2000000000",
        ),
        ("server: [1]\n", "<string>:1: server: expected a mapping"),
        ("- a\n", "the file must be a mapping"),
        ("server: {listen: 'a'\n", "<string>:2: column 1: not valid YAML: while parsing a flow mapping"),
        ("server:\n  listen: a\n   workers: 1\n", "<string>:3: column 11: not valid YAML: mapping values"),
        (
            "admission:\n  water: {yellow_kv: 0.99, red_kv: 0.9}\n",
            "admission.water.yellow_kv (0.99) must not exceed admission.water.red_kv (0.9)",
        ),
        (
            "admission:\n  water: {yellow_stale: 0.8}\n",
            "admission.water.yellow_stale (0.8) must not exceed admission.water.red_stale (0.75)",
        ),
        ("server:\n  workers: 2\n  workers: 3\n", "server.workers: key given twice"),
        ("admission:\n  retry_after: adaptive\n", "<string>:2: admission.retry_after: must be one of"),
        (
            "admission: {retry_after_min_s: 5, retry_after_max_s: 1}\n",
            "admission.retry_after_min_s (5) must not exceed admission.retry_after_max_s (1)",
        ),
    ],
)
def test_errors_name_the_line_and_key(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(text)
    assert expected in str(raised.value)


def test_cli_reports_config_errors_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "kvgate.yaml"
    bad.write_text("server:\n  listne: 1\n")
    assert main(["gate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: server.listne: unknown key" in err


def test_cli_reports_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gate", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_cli_reports_a_missing_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listen = f"127.0.0.1:{free_port()}"
    assert main(["gate", "--tokenizer", str(tmp_path / "missing.model"), "--listen", listen]) == 2
    assert "tokenizer file not found" in capsys.readouterr().err


def test_a_missing_tokenizer_is_named_by_its_key_and_the_file_tried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("models:\n  - match: m\n    tokenizer: tok.model\n")
    monkeypatch.chdir(tmp_path)
    listen = f"127.0.0.1:{free_port()}"
    assert main(["gate", "--config", str(config), "--listen", listen]) == 2
    err = capsys.readouterr().err
    # A relative path is the working directory's: the message says which file that was.
    assert f"{config}: models[0].tokenizer: tokenizer file not found: tok.model" in err
    assert f"(in the working directory: {tmp_path / 'tok.model'})" in err
