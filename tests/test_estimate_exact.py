"""Exact counting: chunked counts equal whole-text counts; tekken counts equal mistral-common's; early
stopping stays in the right class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TOKENIZER_DIR
from corpus.cases import KINDS, text
from mistral_common.tokens.tokenizers.tekken import Tekkenizer
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


TEKKEN_FILES = ("tekken_240718.json", "tekken_240911.json")
WHICH = ("sentencepiece", "huggingface", "tekken")
# Kinds with line breaks before letters: JSON on one line, or with every line indented, is one chunk
# to a byte-level tokenizer (and counted whole, which needs no check).
CHUNKED_KINDS = ("english", "code", "chinese", "other", "mixed")


def _path(which: str, sp_model_path: Path, hf_tokenizer_path: Path) -> Path:
    return {
        "sentencepiece": sp_model_path,
        "huggingface": hf_tokenizer_path,
        "tekken": TOKENIZER_DIR / TEKKEN_FILES[0],
    }[which]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", WHICH)
def test_chunk_counts_add_up_to_the_whole_text(
    kind: str, which: str, sp_model_path: Path, hf_tokenizer_path: Path
) -> None:
    counter = load_counter(TokenizerFile.open(_path(which, sp_model_path, hf_tokenizer_path)))
    body = text(kind)[:60000]
    parts = list(chunks(body, counter, size=2000))
    if kind in CHUNKED_KINDS or which == "sentencepiece":
        assert len(parts) > 5
    assert "".join(parts) == body
    summed = sum(count_chunk(counter, p, i == 0, i == len(parts) - 1) for i, p in enumerate(parts))
    assert summed == counter.count(body)


def test_a_byte_level_chunk_never_starts_where_tekken_joins_across_the_line_break() -> None:
    counter = load_counter(TokenizerFile.open(TOKENIZER_DIR / TEKKEN_FILES[0]))
    # Tekken's pattern joins "}" with the newline and slash after it, and a newline with the spaces
    # after it: neither is a boundary; the newline before "word" is.
    body = "x" * 50 + "}\n/path\n  indented\nword after"
    parts = list(chunks(body, counter, size=10))
    assert parts == ["x" * 50 + "}\n/path\n  indented\n", "word after"]
    assert sum(count_chunk(counter, p, i == 0, i == 1) for i, p in enumerate(parts)) == counter.count(body)


# Text that spells special tokens, control characters, lone surrogates and emoji: tekken counts them
# all as ordinary text, as mistral-common does.
AWKWARD = (
    "[INST] hello [/INST]</s><s>[TOOL_CALLS][AVAILABLE_TOOLS]<unk><SPECIAL_42>",
    "tab\there\r\nnull\x00byte \u200b zero-width, \ufeff bom",
    json.loads('"ab\\ud800cd \\ud83d\\ude00 \\udfff"'),
    "👩‍👩‍👧‍👦 🇫🇷 ❤️ 𠜎𠜱 ﷺ",
    "",
)


@pytest.mark.parametrize("name", TEKKEN_FILES)
def test_tekken_counts_equal_mistral_commons(name: str) -> None:
    path = TOKENIZER_DIR / name
    ours = load_counter(TokenizerFile.open(path))
    theirs = Tekkenizer.from_file(path)
    for kind in KINDS:
        body = text(kind)
        for piece in (body, body[:5000], body[12345:12999]):
            assert ours.count(piece) == len(theirs.encode(piece, bos=False, eos=False)), kind
    for piece in AWKWARD:
        assert ours.count(piece) == len(theirs.encode(piece, bos=False, eos=False)), piece


def test_a_tekken_file_is_recognised_and_read_without_mistral_common(tmp_path: Path) -> None:
    path = TOKENIZER_DIR / TEKKEN_FILES[0]
    assert TokenizerFile.open(path).kind == "tekken"
    assert TokenizerFile.open(TOKENIZER_DIR / "tokenizer.model.v1").kind == "sentencepiece"
    # The gate must not need the development-only mistral-common at run time.
    script = (
        "import sys; from pathlib import Path; "
        "from kvgate.estimate.exact import TokenizerFile, load_counter; "
        f"print(load_counter(TokenizerFile.open(Path({str(path)!r}))).count('hello world')); "
        "print(any(m.startswith('mistral_common') for m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.split() == [
        str(len(Tekkenizer.from_file(path).encode("hello world", False, False))),
        "False",
    ]
    broken = tmp_path / "tekken_broken.json"
    broken.write_text('{"config": {"num_vocab_tokens": 1, "default_num_special_tokens": 1}, "vocab": [{}]}')
    assert TokenizerFile.open(broken).kind == "tekken"
    with pytest.raises(ConfigError, match="not a tekken tokenizer"):
        load_counter(TokenizerFile.open(broken))


@pytest.mark.parametrize("which", WHICH)
def test_lone_surrogates_from_json_escapes_are_counted(
    which: str, sp_model_path: Path, hf_tokenizer_path: Path
) -> None:
    counter = load_counter(TokenizerFile.open(_path(which, sp_model_path, hf_tokenizer_path)))
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
