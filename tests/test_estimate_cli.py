"""`kvgate estimate` and `kvgate calibrate` from the command line."""

from __future__ import annotations

import argparse
import io
import json
import logging
from pathlib import Path

import pytest
from conftest import TOKENIZER_DIR
from corpus.cases import text
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import kvgate.estimate
from kvgate.cli import main
from kvgate.errors import ConfigError
from kvgate.estimate import calibration
from kvgate.estimate.cli import register
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.estimate.fast import FastEstimator


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def body(content: str, **extra: object) -> str:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra})


def test_estimate_prints_one_json_object_per_body(
    tmp_path: Path, sp_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    english = text("english")
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text(
        "\n".join(
            [
                body("Hello there."),
                body(english[:20000], max_tokens=50),
                body(english[:150000]),
                json.dumps({"model": "m", "prompt": "Say hi", "max_tokens": 5}),
                "{not json",
            ]
        )
        + "\n"
    )
    results = []
    for method in ("auto", "fast", "exact"):
        code = run(
            ["estimate", "--tokenizer", str(sp_model_path), "--method", method, "--jsonl", str(bodies)]
        )
        assert code == 1  # the broken line
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert lines[-1]["error"] == "invalid_request"
        results.append(lines[:-1])
    auto, fast, exact = results
    assert [r["class"] for r in auto] == ["interactive", "long", "too_long", "interactive"]
    assert [r["class"] for r in exact] == [r["class"] for r in auto]
    assert {r["method"] for r in fast} == {"fast"}
    assert {r["method"] for r in exact} == {"exact"}
    assert auto[0]["method"] == "fast"
    assert auto[1]["output_tokens"] == 50
    assert auto[2]["output_tokens"] == 1024
    counter = load_counter(TokenizerFile.open(sp_model_path))
    # Exact: the text's tokens plus the per-message overhead (4 by default).
    assert exact[3]["prompt_tokens"] == counter.count("Say hi")
    assert exact[0]["prompt_tokens"] == counter.count("Hello there.") + 4
    for result in auto:
        assert result["total_tokens"] == result["prompt_tokens"] + result["output_tokens"]


def test_estimate_reads_one_body_from_stdin_without_a_tokenizer(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    path = tmp_path / "body.json"
    path.write_text(body("Hello there, how are you?"))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes())))
    monkeypatch.setattr(kvgate.estimate, "_noticed", False)
    with caplog.at_level(logging.WARNING, logger="kvgate.estimate"):
        assert run(["estimate"]) == 0
    assert not caplog.records, "a command run by hand is spared the server's notice"
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "fast"
    assert result["class"] == "interactive"
    with pytest.raises(ConfigError, match="needs --tokenizer"):
        run(["estimate", "--method", "exact", str(path)])


def test_a_file_it_cannot_read_or_write_is_one_line_and_exit_2(
    tmp_path: Path, sp_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.json"
    assert main(["estimate", str(missing)]) == 2
    assert main(["estimate", str(tmp_path)]) == 2
    # Refused before the fit, which takes minutes on a real corpus.
    out = tmp_path / "nowhere" / "fitted.json"
    argv = ["calibrate", "--tokenizer", str(sp_model_path), "--corpus", str(missing), "--out", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvgate: configuration error: cannot read {missing}: No such file or directory",
        f"kvgate: configuration error: cannot read {tmp_path}: Is a directory",
        f"kvgate: configuration error: --out {out}: no directory {out.parent}",
    ]


@pytest.fixture(scope="module")
def hf_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real byte-level BPE tokenizer.json, trained here."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text("english")[:60000], text("compact_json")[:60000]], trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("which", ["sentencepiece", "huggingface", "tekken"])
def test_calibrate_writes_a_calibration_the_gate_can_load(
    which: str,
    tmp_path: Path,
    sp_model_path: Path,
    hf_tokenizer_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tokenizer = {
        "sentencepiece": sp_model_path,
        "huggingface": hf_tokenizer_path,
        "tekken": TOKENIZER_DIR / "tekken_240718.json",
    }[which]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for kind in ("english", "code", "chinese", "compact_json", "tools"):
        (corpus / f"{kind}.txt").write_text(text(kind)[:30000])
    out = tmp_path / "fitted.json"
    assert run(["calibrate", "--tokenizer", str(tokenizer), "--corpus", str(corpus), "--out", str(out)]) == 0
    assert "held-back error" in capsys.readouterr().err
    fitted = calibration.load(out)
    assert fitted.sha256 == TokenizerFile.open(tokenizer).sha256
    assert 0 < fitted.mean_error < 0.1
    assert all(band.under >= 1 and band.over >= 1 for band in fitted.bands)
    assert all(0 < relative <= 1 for _, relative in fitted.uncertainty)
    # The fit is what the gate uses: its band holds the count of a kind of text it never saw (a
    # 2,000-piece toy vocabulary strays further from the corpus than a real one, hence 30%).
    counter = load_counter(TokenizerFile.open(tokenizer))
    piece = text("mixed")[:40000]
    band = FastEstimator(fitted).estimate(piece)
    exact = counter.count(piece)
    assert band.low <= exact <= band.high
    assert abs(band.tokens - exact) / exact < 0.3
    with pytest.raises(ConfigError, match="not found"):
        run(
            [
                "calibrate",
                "--tokenizer",
                str(sp_model_path),
                "--corpus",
                str(tmp_path / "nope"),
                "--out",
                str(out),
            ]
        )
