"""Prompt text for a trace request: one deterministic block of exactly 512 tokens per hash id.

A trace names its prompts only by block ids (kvgate.demo.trace); equal ids mean a shared prefix. Each
id becomes 512 words, each one token under the tokenizer the nodes count with, chosen by a hash of the
id alone, so equal ids give byte-identical text in every request, run and process. A prompt is its
blocks in order, the last one cut to the request's input length, its very first space dropped.

The words are common English words, kept only where the tokenizer reads the word, and the word
repeated after spaces, as one token each: sentencepiece, tekken and byte-level BPE models never merge
across a space, so blocks do not merge at their boundaries and a prompt counts as the sum of its
words. The mix reads as English prose to kvgate's fast estimator (word lengths, spaces). Without a
tokenizer file the simulators count ceil(UTF-8 bytes / 4): only three-letter words pass, and a prompt
of n words is 4n - 1 bytes, exactly n tokens. `PromptBlocks` checks the result once against the
tokenizer and refuses one it cannot match.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from kvgate.errors import ConfigError
from kvgate.sim.tokens import SimTokenizer

BLOCK_TOKENS = 512

# fmt: off
_ENGLISH = (
    "the of and to in is that for it with as was on be at by this had not are but from or have an "
    "they which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than can only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last us great old year off come since against go came "
    "right used take three states few house use place around home small found went say part once "
    "general high upon school every left number course war until always away something fact water "
    "less public put think almost hand enough far took head yet system better set nothing night end "
    "why called find look later point next program city business give group room president side "
    "social given present order national possible rather second face per among form important often "
    "early white case large big need four within felt along children best church ever power "
    "development light thing family interest members mind country area others done open god service "
    "certain kind problem different door thus help means whole perhaps name example action company "
    "local show whether five history gave today either act past having week body word half really "
    "field car words already information free cannot question air office making whose special major "
    "available known result street economic boy position reason change south board individual job "
    "areas west close turn love community true court force full"
)
# fmt: on


def _one_token_each(tokenizer: SimTokenizer, word: str) -> bool:
    return all(tokenizer.count(" ".join([word] * k)) == k for k in (1, 2, 3, 4))


class PromptBlocks:
    """Prompts of exact length under `tokenizer` (the one the nodes count with)."""

    def __init__(self, tokenizer: SimTokenizer) -> None:
        words = [f" {w}".encode("ascii") for w in _ENGLISH.split() if _one_token_each(tokenizer, w)]
        if len(words) < 16:
            raise ConfigError("the nodes' tokenizer reads too few English words as one token each")
        # The word each byte value of an id's hash picks.
        self._word_of_byte = tuple(words[value % len(words)] for value in range(256))
        self.block_text = functools.lru_cache(maxsize=16384)(self._block_text)
        probe = self.prompt((0, 1), 2 * BLOCK_TOKENS)
        if tokenizer.count(probe) != 2 * BLOCK_TOKENS:
            raise ConfigError(
                f"the nodes' tokenizer reads two synthesised blocks as {tokenizer.count(probe)} tokens, "
                f"not {2 * BLOCK_TOKENS}: it merges words, so trace prompts cannot be exact under it"
            )

    def _block_text(self, block_id: int) -> str:
        """The 512 words of one hash id, each preceded by its space."""
        digest = hashlib.shake_128(f"kvgate/trace-block/{block_id}".encode()).digest(BLOCK_TOKENS)
        return b"".join(map(self._word_of_byte.__getitem__, digest)).decode("ascii")

    def prompt(self, block_ids: Sequence[int], tokens: int) -> str:
        """The prompt of `tokens` tokens made of `block_ids` (one per 512 tokens, the last maybe partial)."""
        if tokens < 1 or len(block_ids) != -(-tokens // BLOCK_TOKENS):
            raise ValueError(
                f"{tokens} tokens need {-(-tokens // BLOCK_TOKENS)} block ids, got {len(block_ids)}"
            )
        last = tokens - BLOCK_TOKENS * (len(block_ids) - 1)
        head = "".join(map(self.block_text, block_ids[:-1]))
        tail = self.block_text(block_ids[-1])
        # The tail's first `last` words: cut before the space that would start word `last + 1`.
        cut = len(tail) if last == BLOCK_TOKENS else _nth_space(tail, last)
        return (head + tail[:cut])[1:]


def _nth_space(text: str, n: int) -> int:
    """The index of the (n+1)-th space of `text` (0-based n counts the leading one)."""
    index = -1
    for _ in range(n + 1):
        index = text.index(" ", index + 1)
    return index
