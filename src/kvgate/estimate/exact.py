"""Exact token counts from a real tokenizer file: sentencepiece `.model` or Hugging Face `tokenizer.json`.

Counting a long text can stop half-way once the class is certain, so texts are counted in chunks. A
chunk boundary sits right after a newline that ends a line break: no sentencepiece piece of the
supported models spans a newline; byte-level pre-tokenizers also split there when a visible character
follows (they group a newline with the spaces after it), so for them the boundary waits for one. A
chunk is counted between anchors (a word and a newline before it, a letter after it) minus the
anchors' own tokens, so that a tokenizer's start-of-text rule (sentencepiece's dummy prefix, a
byte-level `add_prefix_space`) and its grouping of trailing whitespace apply only where they would on
the whole text. The chunk counts then add up to the count of the whole text (tests check this on
the corpus for both kinds of tokenizer).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from kvgate.errors import ConfigError

CHUNK_CHARS = 4096
# What a continuation chunk is counted behind: a word takes any prefix space, the newline ends it.
_ANCHOR = "a\n"
_FOLLOWER = "a"
TokenizerKind = Literal["sentencepiece", "huggingface"]


class TokenCounter(Protocol):
    # Whether a chunk may start with spaces (the tokenizer never joins a newline to what follows).
    @property
    def cuts_before_spaces(self) -> bool: ...

    def count(self, text: str) -> int: ...

    def max_piece_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TokenizerFile:
    """A tokenizer on disk, named by its content so a calibration can be matched to it."""

    path: Path
    kind: TokenizerKind
    sha256: str

    @classmethod
    def open(cls, path: Path) -> TokenizerFile:
        if not path.is_file():
            raise ConfigError(f"tokenizer file not found: {path}")
        kind: TokenizerKind = "huggingface" if path.name.endswith(".json") else "sentencepiece"
        return cls(path, kind, hashlib.sha256(path.read_bytes()).hexdigest())


def encodable(text: str) -> str:
    """The text with lone surrogates (which JSON's \\uD800 escapes produce) replaced by U+FFFD:
    neither tokenizer library accepts them."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class SentencePieceCounter:
    cuts_before_spaces = True

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
    cuts_before_spaces = False

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


# Worker processes load each tokenizer once and keep it for every count they run.
@functools.lru_cache(maxsize=8)
def load_counter(tokenizer: TokenizerFile) -> TokenCounter:
    if tokenizer.kind == "huggingface":
        return HuggingFaceCounter(tokenizer.path)
    return SentencePieceCounter(tokenizer.path)


def chunks(text: str, counter: TokenCounter, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Pieces of `text` of about `size` characters whose token counts add up to the text's."""
    avoid = "\r\n" if counter.cuts_before_spaces else " \t\r\n"
    start = 0
    while len(text) - start > size:
        cut = _cut_after(text, start + size, avoid)
        if cut < 0:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _cut_after(text: str, position: int, avoid: str) -> int:
    """The index just past the first newline at or after `position` not followed by `avoid`, or -1."""
    newline = text.find("\n", position)
    while newline != -1 and newline + 1 < len(text):
        if text[newline + 1] not in avoid:
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
