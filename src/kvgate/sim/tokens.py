"""How the simulator counts prompt tokens, and how to write a prompt of an exact simulated size.

The rule: a text holds ceil(UTF-8 bytes / 4) tokens, and a request's prompt is the sum over its text
parts. It is deterministic and needs no tokenizer file. Prompts built by `make_prompt` are made of
common three-letter English words each preceded by a space (" the", " and", ...): every such word is
exactly four bytes and one token for Llama- and Mistral-family tokenizers, so the simulator's count,
the gate's estimate and a real tokenizer agree on them.
"""

from __future__ import annotations

import random

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
