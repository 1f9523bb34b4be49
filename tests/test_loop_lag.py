"""The gate answers before Envoy's message_timeout decides for it: a long request that arrives while
the event loop runs behind is refused at once (503 gateway_overloaded, Retry-After) or sent to the
async pool, and the lag is measured as it happens (kvgate.gate.loop_lag)."""

from __future__ import annotations

import asyncio
import time

from waiting import until_async

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.config import AdmissionConfig, ModelConfig
from kvgate.gate.admission import Admission
from kvgate.gate.loop_lag import PROBES_PER_LIMIT, LoopLag
from kvgate.policy import Reason, Refusal, Route
from kvgate.policy.refusals import Refusals


def test_a_blocked_loop_reads_as_behind_at_once_and_recovers() -> None:
    async def scenario() -> None:
        lag = LoopLag(0.5 / PROBES_PER_LIMIT)  # admission.max_loop_lag_s's default
        probe = asyncio.create_task(lag.run())
        try:
            await until_async(lambda: lag.current_s() == 0.0 or lag.current_s() < 0.05, "a quiet loop")
            await asyncio.sleep(0.01)  # the probe is asleep, due in at most one interval
            time.sleep(0.4 + lag.interval_s)  # the loop is held: nothing runs until this returns
            assert lag.current_s() >= 0.4, "read right after the block, before the probe woke"
            await until_async(lambda: lag.current_s() < 0.05, "the lag to fall once the loop runs freely")
        finally:
            probe.cancel()

    asyncio.run(scenario())


def admission_behind(lag_s: float, **config: object) -> Admission:
    clock = ManualClock()
    source = FakeHeadroom(clock)
    source.add_node("a", 100_000)
    settings = AdmissionConfig(**{"max_wait_s": 0.0, **config})  # type: ignore[arg-type]
    return Admission(settings, source, clock=clock, loop_lag=lambda: lag_s)


def test_a_long_request_is_answered_at_once_while_the_loop_is_behind() -> None:
    async def scenario() -> None:
        long = Route("long", Reason.LONG, 20_000)
        behind = await admission_behind(1.2).admit(long, ModelConfig(), None, "r1")
        assert isinstance(behind.decision, Refusal) and behind.ticket is None
        assert behind.decision.reason is Reason.OVERLOADED
        assert "1.2 s behind" in behind.decision.message
        refusals = Refusals("413", 1.0)
        assert refusals.status(Reason.OVERLOADED) == 503
        assert behind.decision.retry_after_s is not None, "told when to come back"
        to_async = await admission_behind(1.2, async_fallback=True).admit(long, ModelConfig(), None, "r2")
        assert to_async.decision == Route("async", Reason.ASYNC, 20_000)
        on_time = await admission_behind(0.2).admit(long, ModelConfig(), None, "r3")
        assert on_time.ticket is not None, "below admission.max_loop_lag_s (0.5 s) it reserves as ever"
        short = Route("interactive", Reason.SHORT, 500)
        assert (await admission_behind(5.0).admit(short, ModelConfig(), None, "r4")).decision == short

    asyncio.run(scenario())


def test_the_lag_reads_from_another_thread_as_the_metrics_exporter_does() -> None:
    async def scenario() -> None:
        lag = LoopLag(0.05)
        probe = asyncio.create_task(lag.run())
        try:
            await asyncio.sleep(0.06)
            read = await asyncio.to_thread(lag.current_s)
            assert 0.0 <= read < 5.0
        finally:
            probe.cancel()

    asyncio.run(scenario())
