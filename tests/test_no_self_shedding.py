"""A line of requests waiting for room never sheds them (issue 28, item 3).

The long pool's level follows the engines' KV usage and stale agents only: a gate whose own line
fills (every node held by reservations, the engines still reporting little KV in use) overflows one
request at a time, `queue_full` when the line is full and `no_capacity` when a wait runs out, and
never turns red and sheds every normal request (`shed`), as it did when the line's length was a
signal (admission.water.yellow_queue / red_queue, now refused at load).
"""

from __future__ import annotations

import asyncio

import pytest
from test_admission import admit, refused, run, setup, until

from kvgate.agent.in_process import ManualClock
from kvgate.config import parse_config
from kvgate.errors import ConfigError
from kvgate.gate.admission import Admitted
from kvgate.policy import Reason
from kvgate.policy.water import BreakerState, Level


async def settled(arrival: asyncio.Task[Admitted], clock: ManualClock, sleeping: int) -> None:
    """Until the request is answered or waits (the clock then has `sleeping` sleepers)."""
    await until(lambda: arrival.done() or clock.sleeping == sleeping)


def test_a_full_waiting_line_overflows_one_request_at_a_time_and_never_sheds() -> None:
    async def scenario() -> None:
        source, clock, admission = setup(("a", 20000), max_wait_s=5.0, queue_size=4)
        held = await admit(admission, 18000, "held")  # reservations fill the node; its engine is idle
        assert held.ticket is not None
        waiters: list[asyncio.Task[Admitted]] = []
        answers: list[Reason] = []
        for i in range(12):
            arrival = asyncio.create_task(admit(admission, 10000, f"r{i}", "normal"))
            await settled(arrival, clock, len(waiters) + 1)
            if arrival.done():
                answers.append(refused(arrival.result()))
            else:
                waiters.append(arrival)
        assert Reason.SHED not in answers, "the line shed requests the engines had room for"
        assert (len(waiters), answers) == (4, [Reason.QUEUE_FULL] * 8), "each overflows on its own"
        long_pool = admission.gauges().pools[0]
        assert (long_pool.water_level, long_pool.breaker) == (Level.GREEN, BreakerState.CLOSED)
        clock.advance(5.0)  # the waits run out: each is its own no_capacity
        assert [refused(await w) for w in waiters] == [Reason.NO_CAPACITY] * 4
        assert source.reserved_tokens("a") == 18000

    run(scenario)


@pytest.mark.parametrize("key", ["yellow_queue", "red_queue"])
def test_a_config_that_still_sets_a_queue_threshold_fails_naming_the_key_and_why(key: str) -> None:
    text = f"admission:\n  max_wait_s: 2\n  water:\n    red_kv: 0.95\n    {key}: 0.75\n"
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "kvgate.yaml")
    message = str(raised.value)
    assert message.startswith(f"kvgate.yaml:5: admission.water.{key}: removed:"), message
    assert "waiting requests no longer turns a pool yellow or red" in message
