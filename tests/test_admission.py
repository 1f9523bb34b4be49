"""Admission driven in-process against FakeHeadroom: every branch, in seconds, with no processes.

FakeHeadroom's nodes grant through the agent's own ReservationLedger, and its clock is a ManualClock,
admission's too: staleness, the breaker's timing and the bounded wait for capacity all move when the
test advances the clock, never with the wall's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from test_water import node

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.config import AdmissionConfig, ModelConfig
from kvgate.gate.admission import Admission, Admitted
from kvgate.gate.pipeline import wait_bound
from kvgate.headroom.snapshot import NodeView, PrefixChain, ReleaseOutcome, ReserveReason, TenantCharge
from kvgate.policy import Reason, Refusal, Route
from kvgate.policy.route import ClientHints
from kvgate.policy.water import BreakerState, Level
from kvgate.telemetry import GateMetrics

MODEL = ModelConfig()
T = TypeVar("T")


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), 10))


def long_route(tokens: int) -> Route:
    return Route("long", Reason.LONG, tokens)


def setup(
    *nodes: tuple[str, int], stale_after_s: float = 0.5, **config: object
) -> tuple[FakeHeadroom, ManualClock, Admission]:
    clock = ManualClock()
    source = FakeHeadroom(clock, stale_after_s=stale_after_s)
    for name, capacity in nodes:
        source.add_node(name, capacity)
    settings = AdmissionConfig(**{"max_wait_s": 0.0, **config})  # type: ignore[arg-type]
    return source, clock, Admission(settings, source, clock=clock)


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until `condition` holds (requests in flight got where the test needs
    them); time does not move meanwhile."""
    for _ in range(1000):
        await asyncio.sleep(0)
        if condition():
            return
    raise AssertionError("the condition never held")


async def admit(admission: Admission, tokens: int, request_id: str, priority: str | None = None) -> Admitted:
    return await admission.admit(long_route(tokens), MODEL, priority, request_id)


def refused(admitted: Admitted) -> Reason:
    assert isinstance(admitted.decision, Refusal), admitted.decision
    return admitted.decision.reason


def test_a_long_request_is_pinned_to_the_node_that_reserved_it() -> None:
    async def scenario() -> None:
        source, _, admission = setup(("a", 20000), ("b", 40000))
        admitted = await admit(admission, 10000, "r1")
        assert admitted.decision == Route("long", Reason.LONG, 10000, "b.engine:8000"), "most headroom first"
        assert admitted.ticket is not None and admitted.ticket.agent == "b"
        assert admitted.ticket.outcome.reason == ReserveReason.GRANTED, "the agent's answer, as it gave it"
        assert admitted.ticket.charged_tokens == admitted.ticket.outcome.charged_tokens == 10000
        assert source.reserved_tokens("b") == 10000
        await admission.release(admitted.ticket)
        assert source.reserved_tokens("b") == 0

    run(scenario)


def test_a_burst_inside_one_sampling_period_cannot_over_admit() -> None:
    async def scenario() -> None:
        _, clock, admission = setup(("a", 40000), max_wait_s=0.25)
        tasks = [asyncio.create_task(admit(admission, 12000, f"r{i}")) for i in range(5)]
        await until(lambda: sum(t.done() for t in tasks) == 3 and clock.sleeping == 2)
        clock.advance(0.25)  # the two left waiting run out of time
        results = await asyncio.gather(*tasks)
        admitted = [r for r in results if r.ticket is not None]
        assert len(admitted) == 3, "the agent's ledger charges each grant before the next"
        assert [refused(r) for r in results if r.ticket is None] == [Reason.NO_CAPACITY] * 2

    run(scenario)


def test_waits_in_the_queue_then_takes_capacity_that_frees() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 20000), max_wait_s=5.0)
        await admission.start()
        first = await admit(admission, 15000, "first")
        assert first.ticket is not None
        waiting = asyncio.create_task(admit(admission, 15000, "second"))
        await until(lambda: clock.sleeping == 1)
        assert not waiting.done()
        assert admission.gauges().waiting == 1
        await admission.release(first.ticket)
        second = await waiting
        assert second.ticket is not None and source.reserved_tokens("a") == 15000
        await admission.stop()

    run(scenario)


