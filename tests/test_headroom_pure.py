"""The pure headroom pieces: formula, KV bytes per token, static capacity, ledger, node state."""

from __future__ import annotations

import pytest

from kvgate.agent.capacity import ModelShape, kv_bytes_per_token, static_capacity_tokens
from kvgate.agent.ledger import EARLY_RELEASE_S, EARLY_RELEASES_KEPT, Budget, ReservationLedger
from kvgate.agent.node import NodeSettings, NodeState
from kvgate.agent.sources.engines import EngineKind, EngineReading, PageState
from kvgate.agent.status import status_json, status_text
from kvgate.errors import ConfigError
from kvgate.headroom.snapshot import (
    CapacitySource,
    GpuReading,
    NodeView,
    NvmlReading,
    ReserveReason,
    headroom_tokens,
)
from kvgate.queue import placement
from kvgate.queue.placement import Fit

GiB = 1024**3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budget(capacity: int = 40_000, observed: int | None = 0, healthy: bool = True) -> Budget:
    return Budget(capacity, 0.9, observed, healthy)


def test_headroom_takes_the_larger_of_observed_and_reserved() -> None:
    assert headroom_tokens(40_000, 0.9, observed=10_000, reserved=4_000) == 26_000
    assert headroom_tokens(40_000, 0.9, observed=4_000, reserved=10_000) == 26_000
    assert headroom_tokens(40_000, 0.9, observed=None, reserved=10_000) == 26_000
    assert headroom_tokens(40_000, 0.9, observed=39_000, reserved=0) == -3_000


def test_admissible_tokens_are_one_figure_for_the_agent_the_gate_the_queue_and_status() -> None:
    """capacity x safety ratio, rounded down: what the ledger grants is what every reader of the
    node's message says it admits."""
    node = NodeState(NodeSettings("n", "e:1", safety_ratio=0.9, capacity_tokens=1001), Clock(), False, False)
    snap = node.snapshot(0)
    assert snap.admissible_tokens == 900 == snap.headroom_tokens
    view = NodeView("n:9100", snap, 0.0, True, True, True)
    assert placement.admissible_tokens(view) == 900
    assert placement.fit([view], 900) is Fit.FITS and placement.fit([view], 901) is Fit.TOO_BIG
    assert status_json(snap, "n:9100", 0.0)["capacity"]["admissible_tokens"] == 900
    assert "x 0.9 safety = 900 admissible" in status_text(snap, "n:9100", 0.0)
    assert not node.reserve("big", 901, 0).granted
    assert node.reserve("fits", 900, 0).granted


