"""How the simulator counts prompt tokens, and how to write a prompt of an exact simulated size.

Given a tokenizer file (`kvgate sim --tokenizer`), a text holds what that tokenizer counts: what a
capacity planner needs, since bytes/4 is off by a quarter on real text (7.7k real tokens read as
10.1k). Without one, the rule is ceil(UTF-8 bytes / 4); a request's prompt is the sum over its text
parts. That rule is deterministic and needs no tokenizer file. Prompts built by `make_prompt` are made of
common three-letter English words each preceded by a space (" the", " and", ...): every such word is
exactly four bytes and one token for Llama- and Mistral-family tokenizers, so the simulator's count,
the gate's estimate and a real tokenizer agree on them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

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


def tokenizer_counter(path: Path) -> Callable[[str], int]:
    """Tokens of a text as the tokenizer file at `path` (sentencepiece or tokenizer.json) counts them,
    without special tokens; ConfigError when the file is missing or not a tokenizer."""
    from kvgate.estimate.exact import TokenizerFile, load_counter

    return load_counter(TokenizerFile.open(path)).count


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
