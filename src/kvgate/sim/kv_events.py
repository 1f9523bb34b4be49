"""KV-cache events as vLLM publishes them to cache-aware routers (pure: the events and their bytes).

vLLM's ZMQ publisher (vllm/distributed/kv_events.py @ 0181ea3, ZmqEventPublisher) sends one message
per engine step that changed the prefix cache, as three frames: the topic (UTF-8, "" by default), an
8-byte big-endian sequence number counted from 0 by each publisher, and one msgpack-encoded batch.
Each event is a map tagged by its class name under "type" (KVCacheEvent is a msgspec Struct with
`tag=True`):
- BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  when a request's full prompt blocks enter the prefix cache (scheduled, not yet computed);
- BlockRemoved: block_hashes, medium, when a cached block is reallocated (its hash leaves);
- AllBlocksCleared: when the whole cache is reset.
The batch is the positional array `[ts, events, data_parallel_rank]`, as vLLM's KV-events contract
(docs: "KVEventBatch is a positional array") has it and as vllm-router 0.1.17 requires (its
src/kv_index/wire.rs @ 0e7a5e1 and its decoder: "KV event batch must be an array", "KV event must be
a tagged map"; hashes unsigned integers or bytes). Hashes here are the simulator's own 64-bit chained
block hashes (kvgate.sim.blocks), as vLLM's default integer hashes are the last 8 bytes of its
digest: a router uses them only to link a block to its parent and to remove it; it matches requests
on the token ids, which are the simulator's (kvgate.sim.tokens), the same ids /tokenize and the
render endpoints answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"
# vLLM's KVEventsConfig defaults (vllm/config/kv_events.py): what /kv_event_sources reports per rank.
DEFAULT_HWM = 100_000
DEFAULT_BUFFER_STEPS = 10_000


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_events(
    hashes: Sequence[int], token_ids: Sequence[int], indices: Sequence[int], block_size: int
) -> list[BlockStored]:
    """The BlockStored events for a prompt's newly cached blocks `indices` (ascending): one per run of
    consecutive blocks, each naming the block before it as parent, as vLLM's block pool reports the
    blocks one step caches (block_pool.py, cache_full_blocks)."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return [
        BlockStored(
            block_hashes=tuple(hashes[run[0] : run[-1] + 1]),
            parent_block_hash=hashes[run[0] - 1] if run[0] else None,
            token_ids=tuple(token_ids[run[0] * block_size : (run[-1] + 1) * block_size]),
            block_size=block_size,
        )
        for run in runs
    ]


def _as_map(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM_GPU,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM_GPU}
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Iterable[KvEvent], ts: float, data_parallel_rank: int) -> bytes:
    """One KVEventBatch as msgpack."""
    payload: bytes = msgpack.packb([ts, [_as_map(e) for e in events], data_parallel_rank])
    return payload


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint DP rank `rank` publishes on, as vLLM offsets it (ZmqEventPublisher.
    offset_endpoint_port): a tcp port plus the rank (port 0 stays 0: each rank gets its own free
    port), `_dp<rank>` after any other address."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def message(topic: str, sequence: int, payload: bytes) -> list[bytes]:
    """The three ZMQ frames of one published batch."""
    return [topic.encode("utf-8"), sequence.to_bytes(8, "big"), payload]


def sources(endpoints: Sequence[str], topic: str) -> dict[str, dict[str, Any]]:
    """GET /kv_event_sources: each DP rank's resolved publisher configuration, keyed by the rank as a
    string (vLLM's docs/features/kv_events.md; the shape vllm-router's src/kv_index/discovery.rs reads,
    KvEventSourcesResponse). Empty when events are off."""
    return {
        str(rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": None,
            "buffer_steps": DEFAULT_BUFFER_STEPS,
            "hwm": DEFAULT_HWM,
            "topic": topic,
        }
        for rank, endpoint in enumerate(endpoints)
    }
