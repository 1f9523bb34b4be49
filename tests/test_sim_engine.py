"""The simulator's engine model against hand-computed KV accounting, scheduling, preemption and crash."""

from __future__ import annotations

import pytest

from kvgate.errors import ConfigError
from kvgate.sim.engine import Engine, EngineConfig, Step


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine(clock: Clock | None = None, **overrides: object) -> Engine:
    settings: dict[str, object] = {
        "kv_capacity_tokens": 160,
        "max_model_len": 160,
        "max_num_batched_tokens": 64,
        "decode_tokens_per_s": 50.0,
        "prefill_tokens_per_s": 20000.0,
        "batch_knee": 64,
    }
    settings.update(overrides)
    return Engine(EngineConfig(**settings), clock or Clock())  # type: ignore[arg-type]


def run_step(e: Engine) -> Step:
    step = e.schedule()
    e.complete(step)
    return step


def test_prefill_allocates_the_prompt_and_decode_a_block_every_16_tokens() -> None:
    e = engine()
    e.add("a", prompt_tokens=47, max_tokens=4)
    used = []
    for _ in range(4):
        run_step(e)
        used.append(e.stats().used_blocks)
    # 47 prompt tokens: 3 blocks; decode computes token 48 (still 3 blocks), 49 (a 4th); finishing frees all.
    assert used == [3, 3, 4, 0]
    stats = e.stats()
    assert stats.generation_tokens_total == 4
    assert stats.finished_total == 1
    assert stats.peak_kv_tokens == 4 * 16


def test_long_prompt_is_chunked_and_the_first_token_comes_with_the_last_chunk() -> None:
    e = engine()
    e.add("a", prompt_tokens=100, max_tokens=2)
    first = e.schedule()
    assert first.batch == (("a", 64),)
    assert e.complete(first) == []
    assert e.stats().used_blocks == 4
    second = e.schedule()
    assert second.batch == (("a", 36),)
    (event,) = e.complete(second)
    assert (event.output_tokens, event.finished) == (1, False)
    assert e.stats().used_blocks == 7


def test_a_running_prefill_takes_the_budget_before_a_new_short_request() -> None:
    e = engine(kv_capacity_tokens=320, max_model_len=320)
    e.add("long", prompt_tokens=200, max_tokens=1)
    run_step(e)
    e.add("short", prompt_tokens=10, max_tokens=1)
    assert e.schedule().batch == (("long", 64),)
    e.complete(Step(batch=(("long", 64),), duration_s=0.0))
    assert e.schedule().batch == (("long", 64),)
    e.complete(Step(batch=(("long", 64),), duration_s=0.0))
    # 8 prompt tokens of the long request remain, so the short one finally fits in the budget.
    assert e.schedule().batch == (("long", 8), ("short", 10))


def test_the_long_prefill_threshold_leaves_budget_to_the_request_behind_and_not_when_alone() -> None:
    e = engine(kv_capacity_tokens=320, max_model_len=320, long_prefill_token_threshold=40)
    e.add("long", prompt_tokens=200, max_tokens=1)
    assert e.schedule().batch == (("long", 64),), "alone: the whole budget (vLLM lifts the cap)"
    e.complete(Step(batch=(("long", 64),), duration_s=0.0))
    e.add("short", prompt_tokens=10, max_tokens=1)
    step = e.schedule()
    assert step.batch == (("long", 40), ("short", 10)), "the short one starts beside the long prefill"
    (event,) = e.complete(step)
    assert event.request_id == "short"
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        engine(long_prefill_token_threshold=500)


def test_step_time_grows_with_batch_and_prefill_work() -> None:
    e = engine()
    e.add("a", prompt_tokens=100, max_tokens=3)
    prefill = e.schedule()
    assert prefill.duration_s == pytest.approx((1 + 1 / 64) / 50 + 64 / 20000)
    e.complete(prefill)
    e.complete(e.schedule())
    e.add("b", prompt_tokens=16, max_tokens=3)
    mixed = e.schedule()
    assert mixed.batch == (("a", 1), ("b", 16))
    assert mixed.duration_s == pytest.approx((1 + 2 / 64) / 50 + 16 / 20000)


def exhaust(e: Engine) -> Step:
    """Two 30-token prompts fill a 4-block cache; the 33rd token of the first needs a 5th block."""
    e.add("a", prompt_tokens=30, max_tokens=30)
    e.add("b", prompt_tokens=30, max_tokens=30)
    for _ in range(3):
        run_step(e)
    assert e.stats().used_blocks == 4
    return e.schedule()