def test_an_agent_update_wakes_the_waiting_head() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 20000), max_wait_s=5.0)
        source.update("a", used_tokens=15000)
        await admission.start()
        waiting = asyncio.create_task(admit(admission, 10000, "r1"))
        await until(lambda: clock.sleeping == 1)
        assert not waiting.done()
        source.update("a", used_tokens=2000)  # the engine finished other work
        assert (await waiting).ticket is not None
        await admission.stop()

    run(scenario)


def test_a_wait_that_times_out_is_refused_with_429_and_no_reservation() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 20000), max_wait_s=2.0)
        source.update("a", used_tokens=15000)
        waiting = asyncio.create_task(admit(admission, 10000, "r1"))
        await until(lambda: clock.sleeping == 1)
        clock.advance(1.0)
        await until(lambda: clock.sleeping == 1)
        assert not waiting.done(), "half its wait: still waiting"
        clock.advance(1.0)
        admitted = await waiting
        assert refused(admitted) is Reason.NO_CAPACITY
        assert admitted.ticket is None and source.reserved_tokens("a") == 0
        assert admission.gauges().waiting == 0, "the request left the queue"

    run(scenario)


def test_a_full_queue_refuses_at_once_what_would_stand_last() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 20000), max_wait_s=5.0, queue_size=2)
        source.update("a", used_tokens=15000)
        waiters = [asyncio.create_task(admit(admission, 10000, f"w{i}")) for i in range(2)]
        await until(lambda: clock.sleeping == 2)
        assert refused(await admit(admission, 10000, "third", "normal")) is Reason.QUEUE_FULL
        assert admission.gauges().waiting == 2 and not any(task.done() for task in waiters)
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    run(scenario)


def test_a_higher_priority_pushes_the_last_waiter_out_of_a_full_queue() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 20000), max_wait_s=5.0, queue_size=2)
        await admission.start()
        source.update("a", used_tokens=15000)
        first = asyncio.create_task(admit(admission, 10000, "w0"))
        await until(lambda: clock.sleeping == 1)
        last = asyncio.create_task(admit(admission, 10000, "w1"))
        await until(lambda: clock.sleeping == 2)
        urgent = asyncio.create_task(admit(admission, 10000, "urgent", "high"))
        assert refused(await last) is Reason.QUEUE_FULL, "the newest normal waiter gave up its place"
        await until(lambda: clock.sleeping == 2)
        assert not first.done() and admission.gauges().waiting == 2
        source.update("a", used_tokens=5000)  # room for one
        assert (await urgent).ticket is not None, "the high-priority request took the room"
        assert not first.done()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await admission.stop()

    run(scenario)


def test_async_fallback_hands_overflow_to_the_async_pool_instead_of_429() -> None:
    async def scenario() -> None:
        for fallback, expected in ((True, Route("async", Reason.ASYNC, 10000)), (False, None)):
            source, _, admission = setup(("a", 20000), async_fallback=fallback)
            source.update("a", used_tokens=15000)
            admitted = await admit(admission, 10000, "r1")
            if expected is None:
                assert refused(admitted) is Reason.NO_CAPACITY
            else:
                assert admitted.decision == expected and admitted.ticket is None

    run(scenario)


def test_no_healthy_node_is_a_503_reason_not_a_wait() -> None:
    async def scenario() -> None:
        source, _, admission = setup(("a", 20000), ("b", 20000), max_wait_s=5.0)
        source.update("a", healthy=False, reason="nvml: GPU lost")
        source.disconnect("b")
        assert refused(await admit(admission, 10000, "r1")) is Reason.NO_HEALTHY_NODE

    run(scenario)


def test_stale_nodes_are_probed_or_excluded_as_configured() -> None:
    async def scenario() -> None:
        for policy in ("probe", "exclude"):
            source, clock, admission = setup(("a", 20000), ("b", 20000), stale_nodes=policy)
            source.go_silent("a")
            clock.advance(1.0)
            source.update("b", used_tokens=14000)  # fresh, but without room for 10,000
            assert [view.fresh for view in source.snapshot()] == [False, True]
            admitted = await admit(admission, 10000, f"r-{policy}")
            if policy == "probe":
                assert admitted.ticket is not None and admitted.ticket.agent == "a", (
                    "a stale agent still grants atomically from its own data"
                )
            else:
                assert refused(admitted) is Reason.NO_CAPACITY

    run(scenario)