def test_kv_bytes_per_token_for_llama_and_mla() -> None:
    llama_8b = ModelShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert kv_bytes_per_token(llama_8b) == 128 * 1024  # 128 KiB/token: 4 GiB per 32k-token sequence
    assert kv_bytes_per_token(llama_8b) * 32_768 == 4 * GiB
    deepseek_v3 = ModelShape(layers=61, kv_lora_rank=512, qk_rope_head_dim=64, dtype_bytes=2)
    assert kv_bytes_per_token(deepseek_v3) == 61 * 576 * 2
    fp8 = ModelShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=1)
    assert kv_bytes_per_token(fp8) * 2 == kv_bytes_per_token(llama_8b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": 0, "kv_heads": 8, "head_dim": 128},
        {"layers": 32},
        {"layers": 32, "kv_heads": 8, "head_dim": 128, "kv_lora_rank": 512},
    ],
)
def test_model_shape_rejects_incoherent_sizes(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        ModelShape(**kwargs)


def gpu(total: int | None, used: int | None, free: int | None, healthy: bool = True) -> GpuReading:
    return GpuReading("GPU-x", 0, "H100", total, used, free, 0, healthy)


def test_static_capacity_is_free_memory_under_the_cap() -> None:
    per_token = 128 * 1024
    # 80 GiB at 0.9 = 72 GiB allowed, 8 GiB used (weights): 64 GiB of KV = 524,288 tokens.
    assert static_capacity_tokens([gpu(80 * GiB, 8 * GiB, 72 * GiB)], per_token, 0.9) == 524_288
    # Free memory lower than the cap allows (another process): free wins.
    assert static_capacity_tokens([gpu(80 * GiB, 8 * GiB, 10 * GiB)], per_token, 0.9) == 81_920
    # Already over the cap: zero, never negative; two GPUs add up.
    two = [gpu(80 * GiB, 78 * GiB, 2 * GiB), gpu(80 * GiB, 8 * GiB, 72 * GiB)]
    assert static_capacity_tokens(two, per_token, 0.9) == 524_288


def test_static_capacity_ignores_unknown_and_unhealthy_gpus() -> None:
    per_token = 128 * 1024
    assert static_capacity_tokens([gpu(None, None, None)], per_token, 0.9) is None
    assert static_capacity_tokens([gpu(80 * GiB, 8 * GiB, 72 * GiB, healthy=False)], per_token, 0.9) is None
    assert static_capacity_tokens([], per_token, 0.9) is None


def test_ledger_grants_until_full_then_refuses() -> None:
    ledger = ReservationLedger(Clock(), default_lease_s=60, max_lease_s=600)
    granted = [ledger.reserve(f"r{i}", 12_000, 0, budget()) for i in range(5)]
    assert [r.granted for r in granted] == [True, True, True, False, False]
    assert granted[3].reason is ReserveReason.INSUFFICIENT_HEADROOM
    assert granted[2].headroom_tokens == 0
    assert ledger.reserved_tokens == 36_000


def test_ledger_counts_observed_usage() -> None:
    ledger = ReservationLedger(Clock(), 60, 600)
    assert not ledger.reserve("a", 12_000, 0, budget(observed=30_000)).granted
    assert ledger.reserve("b", 6_000, 0, budget(observed=30_000)).granted


def test_ledger_release_frees_and_is_idempotent() -> None:
    ledger = ReservationLedger(Clock(), 60, 600)
    ledger.reserve("a", 20_000, 0, budget())
    assert not ledger.reserve("b", 20_000, 0, budget()).granted
    assert ledger.release("a")
    assert not ledger.release("a")
    assert ledger.reserve("b", 20_000, 0, budget()).granted


def test_a_release_that_overtakes_its_reserve_refuses_the_reserve_once_for_a_while() -> None:
    clock = Clock()
    ledger = ReservationLedger(clock, 60, 600)
    assert not ledger.release("late", unanswered_reserve=True), "the Reserve got no answer: released unseen"
    refused = ledger.reserve("late", 10_000, 0, budget())
    assert not refused.granted and refused.reason is ReserveReason.RELEASED_FIRST
    assert ledger.reserved_tokens == 0
    assert ledger.reserve("late", 10_000, 0, budget()).granted, "remembered for one Reserve only"
    ledger.release("late")
    ledger.release("twice")
    assert ledger.reserve("twice", 10_000, 0, budget()).granted, "a plain Release that found nothing"
    ledger.release("gone", unanswered_reserve=True)
    clock.now += EARLY_RELEASE_S
    assert ledger.reserve("gone", 10_000, 0, budget()).granted, "and for EARLY_RELEASE_S"


def test_the_ledger_remembers_a_bounded_number_of_early_releases() -> None:
    ledger = ReservationLedger(Clock(), 60, 600)
    for i in range(EARLY_RELEASES_KEPT + 1):
        ledger.release(f"r{i}", unanswered_reserve=True)
    assert ledger.reserve("r0", 1_000, 0, budget()).granted, "the oldest was forgotten"
    assert not ledger.reserve(f"r{EARLY_RELEASES_KEPT}", 1_000, 0, budget()).granted


def test_ledger_reserve_is_idempotent_per_request_id() -> None:
    clock = Clock()
    ledger = ReservationLedger(clock, 60, 600)
    first = ledger.reserve("a", 20_000, 30, budget())
    clock.now += 20
    again = ledger.reserve("a", 20_000, 30, budget())
    assert first.granted and again.granted
    assert again.reason is ReserveReason.ALREADY_RESERVED
    assert ledger.reserved_tokens == 20_000
    clock.now += 25  # 45 s after the first grant, 25 after the retry: the retry renewed the lease
    assert ledger.count == 1
    conflict = ledger.reserve("a", 1_000, 30, budget())
    assert not conflict.granted and conflict.reason is ReserveReason.REQUEST_ID_CONFLICT


def test_ledger_leases_expire_on_the_injected_clock() -> None:
    clock = Clock()
    ledger = ReservationLedger(clock, default_lease_s=60, max_lease_s=120)
    ledger.reserve("short", 10_000, 5, budget())
    ledger.reserve("default", 10_000, 0, budget())
    capped = ledger.reserve("capped", 10_000, 10_000, budget())
    assert capped.lease_s == 120
    clock.now += 5
    assert ledger.reserved_tokens == 20_000
    clock.now += 55
    assert ledger.reserved_tokens == 10_000
    clock.now += 60
    assert ledger.reserved_tokens == 0
    assert not ledger.release("capped")


def test_ledger_expires_every_lease_once_at_its_end_through_renewals_and_releases() -> None:
    clock = Clock()
    start = clock.now
    ledger = ReservationLedger(clock, default_lease_s=60, max_lease_s=600)
    for request_id, lease_s in (("a", 10), ("b", 20), ("c", 30)):
        ledger.reserve(request_id, 1_000, lease_s, budget())
    clock.now = start + 5
    ledger.reserve("a", 1_000, 40, budget())  # renewed: ends at 45 instead of 10
    ledger.release("b")
    clock.now = start + 29.9
    assert ledger.expire() == []
    clock.now = start + 30
    assert [r.request_id for r in ledger.expire()] == ["c"]
    assert ledger.expire() == []
    clock.now = start + 45
    assert [r.request_id for r in ledger.expire()] == ["a"]
    assert (ledger.count, ledger.reserved_tokens) == (0, 0)
    ledger.reserve("d", 1_000, 1, budget())
    clock.now = start + 46
    assert [r.request_id for r in ledger.expire()] == ["d"]


def test_the_agent_takes_every_expiry_once_whichever_call_ended_the_lease() -> None:
    """A lease that a Reserve, a Release or a read ended before the agent's tick is still counted and
    logged by that tick (kvgate_agent_reservations_total{event="expired"}), once."""
    clock = Clock()
    start = clock.now
    ledger = ReservationLedger(clock, default_lease_s=60, max_lease_s=600)
    for request_id, lease_s in (("a", 10), ("b", 20), ("c", 30)):
        ledger.reserve(request_id, 1_000, lease_s, budget())
    clock.now = start + 10
    ledger.reserve("d", 1_000, 60, budget())  # expires "a" first
    clock.now = start + 20
    assert not ledger.release("b")  # expired by the Release itself
    clock.now = start + 30
    assert ledger.count == 1  # a read expires "c"
    assert [r.request_id for r in ledger.take_expired()] == ["a", "b", "c"]
    assert ledger.take_expired() == []
    clock.now = start + 70
    assert [r.request_id for r in ledger.take_expired()] == ["d"]


def test_ledger_refuses_on_unhealthy_or_unknown_capacity_and_rejects_misuse() -> None:
    ledger = ReservationLedger(Clock(), 60, 600)
    assert ledger.reserve("a", 1, 0, budget(healthy=False)).reason is ReserveReason.UNHEALTHY
    assert ledger.reserve("a", 1, 0, budget(capacity=0)).reason is ReserveReason.NO_CAPACITY
    with pytest.raises(ValueError):
        ledger.reserve("a", 0, 0, budget())
    with pytest.raises(ValueError):
        ledger.reserve("", 5, 0, budget())
    assert ledger.reserved_tokens == 0


def engine(capacity: int | None = 40_000, used: int | None = 8_000, running: int = 1) -> EngineReading:
    state = PageState.READY if capacity is not None else PageState.NOT_READY
    return EngineReading(EngineKind.VLLM, state, capacity, used, running, 0, 0, ("engine 0",), "rule", 30.0)


def test_node_capacity_precedence_manual_engine_static() -> None:
    clock = Clock()
    shape = ModelShape(layers=32, kv_heads=8, head_dim=128)
    reading = NvmlReading((gpu(80 * GiB, 8 * GiB, 72 * GiB),), True)
    manual = NodeState(
        NodeSettings("n", "e:1", capacity_tokens=1000), clock, uses_engine=True, uses_nvml=False
    )
    manual.observe_engine(engine())
    assert manual.snapshot(0).capacity_source is CapacitySource.MANUAL
    node = NodeState(NodeSettings("n", "e:1", model_shape=shape), clock, uses_engine=True, uses_nvml=True)
    node.observe_nvml(reading)
    node.observe_engine(engine())
    first = node.snapshot(0)
    assert (first.capacity_source, first.capacity_tokens, first.used_tokens) == (
        CapacitySource.ENGINE,
        40_000,
        8_000,
    )
    node.observe_engine(engine(capacity=None, used=None))
    second = node.snapshot(1)
    assert (second.capacity_source, second.capacity_tokens) == (CapacitySource.STATIC, 524_288)
    assert second.seq == first.seq + 1


def test_node_with_stale_engine_metrics_is_unhealthy_not_empty() -> None:
    clock = Clock()
    node = NodeState(
        NodeSettings("n", "e:1", engine_stale_after_s=1.0), clock, uses_engine=True, uses_nvml=False
    )
    assert not node.snapshot(0).healthy
    node.observe_engine(engine())
    assert node.snapshot(0).healthy
    clock.now += 0.5
    node.engine_failed("engine metrics http://x: HTTP 500")
    assert node.snapshot(0).healthy  # one failed scrape inside the staleness window keeps the last figures
    clock.now += 1.0
    stale = node.snapshot(0)
    assert not stale.healthy and stale.reason == "engine_metrics_stale: engine metrics http://x: HTTP 500"
    assert stale.used_tokens is None and stale.capacity_tokens == 0
    assert not node.reserve("a", 1, 0).granted


def test_figures_frozen_while_requests_run_make_the_node_unhealthy() -> None:
    """vLLM's figures move within 30 s while requests run: here the page answers, the scheduler does not."""
    clock = Clock()
    node = NodeState(NodeSettings("n", "e:1"), clock, uses_engine=True, uses_nvml=False)
    node.observe_engine(engine(used=8_000, running=2))
    for _ in range(30):
        clock.now += 1.0
        node.observe_engine(engine(used=8_000, running=2))
    assert node.snapshot(0).healthy
    clock.now += 1.0
    node.observe_engine(engine(used=8_000, running=2))
    frozen = node.snapshot(0)
    assert not frozen.healthy
    assert frozen.reason == (
        "engine figures frozen: vllm reports 2 running requests but its figures have not changed for 31 s "
        "(it refreshes them at least every 30 s while busy)"
    )
    node.observe_engine(engine(used=8_016, running=2))
    assert node.snapshot(0).healthy


def test_an_idle_engine_may_keep_its_figures_for_ever() -> None:
    clock = Clock()
    node = NodeState(NodeSettings("n", "e:1"), clock, uses_engine=True, uses_nvml=False)
    for _ in range(5):
        node.observe_engine(engine(used=0, running=0))
        clock.now += 60
    node.observe_engine(engine(used=0, running=0))
    assert node.snapshot(0).healthy


def test_a_node_without_engine_metrics_is_reservation_only() -> None:
    node = NodeState(
        NodeSettings("n", "e:1", capacity_tokens=40_000), Clock(), uses_engine=False, uses_nvml=False
    )
    assert node.reserve("a", 12_000, 0).granted
    snap = node.snapshot(0)
    assert snap.healthy and snap.usage_source.value == "reservations" and snap.used_tokens == 12_000
    assert (
        snap.reason
        == "reservation-only: no engine metrics; used = reservations (unreserved engine traffic unknown)"
    )


def test_node_with_lost_gpu_is_unhealthy() -> None:
    node = NodeState(
        NodeSettings("n", "e:1", capacity_tokens=40_000), Clock(), uses_engine=False, uses_nvml=True
    )
    node.observe_nvml(NvmlReading((), False, "gpu_lost: GPU-x"))
    snap = node.snapshot(0)
    assert not snap.healthy and snap.reason == "gpu_lost: GPU-x"
    assert node.reserve("a", 1, 0).reason is ReserveReason.UNHEALTHY
