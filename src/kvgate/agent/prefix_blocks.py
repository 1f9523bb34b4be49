"""The agent's model of its engine's prefix cache: the prompt blocks it holds, shared or idle (pure).

A reservation that carries a prefix chain (kvgate.request.prefix) holds the chain's blocks. A block
that several live reservations hold is one copy of KV in the engine: vLLM's block pool hands a cached
block to every request with that prefix and counts its references (vllm/v1/core/block_pool.py,
`touch`), SGLang's radix tree locks a shared node the same way. So a block is charged once, while any
reservation holds it.

When its last holder ends, the block stays in the engine's cache, evictable: here it becomes idle, kept
least recently used first, a chain's tail before its head (vLLM frees a request's blocks in reverse
"so that the tail blocks are evicted first", vllm/v1/core/kv_cache_manager.py `free` @ 003df29). A
request that finds an idle block skips its prefill, but takes the block back from the engine's free
pool, which costs KV as allocating it would: an idle block is charged again, in full.

Idle blocks are forgotten, least recently used first, when there are more than `max_blocks` blocks,
when they no longer fit in the KV the engine reports free (an engine evicts cached blocks only to make
room), and when the engine's own hit counters fall short of what was expected (kvgate.agent.prefix_audit).

Those are guesses. Where the agent follows the engine's KV events (kvgate.agent.prefix_events), a block
can be anchored to the engine block that holds its last token, and `judge` says whether that one is
cached (True), gone (False) or not known (None). An idle block judged gone is not cached; one judged
cached is the engine's own word, which the guesses above leave alone; an unanchored or unknown one is
guessed as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvgate.headroom.snapshot import NO_PREFIXES, PrefixChain, PrefixSummary


@dataclass(slots=True)
class _Block:
    tokens: int
    depth: int  # its place in the chain: 0 for a prompt's first block
    holders: int = 0
    anchor: int | None = None  # the engine block holding its last token, from the engine's events


Judge = Callable[[int], bool | None]


class PrefixBlocks:
    def __init__(self, max_blocks: int = 16384, summary_blocks: int = 1024, stride: int = 4) -> None:
        if min(max_blocks, summary_blocks, stride) < 1:
            raise ValueError("max_blocks, summary_blocks and stride must be >= 1")
        self._max_blocks = max_blocks
        self._summary_blocks = summary_blocks
        self._stride = stride
        self._live: dict[int, _Block] = {}
        self._idle: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.live_tokens = 0
        self.idle_tokens = 0
        self._generation = 0
        self._sampled: frozenset[int] | None = frozenset()
        self.judge: Judge | None = None  # whether an anchor is cached, set by whoever follows events

    def __len__(self) -> int:
        return len(self._live) + len(self._idle)

    def cached_blocks(self, chain: PrefixChain) -> int:
        """Leading blocks of `chain` the engine is believed to hold, in use or idle (an idle one the
        engine's events say is gone is not)."""
        count = 0
        for block in chain.blocks:
            if block not in self._live:
                idle = self._idle.get(block)
                if idle is None or self._verdict(idle) is False:
                    break
            count += 1
        return count

    def confirmed_blocks(self, chain: PrefixChain) -> tuple[int, int | None]:
        """Leading blocks of `chain` whose anchors the engine's events say are cached, and the anchor of
        the last of them."""
        count, anchor = 0, None
        for block in chain.blocks:
            entry = self._live.get(block) or self._idle.get(block)
            if entry is None or entry.anchor is None or self._verdict(entry) is not True:
                break
            count, anchor = count + 1, entry.anchor
        return count, anchor

    def anchor(self, block: int, engine_block: int | None) -> bool:
        """Anchor a block (live or idle) to the engine block holding its last token (None: unanchor)."""
        entry = self._live.get(block) or self._idle.get(block)
        if entry is None:
            return False
        entry.anchor = engine_block
        return True

    def anchor_of(self, block: int) -> int | None:
        entry = self._live.get(block) or self._idle.get(block)
        return None if entry is None else entry.anchor

    def unanchor_all(self) -> None:
        """Every anchor is unknown (the agent lost track of the engine's cache): back to guesses."""
        for entry in (*self._live.values(), *self._idle.values()):
            entry.anchor = None
        self._changed()

    def forget(self, blocks: Iterable[int]) -> int:
        """Forget the idle ones of `blocks` (the engine no longer holds them); the tokens forgotten.
        A live one loses its anchor: its holder's request may store it again."""
        forgotten = 0
        for block in blocks:
            entry = self._idle.pop(block, None)
            if entry is not None:
                self.idle_tokens -= entry.tokens
                forgotten += entry.tokens
            elif (live := self._live.get(block)) is not None:
                live.anchor = None
        self._changed()
        return forgotten

    def forget_idle(self) -> int:
        """Forget every idle block (the engine's cache is empty); the tokens forgotten."""
        forgotten = self.idle_tokens
        self._idle.clear()
        self.idle_tokens = 0
        for entry in self._live.values():
            entry.anchor = None
        self._changed()
        return forgotten

    def refresh(self) -> None:
        """What `judge` says may have changed: sample the summary again."""
        self._changed()

    def shared_blocks(self, chain: PrefixChain) -> int:
        """Leading blocks of `chain` that live reservations hold (a holder holds all blocks before one)."""
        count = 0
        for block in chain.blocks:
            if block not in self._live:
                break
            count += 1
        return count

    def cost(self, chain: PrefixChain) -> int:
        """Tokens holding `chain` would add to the charged blocks: every block not held live."""
        cost = 0
        for block in chain.blocks[self.shared_blocks(chain) :]:
            idle = self._idle.get(block)
            cost += idle.tokens if idle is not None else chain.block_tokens
        return cost

    def hold(self, chain: PrefixChain) -> int:
        """Hold every block of `chain`; the tokens of blocks that were not held live (now charged)."""
        charged = 0
        for depth, block in enumerate(chain.blocks):
            entry = self._live.get(block)
            if entry is None:
                entry = self._idle.pop(block, None)
                if entry is None:
                    entry = _Block(chain.block_tokens, depth)
                else:
                    self.idle_tokens -= entry.tokens
                self._live[block] = entry
                self.live_tokens += entry.tokens
                charged += entry.tokens
            entry.holders += 1
        self._changed()
        self._trim(self._max_blocks)
        return charged

    def release(self, blocks: tuple[int, ...]) -> int:
        """Let go of blocks one reservation held; the tokens no longer charged (blocks now idle)."""
        freed = 0
        for block in reversed(blocks):  # the tail first: the head becomes the most recently used
            entry = self._live.get(block)
            if entry is None:
                continue
            entry.holders -= 1
            if entry.holders == 0:
                del self._live[block]
                self.live_tokens -= entry.tokens
                self._idle[block] = entry
                self.idle_tokens += entry.tokens
                freed += entry.tokens
        self._changed()
        self._trim(self._max_blocks)
        return freed

    def fit_idle(self, free_tokens: int) -> int:
        """Forget the least recently used idle blocks until the rest fit in `free_tokens`: an engine
        keeps cached blocks only in KV it has free. Returns the tokens forgotten."""
        return self.evict(self.idle_tokens - max(0, free_tokens))

    def evict(self, tokens: int) -> int:
        """Forget at least `tokens` of guessed idle blocks, least recently used first; the tokens
        forgotten. Blocks the engine's events say are cached are not guesses: they stay."""
        if tokens <= 0:
            return 0
        victims, evicted = [], 0
        for block, entry in self._idle.items():
            if evicted >= tokens:
                break
            if self._verdict(entry) is not True:
                victims.append(block)
                evicted += entry.tokens
        for block in victims:
            self.idle_tokens -= self._idle.pop(block).tokens
        if evicted:
            self._changed()
        return evicted

    def summary(self, saved_tokens: int) -> PrefixSummary:
        """The blocks a gate needs to place repeats: every `stride`-th block of each chain, blocks in use
        first, then idle ones most recently used first, at most `summary_blocks` of them."""
        if self._sampled is None:
            self._sampled = frozenset(self._sample())
        if not self._sampled and not saved_tokens and not len(self):
            return NO_PREFIXES
        indexed = self.live_tokens + self.idle_tokens
        return PrefixSummary(self._sampled, indexed, saved_tokens, self._generation)

    def _sample(self) -> list[int]:
        found: list[int] = []
        last = self._stride - 1
        for source in (self._live.items(), reversed(self._idle.items())):
            for block, entry in source:
                gone = not entry.holders and self._verdict(entry) is False
                if entry.depth % self._stride == last and not gone:
                    found.append(block)
                    if len(found) == self._summary_blocks:
                        return found
        return found

    def _trim(self, max_blocks: int) -> None:
        while len(self) > max_blocks and self._idle:
            _, entry = self._idle.popitem(last=False)
            self.idle_tokens -= entry.tokens

    def _verdict(self, entry: _Block) -> bool | None:
        if entry.anchor is None or self.judge is None:
            return None
        return self.judge(entry.anchor)

    def _changed(self) -> None:
        self._generation += 1
        self._sampled = None