def test_a_reserve_that_fails_on_one_node_is_tried_on_the_next() -> None:
    async def scenario() -> None:
        source, _, admission = setup(("a", 40000), ("b", 30000))
        source.fail_reserves("a")
        admitted = await admit(admission, 10000, "r1")
        assert admitted.ticket is not None and admitted.ticket.agent == "b"
        assert source.reserved_tokens("a") == 0

    run(scenario)


def test_a_reserve_granted_but_unanswered_is_given_back() -> None:
    """The agent granted, the answer came too late: the gate placed the request elsewhere, and gives
    the first node's room back (docs/benchmarks.md "Real traffic": such grants held whole long
    requests' KV until their leases ended)."""

    async def scenario() -> None:
        source, _, admission = setup(("a", 40000), ("b", 30000))
        source.fail_reserves("a", granted=True)
        admitted = await admit(admission, 10000, "r1")
        assert admitted.ticket is not None and admitted.ticket.agent == "b"
        await until(lambda: ("a", "r1") in source.released)
        assert source.reserved_tokens("a") == 0
        assert source.reserved_tokens("b") == 10000

    run(scenario)


def test_a_request_does_not_ask_again_an_agent_whose_give_back_is_in_flight() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 40000), max_wait_s=1.0)
        source.fail_reserves("a", granted=True)
        admitting = asyncio.create_task(admit(admission, 10000, "r1"))
        await until(lambda: ("a", "r1") in source.released)
        clock.advance(1.0)
        assert refused(await admitting) is Reason.NO_CAPACITY
        assert source.reserved_tokens("a") == 0, "the give-back did not meet a second grant"

    run(scenario)


def test_a_release_that_gets_no_answer_is_tried_again() -> None:
    async def scenario() -> None:
        source, _, admission = setup(("a", 40000))
        admitted = await admit(admission, 10000, "r1")
        assert admitted.ticket is not None
        source.disconnect("a")
        releasing = asyncio.create_task(admission.release(admitted.ticket))
        await asyncio.sleep(0)  # its first try fails
        assert source.reserved_tokens("a") == 10000
        source.reconnect("a")
        await releasing
        assert source.reserved_tokens("a") == 0

    run(scenario)


def test_a_release_after_the_agent_restarted_is_harmless() -> None:
    async def scenario() -> None:
        source, _, admission = setup(("a", 40000))
        admitted = await admit(admission, 10000, "r1")
        assert admitted.ticket is not None
        source.restart_agent("a")
        assert source.reserved_tokens("a") == 0, "the new agent remembers nothing"
        await admission.release(admitted.ticket)
        assert source.released == [("a", "r1")]
        assert (await admit(admission, 30000, "r2")).ticket is not None

    run(scenario)


def test_a_release_to_an_unreachable_agent_is_left_to_the_lease() -> None:
    async def scenario() -> None:
        source, _, admission = setup(("a", 40000))
        admitted = await admit(admission, 10000, "r1")
        assert admitted.ticket is not None
        source.disconnect("a")
        await admission.release(admitted.ticket)  # logged, not raised
        assert source.reserved_tokens("a") == 10000

    run(scenario)


def test_priorities_are_shed_at_each_water_level() -> None:
    async def outcomes(used: int) -> list[bool]:
        source, _, admission = setup(("a", 100000), max_wait_s=0.0, breaker_open_s=3600)
        source.update("a", used_tokens=used)
        admitted = [await admit(admission, 1000, f"{p}-{used}", p) for p in ("high", "normal", "low")]
        return [a.ticket is not None for a in admitted]

    async def scenario() -> None:
        assert await outcomes(50000) == [True, True, True], "green"
        assert await outcomes(88000) == [True, True, False], "yellow sheds low"
        assert await outcomes(96000) == [True, False, False], "red sheds all but high"

    run(scenario)


def test_red_opens_the_breaker_which_half_opens_to_probe_and_closes() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 100000), max_wait_s=0.0, breaker_open_s=2.0, breaker_probes=1)
        source.update("a", used_tokens=96000)
        assert refused(await admit(admission, 1000, "r1")) is Reason.SHED
        (long_pool,) = admission.gauges().pools
        assert (long_pool.water_level, long_pool.breaker) == (Level.RED, BreakerState.OPEN)
        source.update("a", used_tokens=10000)
        assert refused(await admit(admission, 1000, "r2")) is Reason.SHED, "open: still shedding"
        clock.advance(2.0)
        source.tick()
        probe = await admit(admission, 1000, "probe")
        assert probe.ticket is not None, "half-open lets a probe through"
        assert admission.gauges().pools[0].breaker is BreakerState.HALF_OPEN
        assert (await admit(admission, 1000, "r3")).ticket is not None, "green after the probe: closed"
        assert admission.gauges().pools[0].breaker is BreakerState.CLOSED

    run(scenario)


