"""Room for light tenants (kvgate.policy.light_reserve): while another tenant's request waits, a tenant
that already has a long request waiting or running may not take the last `light_reserve_tokens` of
room, so a tenant of one request at a time starts at once instead of waiting for a release that fits."""

from __future__ import annotations

import asyncio

import pytest
from test_admission import MODEL, long_route, run, until

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.config import AdmissionConfig, FairnessConfig, parse_config
from kvgate.errors import ConfigError
from kvgate.gate.admission import Admission, Admitted
from kvgate.headroom.snapshot import NodeView
from kvgate.policy.light_reserve import leaves_reserve

SIZE = 8_000


def view(source: FakeHeadroom) -> tuple[NodeView, ...]:
    return source.snapshot()


async def settle() -> None:
    """Let every task run until none has anything left to do (time does not move)."""
    for _ in range(200):
        await asyncio.sleep(0)


def test_a_grant_leaves_the_reserve_when_some_node_keeps_it_free() -> None:
    source = FakeHeadroom(ManualClock(), stale_after_s=5.0)
    source.add_node("a", 20_000)
    source.add_node("b", 5_000)
    nodes = view(source)
    assert leaves_reserve(nodes, "a", 14_000, 6_000)  # a keeps 6,000
    assert not leaves_reserve(nodes, "a", 14_001, 6_000)  # a keeps less, b has 5,000
    assert leaves_reserve(nodes, "b", 5_000, 6_000)  # a keeps its 20,000


def test_the_config_names_a_bad_reserve() -> None:
    with pytest.raises(ConfigError, match=r"fairness\.light_reserve_tokens: must be >= 0"):
        parse_config("fairness: {enabled: true, light_reserve_tokens: -1}")


@pytest.mark.parametrize("reserve", [6_000, 0])
def test_a_light_tenant_starts_at_once_where_the_backlogged_ones_are_held_off_the_reserve(
    reserve: int,
) -> None:
    """One node of 20,000 tokens, 8,000-token requests. Tenant a fills it alone (nobody else waits, so
    no reserve is kept) and queues two more; c comes, is served first (it waited level with a and was
    served less) and queues one more, now ahead of a. A release frees 12,000: with a reserve of 6,000
    no waiter may take it (12,000 - 8,000 leaves 4,000): a has two waiting, and c, with one, has had
    more service than a. b, with nothing waiting and the least service, starts at once on arrival.
    Without a reserve a's waiter takes the room and b waits."""

    async def scenario() -> tuple[int, bool]:
        clock = ManualClock()
        source = FakeHeadroom(clock, stale_after_s=5.0)
        source.add_node("n", 20_000)
        fairness = FairnessConfig(enabled=True, light_reserve_tokens=reserve)
        admission = Admission(AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=fairness)
        await admission.start()

        def ask(tenant: str, request_id: str) -> asyncio.Task[Admitted]:
            return asyncio.create_task(
                admission.admit(long_route(SIZE), MODEL, None, request_id, tenant=tenant)
            )

        a0, a1 = await ask("a", "a0"), await ask("a", "a1")
        assert a0.ticket is not None and a1.ticket is not None
        waiting = [ask("a", "a2"), ask("a", "a3")]
        await until(lambda: admission.gauges().waiting == 2)
        c0 = ask("c", "c0")
        await until(lambda: admission.gauges().waiting == 3)
        await admission.release(a0.ticket)
        await until(c0.done)
        waiting.append(ask("c", "c1"))
        await until(lambda: admission.gauges().waiting == 3)
        await admission.release(a1.ticket)
        await settle()  # the waiters woken by the release try, and are granted or go back to waiting
        still_waiting = admission.gauges().waiting
        b0 = ask("b", "b0")
        await until(lambda: b0.done() or admission.gauges().waiting > still_waiting)
        started_at_once = b0.done() and b0.result().ticket is not None
        for task in waiting:
            task.cancel()
        b0.cancel()
        await asyncio.gather(*waiting, b0, return_exceptions=True)
        await admission.stop()
        return still_waiting, started_at_once

    still_waiting, started_at_once = run(scenario)
    if reserve:
        assert (still_waiting, started_at_once) == (3, True)
    else:
        assert (still_waiting, started_at_once) == (2, False)
