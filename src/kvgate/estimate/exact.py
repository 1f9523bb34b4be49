"""Exact token counts from a real tokenizer file: sentencepiece `.model`, Hugging Face `tokenizer.json`,
or Mistral's tekken `.json` (byte-level BPE, counted with tiktoken the way mistral-common does).

Counting a long text can stop half-way once the class is certain, so texts are counted in chunks. A
chunk boundary sits right after a newline: no sentencepiece piece of the supported models spans a
newline, so for them any character but another line break may follow. Byte-level pre-tokenizers join
a newline to the spaces after it, and tekken's pattern (as Mistral NeMo's tokenizer.json) joins
punctuation to the newlines and slashes after it (` ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*`), but none of their
alternatives runs from a newline into a letter: for them the boundary waits for a letter. A chunk is
counted between anchors (a word and a newline before it, a letter after it) minus the anchors' own
tokens, so that a tokenizer's start-of-text rule (sentencepiece's dummy prefix, a byte-level
`add_prefix_space`) and its grouping of trailing whitespace apply only where they would on the whole
text. The chunk counts then add up to the count of the whole text (tests check this on the corpus for
every kind of tokenizer).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from kvgate.errors import ConfigError

CHUNK_CHARS = 4096
# What a continuation chunk is counted behind: a word takes any prefix space, the newline ends it.
_ANCHOR = "a\n"
_FOLLOWER = "a"
TokenizerKind = Literal["sentencepiece", "huggingface", "tekken"]
# "line": a chunk may start with anything but a line break; "letter": only with a letter.
Boundary = Literal["line", "letter"]
# Keys only a tekken file has near its start (its small `config` object comes before the vocabulary).
_TEKKEN_MARKERS = (b'"num_vocab_tokens"', b'"default_num_special_tokens"')
_SNIFF_BYTES = 1 << 16


class TokenCounter(Protocol):
    @property
    def boundary(self) -> Boundary: ...

    def count(self, text: str) -> int: ...

    def max_piece_bytes(self) -> int: ...


def _kind(path: Path, head: bytes) -> TokenizerKind:
    if not path.name.endswith(".json"):
        return "sentencepiece"
    if all(marker in head for marker in _TEKKEN_MARKERS):
        return "tekken"
    return "huggingface"


@dataclass(frozen=True, slots=True)
class TokenizerFile:
    """A tokenizer on disk, named by its content so a calibration can be matched to it."""

    path: Path
    kind: TokenizerKind
    sha256: str

    @classmethod
    def open(cls, path: Path) -> TokenizerFile:
        if not path.is_file():
            # A relative path is the working directory's, not the config file's: say which file that is.
            tried = "" if path.is_absolute() else f" (in the working directory: {path.absolute()})"
            raise ConfigError(f"tokenizer file not found: {path}{tried}")
        data = path.read_bytes()
        return cls(path, _kind(path, data[:_SNIFF_BYTES]), hashlib.sha256(data).hexdigest())


def encodable(text: str) -> str:
    """The text with lone surrogates (which JSON's \\uD800 escapes produce) replaced by U+FFFD:
    no tokenizer library accepts them."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class SentencePieceCounter:
    boundary: Boundary = "line"

    def __init__(self, path: Path) -> None:
        import sentencepiece

        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"{path}: not a sentencepiece model: {exc}") from exc

    def count(self, text: str) -> int:
        return len(self._processor.encode(encodable(text)))

    def max_piece_bytes(self) -> int:
        pieces = (self._processor.id_to_piece(i) for i in range(self._processor.get_piece_size()))
        # "▁" stands for one space byte of the text.
        return max(len(piece.replace("\u2581", " ").encode("utf-8")) for piece in pieces)


class HuggingFaceCounter:
    boundary: Boundary = "letter"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ConfigError(f"{path}: not a Hugging Face tokenizer.json: {exc}") from exc

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(encodable(text), add_special_tokens=False).ids)

    def max_piece_bytes(self) -> int:
        # Byte-level vocabularies spell each byte as one (up to 2-byte) character: this over-counts,
        # which only loosens the lower bound it feeds.
        return max(len(token.encode("utf-8")) for token in self._tokenizer.get_vocab())


class TekkenCounter:
    """Mistral's tekken file read without mistral-common (a development dependency only).

    As mistral-common 1.13.1 builds its Tekkenizer (mistral_common/tokens/tokenizers/tekken.py,
    `Tekkenizer.__init__` and `_reload_mergeable_ranks`): the first `default_vocab_size -
    default_num_special_tokens` vocabulary entries, rank -> base64 `token_bytes`, become tiktoken's
    mergeable ranks with the file's `pattern` and no special tokens. Its `encode` then offsets every
    id by the number of special tokens, which leaves counts unchanged; text that spells a special
    token (`[INST]`) is ordinary text to it, as here.
    """

    boundary: Boundary = "letter"

    def __init__(self, path: Path) -> None:
        import tiktoken

        try:
            document = json.loads(path.read_bytes())
            config = document["config"]
            size = config["default_vocab_size"] - config["default_num_special_tokens"]
            vocabulary = document["vocab"][:size]
            self._ranks = {base64.b64decode(entry["token_bytes"]): entry["rank"] for entry in vocabulary}
            if sorted(self._ranks.values()) != list(range(size)):
                raise ValueError(f"ranks are not 0..{size - 1}")
            self._encoding = tiktoken.Encoding(
                name=path.stem, pat_str=config["pattern"], mergeable_ranks=self._ranks, special_tokens={}
            )
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            KeyError,
            TypeError,
            ValueError,
            binascii.Error,
        ) as exc:
            raise ConfigError(f"{path}: not a tekken tokenizer file: {exc!r}") from exc

    def count(self, text: str) -> int:
        return len(self._encoding.encode_ordinary(encodable(text)))

    def max_piece_bytes(self) -> int:
        return max(len(piece) for piece in self._ranks)


# Worker processes load each tokenizer once and keep it for every count they run.
@functools.lru_cache(maxsize=8)
def load_counter(tokenizer: TokenizerFile) -> TokenCounter:
    if tokenizer.kind == "tekken":
        return TekkenCounter(tokenizer.path)
    if tokenizer.kind == "huggingface":
        return HuggingFaceCounter(tokenizer.path)
    return SentencePieceCounter(tokenizer.path)


def chunks(text: str, counter: TokenCounter, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Pieces of `text` of about `size` characters whose token counts add up to the text's."""
    start = 0
    while len(text) - start > size:
        cut = _cut_after(text, start + size, counter.boundary)
        if cut < 0:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _cut_after(text: str, position: int, boundary: Boundary) -> int:
    """The index just past the first newline at or after `position` that `boundary` lets a chunk
    start after, or -1."""
    newline = text.find("\n", position)
    while newline != -1 and newline + 1 < len(text):
        following = text[newline + 1]
        if following.isalpha() if boundary == "letter" else following not in "\r\n":
            return newline + 1
        newline = text.find("\n", newline + 1)
    return -1


def count_chunk(counter: TokenCounter, chunk: str, first: bool, last: bool) -> int:
    """Tokens `chunk` takes inside its text: counted between anchors that reproduce its neighbours."""
    before = "" if first else _ANCHOR
    # Something follows the chunk in the whole text; its trailing line break must not group with the
    # end of the string instead (a letter stands in for what follows).
    after = "" if last else _FOLLOWER
    anchors = counter.count(before) if before else 0
    if after:
        anchors += counter.count(_ANCHOR + after) - counter.count(_ANCHOR)
    return counter.count(before + chunk + after) - anchors