def test_a_probe_that_finds_the_pool_red_opens_the_breaker_again() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 100000), max_wait_s=0.0, breaker_open_s=2.0, breaker_probes=1)
        source.update("a", used_tokens=96000)
        assert refused(await admit(admission, 1000, "r1")) is Reason.SHED
        clock.advance(2.0)
        source.update("a", used_tokens=70000)
        assert (await admit(admission, 1000, "probe")).ticket is not None
        source.update("a", used_tokens=97000)
        assert refused(await admit(admission, 1000, "r2")) is Reason.SHED
        assert admission.gauges().pools[0].breaker is BreakerState.OPEN

    run(scenario)


def test_the_interactive_pool_sheds_its_lowest_priority_when_red() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        interactive = FakeHeadroom(clock)
        interactive.add_node("i", 100000, used_tokens=97000)
        admission = Admission(AdmissionConfig(), None, interactive, clock=clock)
        short = Route("interactive", Reason.SHORT, 800)
        assert (await admission.admit(short, MODEL, "normal", "r1")).decision == short
        low = await admission.admit(short, MODEL, "low", "r2")
        assert refused(low) is Reason.SHED

    run(scenario)


class SlowAgentView:
    """One healthy node whose agent never answers Reserve; Release is recorded."""

    def __init__(self) -> None:
        self.reserving = asyncio.Event()
        self.released: list[str] = []

    def snapshot(self) -> tuple[NodeView, ...]:
        return (node("a", 30000),)

    async def reserve(
        self,
        node: str,
        request_id: str,
        tokens: int,
        prefix: PrefixChain | None = None,
        *,
        output_tokens: int = 0,
        waiting_since_unix_ns: int = 0,
        rank: int = 0,
        fair_service: float = 0.0,
        hold_slot: bool = False,
        charge: TenantCharge | None = None,
        reports_first_token: bool = False,
    ) -> None:
        self.reserving.set()
        await asyncio.sleep(3600)

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        assert unanswered, "the Reserve never answered: the agent may see the Release first"
        self.released.append(request_id)
        return ReleaseOutcome(released=False, headroom_tokens=30000, reserved_tokens=0)

    async def wait_update(self, timeout_s: float) -> bool:
        await asyncio.sleep(timeout_s)
        return False


