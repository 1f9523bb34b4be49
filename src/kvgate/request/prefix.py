"""A prompt's prefix blocks, as an engine's prefix cache keys it, without tokenizing (pure).

vLLM and SGLang keep a prompt's KV in blocks and find a new prompt's longest cached prefix by hashing
its blocks, each hash chained on the one before (vllm/v1/core/kv_cache_utils.py, hash_block_tokens;
SGLang's radix tree keys the same prefixes by their tokens). The gate cannot tokenize every long prompt
on the estimate path, so it cuts the prompt's text instead: blocks of `block_tokens` x BYTES_PER_TOKEN
UTF-8 bytes, a fixed ratio (the byte-class estimator is not needed to find where two prompts part:
identical text is identical bytes). Each block's hash covers the block and the previous hash, so two
prompts share block i exactly when every byte up to its end is the same. Only full blocks are hashed,
as engines cache only full blocks; a block stands for its share of the prompt's estimated text tokens.

The texts are taken in the order the request carries them (kvgate.request.parse: system and messages
in order) and joined with a separator byte, so ["ab", "c"] and ["a", "bc"] differ. The chain starts
from the model's name: prompts for different models share nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvgate.headroom.snapshot import PrefixChain

# The fixed ratio that sizes a block in bytes. Llama and Mistral tokenizers give more than one token
# per 4 bytes of real text, so a block most often holds more tokens than its share says (the share,
# not this ratio, is what a reservation counts).
BYTES_PER_TOKEN = 4
_SEPARATOR = b"\x1e"
# JSON keys of definitions that chat templates render ahead of the messages (tool lists in the
# system prompt). RequestShape carries their text after the messages, so a chain over it would claim
# that two prompts with different tools share their messages; such requests get no chain.
_DEFINITION_KEYS = (b'"tools"', b'"functions"')


def prefix_chain(
    texts: Sequence[str], text_tokens: int, block_tokens: int, max_blocks: int, namespace: str = ""
) -> PrefixChain | None:
    """The chain of `texts` (estimated at `text_tokens` tokens in all); None when not one block is full.

    At most `max_blocks` blocks are hashed: a longer prompt is matched on its first `max_blocks`.
    """
    if block_tokens < 1 or max_blocks < 1:
        raise ValueError(f"block_tokens and max_blocks must be >= 1, got {block_tokens}, {max_blocks}")
    data = _SEPARATOR.join(text.encode("utf-8", "surrogatepass") for text in texts)
    size = block_tokens * BYTES_PER_TOKEN
    count = min(len(data) // size, max_blocks)
    if count == 0 or text_tokens <= 0:
        return None
    view = memoryview(data)
    previous = hashlib.blake2b(namespace.encode(), digest_size=8).digest()
    blocks = []
    for start in range(0, count * size, size):
        previous = hashlib.blake2b(previous + view[start : start + size], digest_size=8).digest()
        blocks.append(int.from_bytes(previous, "little"))
    # The block's share of the estimate, never more than its bytes (no token is shorter than a byte).
    share = max(1, min(size, text_tokens * size // len(data)))
    return PrefixChain(tuple(blocks), share)


def renders_definitions_first(body: bytes) -> bool:
    """Whether a JSON body may carry tool definitions, which templates render before the messages."""
    return any(key in body for key in _DEFINITION_KEYS)
