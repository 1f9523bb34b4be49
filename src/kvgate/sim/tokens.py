"""How the simulator counts prompt tokens, and how to write a prompt of an exact simulated size.

Given a tokenizer file (`kvgate sim --tokenizer`), a text holds what that tokenizer counts: what a
capacity planner needs, since bytes/4 is off by a quarter on real text (7.7k real tokens read as
10.1k). Without one, the rule is ceil(UTF-8 bytes / 4); a request's prompt is the sum over its text
parts. That rule is deterministic and needs no tokenizer file. Prompts built by `make_prompt` are made of
common three-letter English words each preceded by a space (" the", " and", ...): every such word is
exactly four bytes and one token for Llama- and Mistral-family tokenizers, so the simulator's count,
the gate's estimate and a real tokenizer agree on them.

Token ids (for /tokenize, the render endpoints and the KV-event feed) come from the same rule, so an
id list is always exactly as long as the count the simulator charges: without a tokenizer file each
token is its four bytes of the text read as a little-endian unsigned 32-bit integer (the last one
zero-padded); with one, the file's own ids (sentencepiece and tokenizer.json ids as vLLM's tokenizer
returns them without special tokens; tekken ids are tiktoken ranks, without mistral-common's offset
by the number of special tokens).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvgate.estimate.exact import (
    HuggingFaceCounter,
    SentencePieceCounter,
    TekkenCounter,
    TokenizerFile,
    encodable,
)

BYTES_PER_TOKEN = 4

# Each entry is four bytes and a single token for the common sentencepiece and BPE vocabularies.
# fmt: off
_WORDS = (
    " the", " and", " for", " you", " are", " not", " but", " all", " can", " was", " one", " has",
    " had", " her", " his", " him", " its", " our", " out", " new", " now", " see", " way", " may",
    " day", " use", " man", " get", " how", " who", " did", " any", " two", " old", " say", " she",
    " too", " own", " set", " put", " end", " why", " few", " run", " big", " ask", " lot",
)
# fmt: on


def count_text_tokens(text: str) -> int:
    """Tokens the simulator charges for one text part: ceil(UTF-8 bytes / 4)."""
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


class SimTokenizer(Protocol):
    """How the simulator reads text: the tokens it charges, their ids, and each id's entry in the
    vocabulary (vLLM's `token_strs`: the tokenizer's convert_ids_to_tokens)."""

    def count(self, text: str) -> int: ...

    def ids(self, text: str) -> list[int]: ...

    def pieces(self, ids: Sequence[int]) -> list[str]: ...


class ByteQuads:
    """The tokenizer-less rule: one token per four UTF-8 bytes."""

    def count(self, text: str) -> int:
        return count_text_tokens(text)

    def ids(self, text: str) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        data += bytes(-len(data) % BYTES_PER_TOKEN)
        return list(struct.unpack(f"<{len(data) // BYTES_PER_TOKEN}I", data))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [struct.pack("<I", i).rstrip(b"\0").decode("utf-8", "replace") for i in ids]


# The exact counters of kvgate.estimate, which also give the ids they count (same engine, same input).
class _SentencePieceTokenizer(SentencePieceCounter):
    def ids(self, text: str) -> list[int]:
        return list(self._processor.encode(encodable(text)))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [str(self._processor.id_to_piece(i)) for i in ids]


class _HuggingFaceTokenizer(HuggingFaceCounter):
    def ids(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(encodable(text), add_special_tokens=False).ids)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [str(self._tokenizer.id_to_token(i)) for i in ids]


class _TekkenTokenizer(TekkenCounter):
    def ids(self, text: str) -> list[int]:
        return list(self._encoding.encode_ordinary(encodable(text)))

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self._encoding.decode_single_token_bytes(i).decode("utf-8", "replace") for i in ids]


def load_tokenizer(path: Path) -> SimTokenizer:
    """The tokenizer file at `path` (sentencepiece, tokenizer.json or tekken), counting without special
    tokens as kvgate's exact estimator does; ConfigError when it is missing or not a tokenizer."""
    kind = TokenizerFile.open(path).kind
    if kind == "tekken":
        return _TekkenTokenizer(path)
    if kind == "huggingface":
        return _HuggingFaceTokenizer(path)
    return _SentencePieceTokenizer(path)


def make_prompt(tokens: int, rng: random.Random) -> str:
    """A text that `count_text_tokens` counts as exactly `tokens`."""
    if tokens < 0:
        raise ValueError(f"a prompt cannot hold {tokens} tokens")
    return "".join(rng.choices(_WORDS, k=tokens))


def output_word(index: int) -> str:
    """The text of one generated token (one simulated token, four bytes)."""
    return _WORDS[index % len(_WORDS)]


def vocabulary_size() -> int:
    return len(_WORDS)