def test_preempt_mode_recomputes_the_newest_request_and_waits_when_full() -> None:
    e = engine(kv_capacity_tokens=64, max_model_len=64, on_exhaustion="preempt")
    step = exhaust(e)
    assert step.batch == (("a", 1),)
    assert not step.crashed
    e.complete(step)
    stats = e.stats()
    assert (stats.preemptions_total, stats.running, stats.waiting, stats.used_blocks) == (1, 1, 1, 3)
    # b must recompute 30 prompt + 3 generated tokens (3 blocks); only 1 block is free, so it waits.
    assert e.schedule().batch == (("a", 1),)
    assert e.stats().oom_crashes_total == 0


def test_preempted_request_resumes_and_finishes_with_all_its_tokens() -> None:
    e = engine(kv_capacity_tokens=64, max_model_len=64, on_exhaustion="preempt")
    e.complete(exhaust(e))
    outputs: dict[str, int] = {}
    for _ in range(200):
        if not e.has_work():
            break
        for event in e.complete(e.schedule()):
            outputs[event.request_id] = event.output_tokens
    assert outputs == {"a": 30, "b": 30}
    assert e.stats().used_blocks == 0


def test_crash_mode_fails_every_request_and_stays_down_for_the_restart_time() -> None:
    clock = Clock()
    e = engine(clock, kv_capacity_tokens=64, max_model_len=64, on_exhaustion="crash", restart_s=5.0)
    step = exhaust(e)
    assert step.batch == ()
    assert sorted(step.crashed) == ["a", "b"]
    stats = e.stats()
    assert (stats.oom_crashes_total, stats.used_blocks, stats.running, stats.down) == (1, 0, 0, True)
    assert stats.peak_kv_tokens == 5 * 16  # the demand that did not fit
    assert e.restart_in() == 5.0
    assert e.schedule() == Step(batch=(), duration_s=0.0)
    clock.now = 5.0
    assert not e.is_down()
    e.add("c", prompt_tokens=10, max_tokens=1)
    assert e.schedule().batch == (("c", 10),)


def test_crash_mode_crashes_on_admission_too() -> None:
    e = engine(kv_capacity_tokens=64, max_model_len=64, on_exhaustion="crash")
    e.add("a", prompt_tokens=40, max_tokens=1)
    assert e.complete(e.schedule())[0].finished
    e.add("b", prompt_tokens=40, max_tokens=1)
    e.add("c", prompt_tokens=40, max_tokens=1)
    # b takes 3 of the 4 blocks; c needs 3 more: a guarded engine would queue c, this one runs out.
    assert sorted(e.schedule().crashed) == ["b", "c"]


def test_abort_frees_the_blocks_of_a_request() -> None:
    e = engine()
    e.add("a", prompt_tokens=40, max_tokens=10)
    run_step(e)
    assert e.stats().used_blocks == 3
    e.abort("a")
    e.abort("a")
    assert e.stats().used_blocks == 0
    assert not e.has_work()


def test_default_output_length_is_seeded_and_ends_with_stop() -> None:
    def lengths(seed: int) -> list[int]:
        e = engine(seed=seed, default_output_tokens=(1, 100))
        return [e.add(f"r{i}", prompt_tokens=1, max_tokens=None) for i in range(5)]

    assert lengths(7) == lengths(7)
    assert lengths(7) != lengths(8)
    e = engine(default_output_tokens=(1, 1))
    e.add("a", prompt_tokens=1, max_tokens=None)
    (event,) = e.complete(e.schedule())
    assert event.finish_reason == "stop"


def test_an_answer_that_ends_before_its_budget_stops_there_and_says_stop() -> None:
    """A replay that over-declares max_tokens says where the simulated answer ends (eos_after)."""
    e = engine()
    assert e.add("short", prompt_tokens=1, max_tokens=400, eos_after=1) == 1
    assert e.add("capped", prompt_tokens=1, max_tokens=3, eos_after=100) == 3, "the budget still caps"
    (event, *_) = e.complete(e.schedule())
    assert (event.request_id, event.finish_reason) == ("short", "stop")


def test_config_refuses_a_model_len_the_cache_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="larger than the KV cache"):
        EngineConfig(kv_capacity_tokens=1000, max_model_len=1001)
    with pytest.raises(ConfigError):
        EngineConfig(kv_capacity_tokens=8, block_size=16, max_model_len=8)