def test_a_stream_cancelled_mid_reserve_gives_the_reservation_back() -> None:
    """The agent may grant just before the stream dies: the gate releases instead of waiting a lease."""

    async def scenario() -> list[str]:
        view = SlowAgentView()
        admission = Admission(AdmissionConfig(), view)  # type: ignore[arg-type]
        task = asyncio.create_task(admit(admission, 12000, "r1"))
        await asyncio.wait_for(view.reserving.wait(), 5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(10):
            await asyncio.sleep(0)
        return view.released

    assert run(scenario) == ["r1"]


def test_the_clients_prefer_wait_shortens_the_wait_but_never_lengthens_it() -> None:
    async def waited(wait_s: float, max_wait_s: float, *, async_fallback: bool = False) -> float:
        """How far the clock moved before the request was refused, waiting as the pipeline bounds it."""
        settings = {"max_wait_s": max_wait_s, "async_fallback": async_fallback, "max_hold_s": 20.0}
        source, clock, admission = setup(("a", 20000), **settings)
        source.update("a", used_tokens=15000)
        started = clock()
        bound = wait_bound(AdmissionConfig(**settings), MODEL, ClientHints(wait_s=wait_s))  # type: ignore[arg-type]
        waiting = asyncio.create_task(admission.admit(long_route(10000), MODEL, None, "r1", bound))
        while True:
            await until(lambda: waiting.done() or clock.sleeping == 1)
            if waiting.done():
                break
            clock.advance(0.25)
        decision = (await waiting).decision
        assert decision.reason is (Reason.ASYNC if async_fallback else Reason.NO_CAPACITY), decision
        return clock() - started

    async def scenario() -> None:
        assert await waited(0.0, 5.0) == 0.0
        assert await waited(0.5, 5.0) == 0.5
        assert await waited(60.0, 1.0) == 1.0
        # A request the async pool would take is held up to max_hold_s instead; Prefer still shortens.
        assert await waited(60.0, 1.0, async_fallback=True) == 20.0
        assert await waited(3.0, 1.0, async_fallback=True) == 3.0

    run(scenario)


def test_a_models_async_mode_decides_what_overflow_becomes() -> None:
    async def scenario() -> None:
        for mode, fallback, expected in (
            ("allow", False, "async"),
            ("never", True, None),
            (None, True, "async"),
        ):
            source, _, admission = setup(("a", 20000), async_fallback=fallback)
            source.update("a", used_tokens=15000)
            model = ModelConfig(async_mode=mode)  # type: ignore[arg-type]
            admitted = await admission.admit(long_route(10000), model, None, f"r-{mode}")
            if expected is None:
                assert refused(admitted) is Reason.NO_CAPACITY
            else:
                assert admitted.decision == Route(expected, Reason.ASYNC, 10000)

    run(scenario)


class RecordedRetries(GateMetrics):
    """The gate's metrics, with the Retry-After checks kept for the test to read."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[tuple[str, float | None]] = []

    def retry_checked(self, basis: str, error_s: float | None) -> None:
        super().retry_checked(basis, error_s)
        self.checked.append((basis, error_s))


async def admit_with_budget(
    admission: Admission, tokens: int, output_tokens: int, request_id: str
) -> Admitted:
    return await admission.admit(long_route(tokens), MODEL, None, request_id, output_tokens=output_tokens)


def retry_after(admitted: Admitted) -> float | None:
    assert isinstance(admitted.decision, Refusal), admitted.decision
    return admitted.decision.retry_after_s


def test_a_refused_burst_is_told_to_come_back_as_its_capacity_frees() -> None:
    """Two 30k requests of 250 output tokens hold the node; at 50 tokens/s they end in 5 s. The next
    two are due then, the two after when those end in turn; fixed mode tells all of them 2 s."""

    async def scenario(mode: str) -> list[float | None]:
        source, _, admission = setup(("a", 60000), max_wait_s=0.0, retry_after=mode, retry_jitter=0.0)
        source.measure_decode_rate("a", 50.0)
        held = [await admit_with_budget(admission, 30000, 250, f"r{i}") for i in range(2)]
        assert all(a.ticket is not None for a in held)
        return [retry_after(await admit_with_budget(admission, 30000, 250, f"x{i}")) for i in range(4)]

    assert run(lambda: scenario("forecast")) == [5.0, 5.0, 10.0, 10.0]
    assert run(lambda: scenario("fixed")) == [2, 2, 2, 2]


def test_without_a_measured_rate_the_fixed_value_is_jittered_later() -> None:
    async def scenario() -> list[float | None]:
        source, clock, _ = setup(("a", 30000))
        draws = iter([0.0, 0.5, 0.999])
        config = AdmissionConfig(max_wait_s=0.0, retry_after_s=2, retry_jitter=0.5)
        admission = Admission(config, source, clock=clock, rng=lambda: next(draws))
        assert (await admit_with_budget(admission, 30000, 250, "held")).ticket is not None
        return [retry_after(await admit_with_budget(admission, 30000, 250, f"x{i}")) for i in range(3)]

    assert run(scenario) == [2.0, 2.5, 2.999]


def test_each_answer_is_checked_against_when_its_capacity_freed() -> None:
    async def scenario() -> list[tuple[str, float | None]]:
        clock = ManualClock()
        source = FakeHeadroom(clock)
        source.add_node("a", 30000)
        source.measure_decode_rate("a", 50.0)
        metrics = RecordedRetries()
        config = AdmissionConfig(max_wait_s=0.0, retry_jitter=0.0)
        admission = Admission(config, source, telemetry=metrics, clock=clock)
        await admission.start()
        try:
            held = await admit_with_budget(admission, 30000, 100, "held")  # expected to end in 2 s
            assert held.ticket is not None
            assert retry_after(await admit_with_budget(admission, 30000, 100, "refused")) == 2.0
            clock.advance(2.5)
            await admission.release(held.ticket)  # it ended half a second late
            await until(lambda: bool(metrics.checked))
            return metrics.checked
        finally:
            await admission.stop()

    assert run(scenario) == [("forecast", 0.5)]
