"""The simulator's KV events as vLLM publishes them, its end-of-sequence rule, and their encoding."""

from __future__ import annotations

import argparse

import msgpack
import pytest

from kvgate.errors import ConfigError
from kvgate.sim import cli
from kvgate.sim.engine import Engine, EngineConfig
from kvgate.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    message,
    rank_endpoint,
    sources,
    stored_events,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine(clock: Clock | None = None, **overrides: object) -> Engine:
    settings: dict[str, object] = {
        "kv_capacity_tokens": 96,
        "max_model_len": 96,
        "block_size": 16,
        "max_num_batched_tokens": 256,
        "kv_events": True,
    }
    settings.update(overrides)
    return Engine(EngineConfig(**settings), clock or Clock())  # type: ignore[arg-type]


def run_until_idle(e: Engine) -> None:
    while e.has_work():
        e.complete(e.schedule())


def ids(start: int, count: int) -> tuple[int, ...]:
    return tuple(range(start, start + count))


def test_a_prompt_s_full_blocks_are_stored_with_their_tokens_and_parent_chain() -> None:
    e = engine()
    e.add("a", 40, 1, (11, 12), token_ids=ids(1000, 40))
    step = e.schedule()
    assert e.take_kv_events() == [BlockStored((11, 12), None, ids(1000, 32), 16)]
    e.complete(step)
    assert e.take_kv_events() == [], "a step reports its changes once"


def test_a_cached_prefix_is_not_stored_again_and_new_blocks_name_their_parent() -> None:
    e = engine()
    e.add("a", 40, 1, (11, 12), token_ids=ids(1000, 40))
    run_until_idle(e)
    e.take_kv_events()
    e.add("b", 56, 1, (11, 12, 13), token_ids=(*ids(1000, 32), *ids(5000, 24)))
    run_until_idle(e)
    assert e.take_kv_events() == [BlockStored((13,), 12, ids(5000, 16), 16)]


def test_reallocating_a_cached_block_removes_its_hash_before_the_new_stores() -> None:
    e = engine()  # 6 blocks
    e.add("a", 64, 1, (1, 2, 3, 4), token_ids=ids(0, 64))
    run_until_idle(e)
    e.take_kv_events()
    # 4 cached free blocks, 2 never used: a 4-block prompt takes the 2 unused, then evicts 2 cached
    # (the tail of "a" first: freed in reverse, least recently used first).
    e.add("b", 64, 1, (5, 6, 7, 8), token_ids=ids(100, 64))
    run_until_idle(e)
    assert e.take_kv_events() == [BlockRemoved((4, 3)), BlockStored((5, 6, 7, 8), None, ids(100, 64), 16)]


def test_a_crash_clears_every_block() -> None:
    clock = Clock()
    e = engine(clock, on_exhaustion="crash")
    e.add("a", 80, 16, (1, 2, 3, 4, 5), token_ids=ids(0, 80))
    e.add("b", 80, 16, (6, 7, 8, 9, 10), token_ids=ids(100, 80))
    while not e.schedule().crashed:
        pass
    assert e.take_kv_events()[-1] == AllBlocksCleared()


def test_kv_events_need_the_token_ids_of_every_block() -> None:
    with pytest.raises(ValueError, match="token ids"):
        engine().add("a", 40, 1, (11, 12), token_ids=ids(0, 20))
    plain = engine(kv_events=False)
    plain.add("a", 40, 1, (11, 12))
    run_until_idle(plain)
    assert plain.take_kv_events() == []


def test_max_tokens_is_generated_exactly_and_ignore_eos_runs_to_the_model_len() -> None:
    e = engine(kv_events=False)
    assert e.add("budget", 10, 7) == 7
    assert e.add("eos", 10, None) <= 86
    assert e.add("ignored", 10, None, ignore_eos=True) == 86
    always = engine(kv_events=False, ignore_eos=True)
    assert always.add("any", 30, None) == 66
    run_until_idle(e)
    stats = e.stats()
    assert stats.finished_total == 3


def test_stored_events_split_runs_and_chain_parents() -> None:
    hashes = (10, 11, 12, 13, 14)
    tokens = tuple(range(10))
    assert stored_events(hashes, tokens, [0, 1, 3], 2) == [
        BlockStored((10, 11), None, (0, 1, 2, 3), 2),
        BlockStored((13,), 12, (6, 7), 2),
    ]


def test_a_batch_encodes_as_vllm_s_tagged_maps_in_a_positional_array() -> None:
    events = [BlockStored((7, 8), None, (1, 2, 3, 4), 2), BlockRemoved((5,)), AllBlocksCleared()]
    decoded = msgpack.unpackb(encode_batch(events, 12.5, 1))
    assert decoded == [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7, 8],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        1,
    ]
    # A 64-bit hash stays an unsigned integer on the wire.
    assert msgpack.unpackb(encode_batch([BlockRemoved((2**64 - 1,))], 0.0, 0))[1][0]["block_hashes"] == [
        2**64 - 1
    ]
    assert message("", 258, b"x") == [b"", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"x"]


def test_ranks_publish_on_offset_ports_and_are_listed_by_rank() -> None:
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert rank_endpoint("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    listed = sources(["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"], "")
    assert list(listed) == ["0", "1"]
    assert listed["1"]["endpoint"] == "tcp://127.0.0.1:5558"
    assert listed["0"]["publisher"] == "zmq"
    assert sources([], "") == {}


def test_the_cli_takes_ignore_eos_and_refuses_a_non_tcp_kv_endpoint() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    base = ["sim", "--listen", "127.0.0.1:1", "--kv-capacity-tokens", "40960"]
    assert parser.parse_args(base).ignore_eos is False
    assert parser.parse_args([*base, "--ignore-eos"]).ignore_eos is True
    assert parser.parse_args(base).kv_events_endpoint is None
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        cli.run(parser.parse_args([*base, "--kv-events-endpoint", "ipc:///tmp/kv"]))
