"""The simulated engine's KV blocks: vLLM's block pool with automatic prefix caching (pure).

As vLLM V1 keeps them (vllm/v1/core/block_pool.py and kv_cache_manager.py @ 003df29):
- A full block of prompt tokens is cached under a hash chained on the previous block's, so a block is
  found again only after the same tokens from the start. Blocks are registered as they are allocated
  for a step (`allocate_slots` caches the blocks the scheduled tokens fill), so a request scheduled
  in the next step already finds them.
- A cached block is shared: every request with that prefix references it (`touch`), and it is freed
  only when none does.
- Freed blocks go to a free queue, evicted least recently used first when a new block is needed
  (`get_new_blocks` pops the queue's head and drops its hash). A request's blocks are freed in reverse,
  so its tail goes before its head; blocks without a hash go to the front, evicted first
  (block_pool.py `free_blocks`).
Used blocks are those some request references: cached free blocks count as free, as in
`vllm:kv_cache_usage_perc`.
With `record_evictions`, the hashes that leave the cache are kept, in order, until `take_evicted`:
what vLLM's block pool reports as BlockRemoved (a hash leaves when its block is reallocated; freeing
a block alone removes nothing).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool, record_evictions: bool = False) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self.record_evictions = record_evictions
        self._evicted: list[int] = []
        self._refs: list[int] = []
        self._hash: list[int | None] = []
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Free blocks, the next to be taken (evicted) first.
        self._free: OrderedDict[int, None] = OrderedDict()
        self.reset()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def cached_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes`, at most `max_blocks` of them."""
        found: list[int] = []
        if not self.caching:
            return found
        for block_hash in hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the free queue (touching them takes them out of it)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` new blocks, evicting the least recently freed cached ones; None when too few are free."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            evicted = self._hash[block]
            if evicted is not None:
                self._hash[block] = None
                if self._cached.get(evicted) == block:
                    del self._cached[evicted]
                if self.record_evictions:
                    self._evicted.append(evicted)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def cache(self, block: int, block_hash: int) -> bool:
        """Register a full block's hash; a prefix already cached in another block keeps that one.
        True when the hash was registered here."""
        if self.caching and self._hash[block] is None and block_hash not in self._cached:
            self._hash[block] = block_hash
            self._cached[block_hash] = block
            return True
        return False

    def take_evicted(self) -> list[int]:
        """The hashes evicted since the last call, oldest first (recorded only with `record_evictions`)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def free(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def reset(self) -> None:
        """Every block free and nothing cached (the engine restarted)."""
        self._refs = [0] * self.num_blocks
        self._hash = [None] * self.num_blocks
        self._cached = {}
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._evicted = []


def prompt_block_hashes(parts: Sequence[tuple[str, str, int]], block_size: int) -> tuple[int, ...]:
    """Chained hashes of a prompt's full blocks of `block_size` simulated tokens.

    `parts` are (marker, text, tokens) in prompt order: the marker (a message's role) stands for the
    template tokens around the part, the text's `tokens` cover its UTF-8 bytes in equal shares. Two
    prompts share block i exactly when their parts agree up to its end.
    """
    hashes: list[int] = []
    previous = b""
    block = bytearray()
    room = block_size  # tokens the current block still needs
    for marker, text, tokens in parts:
        data = text.encode("utf-8", "surrogatepass")
        block += b"\x1e" + marker.encode() + b"\x1f"
        taken = 0
        while taken < tokens:
            step = min(room, tokens - taken)
            block += data[taken * len(data) // tokens : (taken + step) * len(data) // tokens]
            taken += step
            room -= step
            if room == 0:
                previous = hashlib.blake2b(previous + block, digest_size=8).digest()
                hashes.append(int.from_bytes(previous, "little"))
                block.clear()
                room = block_size
    return tuple(hashes)


def token_block_hashes(parts: Sequence[tuple[str, Sequence[int]]], block_size: int) -> tuple[int, ...]:
    """Chained hashes of a prompt's full blocks of `block_size` token ids, as vLLM keys its prefix cache
    (each block's hash covers the previous block's and its own ids).

    `parts` are (marker, token ids) in prompt order, the marker standing for the template tokens
    around the part as in `prompt_block_hashes`. With a real tokenizer a token is not an equal share
    of its text's bytes, so the server keys blocks by ids: two prompts share block i exactly when
    their parts' ids agree up to its end.
    """
    hashes: list[int] = []
    previous = b""
    block = bytearray()
    room = block_size
    width = array("Q").itemsize
    for marker, ids in parts:
        data = array("Q", ids).tobytes()
        block += b"\x1e" + marker.encode() + b"\x1f"
        taken = 0
        while taken < len(data):
            step = min(room * width, len(data) - taken)
            block += data[taken : taken + step]
            taken += step
            room -= step // width
            if room == 0:
                previous = hashlib.blake2b(previous + block, digest_size=8).digest()
                hashes.append(int.from_bytes(previous, "little"))
                block.clear()
                room = block_size
    return tuple(hashes)
