"""The agent's prefix index, made the engine's own by its KV events (pure).

The gate cuts a prompt's text into prefix blocks (kvgate.request.prefix: hashes of text, about 256
estimated tokens each); vLLM caches token-id blocks of `block_size` (128 here) under its own hashes
(kvgate.agent.engine_cache). The gate does not tokenize long prompts, so the two cannot be matched by
content. They are matched through the request instead: the blocks an engine request stores are linked
to the reservation its gate made for it, and each of that reservation's prefix blocks is anchored to
the engine block holding its last token (block i of `t` estimated tokens ends near token (i+1)t, so
in engine block ((i+1)t - 1) // block_size: off by the estimate's error, a few percent, at most a block
or so at a chain's end). From then on the engine's word decides: an anchored block is cached while its
engine block is reachable, gone when that block is removed (BlockRemoved, AllBlocksCleared, a restart
of the engine) — and a block the engine never stored for its request (the prompt was shorter than
estimated) is forgotten when the request ends.

Which reservation a store belongs to:
- its `session_id` (vLLM 0.32 publishes the request's X-Session-ID header with each store) naming the
  reservation's request id: exact. Once stores carry such ids, untagged stores are other traffic;
- otherwise, a store continuing a linked request's latest block is that request's (chunked prefill,
  decode blocks);
- otherwise, by arrival: the oldest reservation not yet linked whose prompt the store can begin (no
  cached prefix and no parent beyond its first block, or a parent on its cached prefix's chain).
  Requests that reach the engine without a reservation can be mistaken for one: the gate sends
  X-Session-ID on the requests it reserved for (kvgate.names.SESSION_HEADER), so this is the fallback
  for a client that sent its own, or an older gate.
What the events cannot say (a reservation never linked, a block not anchored, a chain unconfirmed
after missed batches) stays with the agent's guesses (kvgate.agent.prefix_blocks).
Memory is bounded: the engine cache by its `max_blocks`, reservations followed by MAX_GRANTS (an
unlinked one is dropped after `pending_s`), anchors by the prefix index's own bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.agent.engine_cache import EngineCache
from kvgate.agent.kv_events import Batch, Break, Cleared, Lost, Removed, Sequencer, Stored
from kvgate.agent.prefix_blocks import PrefixBlocks
from kvgate.headroom.snapshot import PrefixChain

MAX_GRANTS = 4096
# A request's last stores may reach the agent just after its gate released it.
SETTLE_S = 1.0


@dataclass(slots=True)
class _Grant:
    request_id: str
    chain: PrefixChain
    granted_at: float
    base: int | None  # the engine block under its leading blocks found cached when granted
    base_depth: int  # that block's depth; -1 without one
    anchored: int  # leading blocks of its chain anchored
    prompt_tokens: int  # the prompt's estimate: blocks past its last whole one are never found
    leaf: int | None = None  # the latest engine block its request stored
    ended_at: float | None = None


@dataclass(slots=True)
class FeedStats:
    batches: int = 0
    last_seq: int | None = None
    gaps: int = 0
    restarts: int = 0
    clears: int = 0
    stored: int = 0
    removed: int = 0
    linked: int = 0  # reservations whose stores were found
    forgotten_tokens: int = 0  # tokens of idle prefix blocks the engine's word made the agent forget


class PrefixEvents:
    def __init__(
        self, prefixes: PrefixBlocks, endpoint: str, max_blocks: int = 262_144, pending_s: float = 60.0
    ) -> None:
        self.cache = EngineCache(max_blocks)
        self.endpoint = endpoint
        self.stats = FeedStats()
        self._prefixes = prefixes
        prefixes.judge = self.cache.reachable
        self._pending_s = pending_s
        self._grants: dict[str, _Grant] = {}
        self._leaves: dict[int, str] = {}  # engine block -> the request whose latest store ends there
        self._anchored: dict[int, set[int]] = {}  # engine block -> prefix blocks anchored to it
        self._tagged = False  # stores carry the session ids of reservations
        self._last_break = ""  # the latest break in the feed, for operators
        self._sequence = Sequencer()

    def granted(self, request_id: str, chain: PrefixChain, now: float, prompt_tokens: int) -> None:
        """A reservation carrying `chain` was granted for a prompt of about `prompt_tokens`: its
        request's stores will be looked for."""
        count, base = self._prefixes.confirmed_blocks(chain)
        depth = self.cache.depth(base) if base is not None else None
        if base is not None and depth is None:
            count, base = 0, None
        self._grants[request_id] = _Grant(
            request_id, chain, now, base, -1 if depth is None else depth, count, prompt_tokens
        )
        while len(self._grants) > MAX_GRANTS:
            self._drop(next(iter(self._grants.values())))

    def settle(self, now: float, live: frozenset[str] | set[str]) -> None:
        """Once a request has ended (`live` holds the reservations still held): the blocks of its
        chain its request never stored are not cached. A reservation never linked is given up."""
        for grant in list(self._grants.values()):
            if grant.ended_at is None and grant.request_id not in live:
                grant.ended_at = now
            if grant.ended_at is not None and now - grant.ended_at >= SETTLE_S:
                self._finish(grant)
            elif grant.leaf is None and now - grant.granted_at > self._pending_s:
                self._drop(grant)

    def apply(self, batch: Batch) -> None:
        """One batch, in the order received: a sequence that does not follow on is a break first."""
        lost = self._sequence.check(batch.seq)
        if lost is not None:
            self._lost(lost)
        self._sequence.take(batch.seq)
        self.stats.batches += 1
        self.stats.last_seq = batch.seq
        for event in batch.events:
            if isinstance(event, Stored):
                self._stored(event)
            elif isinstance(event, Removed):
                self._removed(event)
            elif isinstance(event, Cleared):
                self.stats.clears += 1
                self._cleared()

    def engine_restarted(self) -> None:
        """The engine's page says it restarted (its counters went back): its cache is empty."""
        self.stats.restarts += 1
        self._cleared()

    def describe(self) -> str:
        s = self.stats
        where = f"vLLM KV events from {self.endpoint}"
        if s.batches == 0:
            return f"{where}: no batch received yet; prefixes guessed from reservations until one arrives"
        figures = (
            f"{len(self.cache):,} blocks cached ({self.cache.cached_tokens:,} tokens) after batch "
            f"{s.last_seq}, {s.linked} reservations linked, {s.gaps} gaps, {s.restarts} restarts"
        )
        return f"{where}: {figures}" + (f"; last break: {self._last_break}" if self._last_break else "")

    def _lost(self, lost: Lost) -> None:
        """A restart empties the engine's cache; missed batches leave what was known unconfirmed."""
        if lost.kind is Break.RESTART:
            self.stats.restarts += 1
            self._cleared()
        else:
            self.stats.gaps += 1
            self.cache.lose_track()
            self._prefixes.refresh()
        self._last_break = lost.why

    def _stored(self, event: Stored) -> None:
        added = self.cache.store(event)
        if added is None:  # more blocks than followed: start from nothing, the guesses take over
            self._prefixes.unanchor_all()
            self._anchored.clear()
            self._leaves.clear()
            self._last_break = f"the engine held more than {self.cache.max_blocks:,} blocks: lost track"
            return
        self.stats.stored += len(added)
        grant = self._owner(event)
        if grant is not None and added:
            self._extend(grant, added[-1][0])

    def _owner(self, event: Stored) -> _Grant | None:
        if event.session is not None:
            grant = self._grants.get(event.session)
            self._tagged = self._tagged or grant is not None
            return grant
        if event.parent is not None and (request_id := self._leaves.get(event.parent)) is not None:
            return self._grants.get(request_id)
        if self._tagged:
            return None
        for grant in self._grants.values():
            if grant.leaf is None and grant.ended_at is None and self._begins(grant, event.parent):
                return grant
        return None

    def _begins(self, grant: _Grant, parent: int | None) -> bool:
        """Whether a store with this parent can be the first of `grant`'s request."""
        if grant.base is None:
            if parent is None:
                return True
            depth = self.cache.depth(parent)
            return depth is not None and depth < self._end_block(grant.chain, 0)
        return parent is not None and self.cache.ancestor(parent, grant.base_depth) == grant.base

    def _extend(self, grant: _Grant, leaf: int) -> None:
        if grant.leaf is None:
            self.stats.linked += 1
        elif self._leaves.get(grant.leaf) == grant.request_id:
            del self._leaves[grant.leaf]
        grant.leaf = leaf
        self._leaves[leaf] = grant.request_id
        leaf_depth = self.cache.depth(leaf)
        if leaf_depth is None:
            return
        blocks = grant.chain.blocks
        # A lookup never finds the block holding the prompt's last token (vLLM computes that token
        # again: kv_cache_manager.py get_computed_blocks, max_cache_hit_length = num_tokens - 1); the
        # blocks after it hold output.
        tokens = self.cache.block_tokens or grant.chain.block_tokens
        deepest = min(leaf_depth, (grant.prompt_tokens - 1) // tokens - 1)
        changed = False
        while grant.anchored < len(blocks):
            depth = self._end_block(grant.chain, grant.anchored)
            engine_block = self.cache.ancestor(leaf, depth) if depth <= deepest else None
            if engine_block is None:
                break
            block = blocks[grant.anchored]
            previous = self._prefixes.anchor_of(block)
            if self._prefixes.anchor(block, engine_block):
                if previous is not None and previous != engine_block:
                    self._anchored.get(previous, set()).discard(block)
                self._anchored.setdefault(engine_block, set()).add(block)
                changed = True
            grant.anchored += 1
        if changed:
            self._prefixes.refresh()

    def _end_block(self, chain: PrefixChain, index: int) -> int:
        """The depth of the engine block holding the last token of the chain's block `index`."""
        tokens = self.cache.block_tokens or chain.block_tokens
        return ((index + 1) * chain.block_tokens - 1) // tokens

    def _removed(self, event: Removed) -> None:
        self.stats.removed += len(event.hashes)
        gone = []
        for engine_block in self.cache.remove(event.hashes):
            for block in self._anchored.pop(engine_block, ()):
                if self._prefixes.anchor_of(block) == engine_block:
                    gone.append(block)
        if gone:
            self.stats.forgotten_tokens += self._prefixes.forget(gone)
        else:
            self._prefixes.refresh()  # blocks anchored below a removed one are unreachable now

    def _cleared(self) -> None:
        self.cache.clear()
        self.stats.forgotten_tokens += self._prefixes.forget_idle()
        self._anchored.clear()
        self._leaves.clear()
        for grant in self._grants.values():
            grant.leaf, grant.base, grant.base_depth, grant.anchored = None, None, -1, 0

    def _finish(self, grant: _Grant) -> None:
        if grant.leaf is not None:
            never = [b for b in grant.chain.blocks[grant.anchored :] if self._prefixes.anchor_of(b) is None]
            self.stats.forgotten_tokens += self._prefixes.forget(never)
        self._drop(grant)

    def _drop(self, grant: _Grant) -> None:
        del self._grants[grant.request_id]
        if grant.leaf is not None and self._leaves.get(grant.leaf) == grant.request_id:
            del self._leaves[grant.leaf]
