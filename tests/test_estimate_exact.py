"""Exact counting: chunked counts equal whole-text counts; early stopping stays in the right class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from corpus.cases import KINDS, text
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvgate.errors import ConfigError
from kvgate.estimate import calibration, decide
from kvgate.estimate.exact import TokenizerFile, chunks, count_chunk, load_counter
from kvgate.estimate.fast import FastEstimator


@pytest.fixture(scope="module")
def hf_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real byte-level BPE tokenizer.json (with a prefix space, the harder case), trained here."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text("english")[:60000], text("code")[:60000]], trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["sentencepiece", "huggingface"])
def test_chunk_counts_add_up_to_the_whole_text(
    kind: str, which: str, sp_model_path: Path, hf_tokenizer_path: Path
) -> None:
    path = sp_model_path if which == "sentencepiece" else hf_tokenizer_path
    counter = load_counter(TokenizerFile.open(path))
    body = text(kind)[:60000]
    parts = list(chunks(body, counter, size=2000))
    assert len(parts) > 5
    assert "".join(parts) == body
    summed = sum(count_chunk(counter, p, i == 0, i == len(parts) - 1) for i, p in enumerate(parts))
    assert summed == counter.count(body)


@pytest.mark.parametrize("which", ["sentencepiece", "huggingface"])
def test_lone_surrogates_from_json_escapes_are_counted(
    which: str, sp_model_path: Path, hf_tokenizer_path: Path
) -> None:
    path = sp_model_path if which == "sentencepiece" else hf_tokenizer_path
    counter = load_counter(TokenizerFile.open(path))
    lone = json.loads('"ab\\ud800cd \\ud83d\\ude00"')
    assert counter.count(lone) == counter.count("ab\ufffdcd \U0001f600")


def test_a_text_without_newlines_is_one_chunk(sp_model_path: Path) -> None:
    counter = load_counter(TokenizerFile.open(sp_model_path))
    assert list(chunks("word " * 5000, counter, size=100)) == ["word " * 5000]


def test_missing_or_broken_tokenizer_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        TokenizerFile.open(tmp_path / "missing.model")
    broken = tmp_path / "broken.model"
    broken.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="sentencepiece"):
        load_counter(TokenizerFile.open(broken))
    broken_json = tmp_path / "tokenizer.json"
    broken_json.write_text("{}")
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        load_counter(TokenizerFile.open(broken_json))


def _job(path: Path, texts: tuple[str, ...], extra: int, thresholds: tuple[int, ...]) -> decide.CountJob:
    tokenizer = TokenizerFile.open(path)
    return decide.CountJob(
        tokenizer, FastEstimator(calibration.for_tokenizer(tokenizer)), texts, extra, thresholds
    )


def test_counting_stops_once_the_class_is_certain(sp_model_path: Path) -> None:
    body = text("english")
    exact = load_counter(TokenizerFile.open(sp_model_path)).count(body)
    assert exact > 30000
    # Far above the threshold: a few chunks settle it, and the total stays on the right side.
    counted = decide.run(_job(sp_model_path, (body,), 0, (16384,)))
    assert not counted.complete
    assert counted.counted_chars < len(body) // 2
    assert counted.tokens > 16384
    full = decide.run(_job(sp_model_path, (body,), 0, ()))
    assert full.complete
    assert full.tokens == exact
    assert full.counted_chars == len(body)


def test_counting_near_a_threshold_goes_on_until_it_is_decided(sp_model_path: Path) -> None:
    body = text("code")[:40000]
    exact = load_counter(TokenizerFile.open(sp_model_path)).count(body)
    for limit in (exact - 3, exact + 3):
        counted = decide.run(_job(sp_model_path, (body,), 0, (limit,)))
        assert (counted.tokens > limit) == (exact > limit)
