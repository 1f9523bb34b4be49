"""The agent following vLLM's KV-cache events: messages decoded as vLLM 0.32 sends them, the engine's
cache kept from them, reservations linked to the blocks their requests stored, and the prefix index
made the engine's word: a removed block forgotten, a cleared or restarted engine emptied, missed
batches turning knowledge back into guesses; and the ZeroMQ feed with vLLM's replay protocol."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
import pytest
import zmq
from fixtures.engines import rules
from fixtures.engines.pages import Vllm
from waiting import until, until_async

from kvgate.agent.engine_cache import EngineCache
from kvgate.agent.in_process import ManualClock
from kvgate.agent.kv_events import (
    Batch,
    Break,
    Cleared,
    KvEventError,
    Removed,
    Sequencer,
    Stored,
    decode,
    decode_payload,
)
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.server import Agent
from kvgate.agent.sources.engines import read_engine_page
from kvgate.agent.sources.fake_engine import FakeEngineMetrics
from kvgate.agent.sources.kv_events import KvEventFeed
from kvgate.agent.sources.scrape import EngineScraper
from kvgate.headroom.snapshot import PrefixChain
from kvgate.localports import free_port

# A document of four prefix blocks of 256 estimated tokens; the engine stores blocks of 128, so block
# i ends in engine block 2i + 1.
DOC = PrefixChain((11, 12, 13, 14), 256)
ENGINE = tuple(range(901, 909))  # the engine's eight blocks for it, depth 0..7
PAGE = Vllm(blocks=(257,), usage=(0.0,), block_size=128, kv_cache_size_tokens=32_896).page()


def stored(seq: int, blocks: tuple[int, ...], parent: int | None, session: str | None = None) -> Batch:
    return Batch(seq, 0.0, 0, (Stored(blocks, parent, 128, session),))


def removed(seq: int, *blocks: int) -> Batch:
    return Batch(seq, 0.0, 0, (Removed(blocks),))


class Node:
    """A NodeState on a vLLM page with prefix caching, following (or not) its KV events."""

    def __init__(self, events: bool = True) -> None:
        self.clock = ManualClock()
        settings = NodeSettings(
            "n", "e:1", safety_ratio=1.0, kv_events="tcp://127.0.0.1:5557" if events else ""
        )
        self.state = NodeState(settings, self.clock, uses_engine=True, uses_nvml=False)
        self.state.observe_engine(read_engine_page(PAGE))
        self.seq = 0

    def ask(self, request_id: str, chain: PrefixChain = DOC, output: int = 0) -> int:
        """Reserve for a request of `chain` (a prompt of 2,000 - `output` tokens); the tokens the agent
        expects the engine to find cached."""
        self.state.observe_engine(read_engine_page(PAGE))
        outcome = self.state.reserve(request_id, 2_000, 0, prefix=chain, output_tokens=output)
        assert outcome.granted, outcome
        return outcome.cached_tokens

    def events(self, *batches: Batch) -> None:
        self.state.observe_kv_events(list(batches))

    def end(self, request_id: str) -> None:
        """The gate releases; a second later the agent settles what the request stored."""
        self.state.release(request_id)
        self.events()
        self.clock.advance(1.5)
        self.events()


def served(node: Node, request_id: str = "a") -> None:
    """`request_id` asked for DOC, its request stored the eight engine blocks, and it ended."""
    assert node.ask(request_id) == 0
    node.events(stored(0, ENGINE, None, session=request_id))
    node.end(request_id)


# --- the messages -----------------------------------------------------------------------------------


def vllm_payload(events: list[dict[str, Any]]) -> bytes:
    """A KVEventBatch as vLLM 0.32 encodes it (msgspec, omit_defaults, tagged maps)."""
    packed: bytes = msgpack.packb([1764600000.5, events, 0])
    return packed


def test_a_vllm_message_decodes_to_the_events_the_index_follows() -> None:
    store = {
        "type": "BlockStored",
        "block_hashes": [7058825315993359992, 14061387798400482730],
        "parent_block_hash": None,
        "token_ids": list(range(256)),
        "block_size": 128,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "session_id": "req-1",
    }
    frames = [
        b"",
        (41).to_bytes(8, "big"),
        vllm_payload(
            [
                store,
                {**store, "group_idx": 1},  # a second KV group: not the one lookups walk first
                {**store, "medium": "CPU"},  # an offloading tier
                {"type": "BlockRemoved", "block_hashes": [b"\x00" * 24 + b"\x01" * 8], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
                {"type": "SomethingNew", "x": 1},
            ]
        ),
    ]
    batch = decode(frames)
    assert (batch.seq, batch.rank, batch.ignored) == (41, 0, 3)
    assert batch.events == (
        Stored((7058825315993359992, 14061387798400482730), None, 128, "req-1"),
        Removed((int.from_bytes(b"\x01" * 8, "big"),)),
        Cleared(),
    )


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"", b"\x00" * 8], "3 frames"),
        ([b"", b"\x00" * 4, b""], "8-byte sequence"),
        ([b"", b"\x00" * 8, b"\xc1"], "not msgpack"),
        ([b"", b"\x00" * 8, msgpack.packb({"ts": 1})], "not \\[ts, events, rank\\]"),
        ([b"", b"\x00" * 8, msgpack.packb([1.0, [[1, 2]], 0])], "tagged map"),
        ([b"", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockRemoved"}], 0])], "without block_hashes"),
    ],
)
def test_a_message_that_is_not_a_batch_is_a_kv_event_error(frames: list[bytes], message: str) -> None:
    with pytest.raises(KvEventError, match=message):
        decode(frames)


def test_the_sequence_says_what_was_missed() -> None:
    seq = Sequencer()
    assert seq.check(0) is None
    seq.take(0)
    assert seq.check(1) is None
    seq.take(1)
    gap = seq.check(5)
    assert gap is not None and (gap.kind, gap.first, gap.last) == (Break.GAP, 2, 4)
    seq.take(5)
    restart = seq.check(0)
    assert restart is not None and restart.kind is Break.RESTART
    late = Sequencer().check(7)
    assert late is not None and (late.kind, late.first, late.last) == (Break.GAP, 0, 6)


# --- the engine's cache -----------------------------------------------------------------------------


def test_the_cache_knows_depths_and_a_block_is_reachable_only_with_everything_before_it() -> None:
    cache = EngineCache()
    cache.store(Stored(ENGINE[:3], None, 128))
    cache.store(Stored(ENGINE[3:], ENGINE[2], 128))
    assert [cache.depth(b) for b in ENGINE] == list(range(8))
    assert cache.ancestor(ENGINE[7], 3) == ENGINE[3] and cache.ancestor(ENGINE[2], 5) is None
    assert cache.reachable(ENGINE[7]) is True
    assert cache.remove((ENGINE[4],)) == [ENGINE[4]]
    assert cache.reachable(ENGINE[7]) is False and cache.reachable(ENGINE[3]) is True
    cache.store(Stored((ENGINE[4],), ENGINE[3], 128))  # computed again: the same content, the same hash
    assert cache.reachable(ENGINE[7]) is True


def test_a_hash_held_by_two_blocks_stays_until_both_leave() -> None:
    cache = EngineCache()
    cache.store(Stored(ENGINE[:2], None, 128))
    cache.store(Stored((ENGINE[1],), ENGINE[0], 128))  # the same block computed by a second request
    assert cache.remove((ENGINE[1],)) == [] and cache.reachable(ENGINE[1]) is True
    assert cache.remove((ENGINE[1],)) == [ENGINE[1]] and cache.reachable(ENGINE[1]) is False


def test_after_missed_batches_a_block_is_unknown_until_a_store_names_it() -> None:
    cache = EngineCache()
    cache.store(Stored(ENGINE[:4], None, 128))
    cache.lose_track()
    assert cache.reachable(ENGINE[3]) is None
    cache.store(Stored((999,), ENGINE[1], 128))  # a request found ENGINE[0..1] cached
    assert cache.reachable(ENGINE[1]) is True and cache.reachable(ENGINE[3]) is None
    assert cache.depth(999) == 2


def test_a_chain_begun_before_the_agent_has_no_depth_and_the_cache_is_bounded() -> None:
    cache = EngineCache(max_blocks=4)
    cache.store(Stored((5, 6), 4, 128))  # its parent was stored before the agent listened
    assert cache.depth(6) is None and cache.reachable(6) is None
    assert cache.store(Stored((7, 8, 9), None, 128)) is None, "past the bound: lost track"
    assert len(cache) == 0


# --- the prefix index made the engine's --------------------------------------------------------------


def test_a_request_s_stores_anchor_its_prefix_blocks_and_a_repeat_is_predicted() -> None:
    node = Node()
    served(node)
    assert node.ask("b") == 4 * 256
    source = node.state.snapshot(0).prefix_source
    assert "vLLM KV events from tcp://127.0.0.1:5557: 8 blocks cached (1,024 tokens)" in source
    assert "1 reservations linked" in source


def test_a_removed_block_is_forgotten_and_what_follows_it_is_no_longer_found() -> None:
    node = Node()
    served(node)
    node.events(removed(1, ENGINE[5]))  # the engine block under prefix block 2
    assert node.state.prefix_forgotten == 256, "counted with what the guesses forget"
    assert node.ask("b") == 2 * 256
    summary = node.state.snapshot(0).prefix
    assert summary.indexed_tokens == 4 * 256, "b holds the whole chain again"


def test_without_events_the_same_eviction_goes_unseen() -> None:
    node = Node(events=False)
    assert node.ask("a") == 0
    node.end("a")
    assert node.ask("b") == 4 * 256, "the guess: cached while it fits in free KV"


def test_a_cleared_cache_or_a_restarted_engine_holds_nothing() -> None:
    node = Node()
    served(node)
    node.events(Batch(1, 0.0, 0, (Cleared(),)))
    assert node.ask("b") == 0
    node.events(stored(2, ENGINE, None, session="b"))
    node.end("b")
    assert node.ask("c") == 4 * 256
    node.end("c")
    # The publisher counts from 0 again: the engine restarted with an empty cache.
    node.events(stored(0, (777,), None))
    assert node.ask("d") == 0
    source = node.state.snapshot(0).prefix_source
    assert "1 restarts" in source and "started again" in source


def test_an_engine_restart_seen_on_its_page_empties_the_index() -> None:
    node = Node()
    served(node)
    busy = Vllm(blocks=(257,), usage=(0.0,), block_size=128, generation=(500,)).page()
    node.state.observe_engine(read_engine_page(busy))
    node.state.observe_engine(read_engine_page(PAGE))  # its generation counter went back to 0
    assert node.ask("b") == 0


def test_blocks_a_request_never_stored_are_forgotten_when_it_ends() -> None:
    node = Node()
    assert node.ask("a") == 0
    node.events(stored(0, ENGINE[:5], None, session="a"))  # the prompt was shorter than estimated
    node.end("a")
    assert node.ask("b") == 2 * 256


def test_the_block_holding_the_prompt_s_last_token_is_never_found() -> None:
    node = Node()
    assert node.ask("a", output=1_000) == 0  # a 1,000-token prompt: engine blocks 0..6 can be hits
    node.events(stored(0, ENGINE, None, session="a"))  # block 7 holds its last tokens and its output
    node.end("a")
    assert node.ask("b") == 3 * 256


def test_missed_batches_turn_knowledge_back_into_guesses() -> None:
    node = Node()
    served(node)
    node.events(removed(5, ENGINE[7]))  # batches 1..4 were missed; then the last block left
    source = node.state.snapshot(0).prefix_source
    assert "1 gaps" in source and "batches 1..4 were missed" in source
    # Prefix blocks 0..2: unconfirmed, so guessed (cached); block 3: its engine block is gone.
    assert node.ask("b") == 3 * 256


def test_stores_without_a_session_are_linked_by_arrival() -> None:
    node = Node()
    other = PrefixChain((21, 22), 256)
    assert node.ask("a") == 0
    assert node.ask("x", other) == 0
    node.events(stored(0, ENGINE, None), stored(1, (801, 802, 803, 804), None))
    node.end("a")
    node.end("x")
    node.events(removed(2, 802))
    assert node.ask("b") == 4 * 256 and node.ask("y", other) == 0


def test_once_stores_carry_sessions_an_untagged_one_is_other_traffic() -> None:
    node = Node()
    served(node)
    assert node.ask("b", PrefixChain((31, 32), 256)) == 0
    node.events(stored(1, (801, 802, 803, 804), None))  # a request that came without X-Session-ID
    node.end("b")
    assert node.ask("c", PrefixChain((31, 32), 256)) == 512, "not linked: guessed as before"
    node.end("c")
    node.events(removed(2, 802))
    assert node.ask("d", PrefixChain((31, 32), 256)) == 512, "802 was not b's"


# --- the feed ---------------------------------------------------------------------------------------


def publish(socket: zmq.Socket[bytes], seq: int, blocks: tuple[int, ...]) -> None:
    payload = vllm_payload(
        [
            {
                "type": "BlockStored",
                "block_hashes": list(blocks),
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 128,
                "medium": "GPU",
            }
        ]
    )
    socket.send_multipart([b"", seq.to_bytes(8, "big"), payload])


def test_the_feed_binds_for_vllm_to_connect_and_asks_its_replay_socket_for_what_it_missed() -> None:
    port, replay_port = free_port(), free_port()
    feed = KvEventFeed(f"tcp://127.0.0.1:{port}", bind=True, replay=f"tcp://127.0.0.1:{replay_port}")
    feed.start()
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    router = context.socket(zmq.ROUTER)
    try:
        pub.connect(f"tcp://127.0.0.1:{port}")
        router.bind(f"tcp://127.0.0.1:{replay_port}")
        # PUB drops what it sends before the subscription reaches it: send until one arrives.
        seen: list[Batch] = []
        until(lambda: publish(pub, 0, (1,)) or seen.extend(feed.drain()) or seen, "the first batch")
        assert seen[0].seq == 0
        publish(pub, 3, (4,))  # 1 and 2 were missed: the feed asks for them
        client, empty, start = router.recv_multipart()
        assert (empty, int.from_bytes(start, "big")) == (b"", 1)
        for seq in (1, 2):  # as vLLM 0.32 answers: (topic, seq, payload), then (-1, b"")
            frames = [b"", seq.to_bytes(8, "big"), decode_payload_bytes(seq)]
            router.send_multipart([client, b"", *frames])
        router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        got: list[Batch] = []
        until(lambda: got.extend(feed.drain()) or len(got) >= 3, "the replayed batches and the new one")
        assert [b.seq for b in got if b.seq > 0] == [1, 2, 3]
        assert feed.replayed == 2
    finally:
        pub.close(0)
        router.close(0)
        context.term()
        feed.close()


def decode_payload_bytes(seq: int) -> bytes:
    payload = vllm_payload(
        [
            {
                "type": "BlockStored",
                "block_hashes": [100 + seq],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 128,
                "medium": "GPU",
            }
        ]
    )
    assert decode_payload(seq, payload).events
    return payload


def test_the_feed_drops_the_oldest_when_the_loop_falls_behind() -> None:
    port = free_port()
    feed = KvEventFeed(f"tcp://127.0.0.1:{port}", bind=False, max_queued=2)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    feed.start()
    try:
        seen: list[Batch] = []
        until(lambda: publish(pub, 0, (1,)) or seen.extend(feed.drain()) or seen, "the first batch")
        # Batch 0 went out until one arrived: more may still be on the way. One marker, sent once on
        # the now-connected socket, comes after them all (ZeroMQ keeps a connection's order).
        publish(pub, 100, (100,))
        until(lambda: any(b.seq == 100 for b in feed.drain()), "the marker after the first batches")
        base = feed.received
        for seq in range(1, 6):
            publish(pub, seq, (seq,))
        until(lambda: feed.received >= base + 5, "every batch received")
        assert [b.seq for b in feed.drain()] == [4, 5]
    finally:
        pub.close(0)
        context.term()
        feed.close()


def test_the_agent_s_loop_follows_the_feed() -> None:
    async def scenario() -> None:
        engine = FakeEngineMetrics(num_gpu_blocks=256, block_size=128)
        port = free_port()
        endpoint = f"tcp://127.0.0.1:{port}"
        settings = NodeSettings("n", "e:1", period_s=0.05, engine_stale_after_s=30.0, kv_events=endpoint)
        feed = KvEventFeed(endpoint, bind=True)
        agent = Agent(settings, EngineScraper(await engine.start(), 1.0), kv_events=feed)
        await agent.start("127.0.0.1:0")
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.connect(endpoint)
        try:
            await until_async(lambda: agent.state.budget().healthy, "a first scrape")
            assert agent.state.reserve("a", 2_000, 0, prefix=DOC).granted
            payload = vllm_payload(
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": list(ENGINE),
                        "parent_block_hash": None,
                        "token_ids": [],
                        "block_size": 128,
                        "medium": "GPU",
                        "session_id": "a",
                    }
                ]
            )

            def linked() -> bool:
                pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
                return "1 reservations linked" in agent.state.snapshot(0).prefix_source

            await until_async(linked, "the agent to link the store")
        finally:
            pub.close(0)
            context.term()
            await agent.stop(grace_s=0)
            await engine.stop()

    asyncio.run(scenario())


def live_messages() -> list[tuple[str, list[bytes]]]:
    path = rules.LIVE / f"{rules.VLLM_VERSION}-kv-events.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row["socket"], [bytes.fromhex(frame) for frame in row["frames"]]) for row in rows]


def test_the_live_engine_s_messages_decode_and_link_by_session() -> None:
    """vLLM 0.32.0's own messages (tests/fixtures/engines/live): a 1,208-token document asked twice with
    X-Session-ID req-1 and req-2, and its replay socket's answer."""
    published = [decode(frames) for socket, frames in live_messages() if socket == "sub"]
    assert [b.seq for b in published] == [0, 1, 2] and all(b.ignored == 0 for b in published)
    (first,), (decoded,), (again,) = (b.events for b in published)
    assert isinstance(first, Stored) and isinstance(decoded, Stored) and isinstance(again, Stored)
    # 9 prompt blocks of 128 (1,152 tokens: what vLLM then found), then the block its output filled;
    # the repeat found the 9 and computed that block again: the same hash, a second copy.
    assert (len(first.hashes), first.parent, first.block_tokens, first.session) == (9, None, 128, "req-1")
    assert (decoded.parent, decoded.session) == (first.hashes[-1], "req-1")
    assert (again.hashes, again.parent, again.session) == (decoded.hashes, first.hashes[-1], "req-2")
    replayed = [frames for socket, frames in live_messages() if socket == "replay"]
    assert [len(frames) for frames in replayed] == [4, 4, 4, 4], "(empty, topic, seq, payload)"
    assert [decode_payload(int.from_bytes(f[2], "big"), f[3]) for f in replayed[:3]] == published
    assert int.from_bytes(replayed[3][2], "big", signed=True) == -1 and replayed[3][3] == b""
    node = Node()
    chain = PrefixChain((41, 42, 43, 44), 256)  # the gate's 4 blocks of the document's first 1,024
    assert node.ask("req-1", chain, output=2_000 - 1_208) == 0
    node.events(published[0], published[1])
    node.end("req-1")
    assert node.ask("req-2", chain, output=2_000 - 1_208) == 1_024
    node.events(published[2])
    assert node.state.prefix_events is not None and len(node.state.prefix_events.cache) == 10
