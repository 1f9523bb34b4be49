"""A reservation's first token (issue 29: the picker reads the first-token time from the responses and
feeds it to the release forecast): a holder that reads the engine's answers says when each request
starts decoding, and the agent projects its footprint and its expected release from then, never from
an estimated prefill that a busy engine outlasts."""

from __future__ import annotations

import asyncio

import pytest
from test_agent_server import client, running_agent

from kvgate.agent.footprint import FirstToken, project
from kvgate.agent.in_process import ManualClock
from kvgate.agent.ledger import Budget, ReservationLedger
from kvgate.agent.node import NodeSettings
from kvgate.agent.output_budget import OutputHistory
from kvgate.agent.releases import expected_releases
from kvgate.errors import HeadroomError
from kvgate.headroom.snapshot import ReserveReason

RATE = 50.0  # output tokens a second per running request
PREFILL = 10_000.0  # the projection's nominal prefill rate (kvgate.agent.footprint)


def ledger(clock: ManualClock) -> ReservationLedger:
    return ReservationLedger(clock, 3600, 3600, decode_rate=lambda: RATE)


def budget(capacity: int = 100_000) -> Budget:
    return Budget(capacity, 1.0, None, True)


# --- the projection ------------------------------------------------------------------------------


def test_past_its_estimated_prefill_a_request_not_yet_started_is_projected_growing_from_now() -> None:
    """10,000 prompt tokens are 1 s of prefill at the nominal rate; 3 s later the estimate has it 100
    tokens into its output. Told it has not started, it has generated nothing and ends a whole budget
    of steps from now."""
    estimated = project(10_000, 500, 3.0, RATE)
    waiting = project(10_000, 500, 3.0, RATE, first_token=FirstToken(None))
    assert (estimated.generated, estimated.ends_in) == (100, 400)
    assert (waiting.generated, waiting.ends_in) == (0, 500)


def test_before_its_estimated_prefill_ends_a_request_not_yet_started_keeps_the_estimate() -> None:
    assert project(10_000, 500, 0.5, RATE, first_token=FirstToken(None)) == project(10_000, 500, 0.5, RATE)


def test_once_started_a_request_decodes_from_its_first_token_not_from_its_estimated_prefill() -> None:
    """Granted 3 s ago, its first token 1 s ago: 50 tokens generated, 450 steps left (the estimate
    would say 100 and 400)."""
    started = project(10_000, 500, 3.0, RATE, first_token=FirstToken(1.0))
    assert (started.generated, started.ends_in) == (50, 450)


# --- the ledger ----------------------------------------------------------------------------------


def test_a_reservation_that_awaits_its_first_token_holds_more_of_the_future_than_an_estimated_one() -> None:
    clock = ManualClock(0.0)
    told, estimated = ledger(clock), ledger(clock)
    told.reserve("r", 10_500, 0, budget(), output_tokens=500, reports_first_token=True)
    estimated.reserve("r", 10_500, 0, budget(), output_tokens=500)
    clock.advance(3.0)
    # The peak is the same (it reaches its full size either way); when it ends is not: a request not
    # yet decoding is not due for another 500 steps.
    assert told.commitment(budget()).peak == estimated.commitment(budget()).peak == 10_500
    waiting_end = expected_releases(told.live(), clock(), RATE)[0].after_s
    estimated_end = expected_releases(estimated.live(), clock(), RATE)[0].after_s
    assert waiting_end == pytest.approx(500 / RATE)
    assert estimated_end == pytest.approx(500 / RATE - 3.0), "the estimate counts from the grant"

    assert told.first_token("r")
    clock.advance(4.0)
    assert expected_releases(told.live(), clock(), RATE)[0].after_s == pytest.approx(500 / RATE - 4.0)


def test_a_later_request_fits_beside_one_whose_first_token_says_it_is_nearly_done() -> None:
    """1,000 prompt + 1,000 output each, on a node that admits 3,200. Decoding since its first token
    18 s ago (900 generated, 100 left), the first one's peak and a new one's meet at 3,100; not yet
    started for all the node knows, they meet at 4,000."""
    clock = ManualClock(0.0)
    told, untold = ledger(clock), ledger(clock)
    for node in (told, untold):
        assert node.reserve(
            "old", 2_000, 0, budget(3_200), output_tokens=1_000, reports_first_token=True
        ).granted
    clock.advance(1.0)
    assert told.first_token("old")
    clock.advance(18.0)
    assert told.reserve("new", 2_000, 0, budget(3_200), output_tokens=1_000).granted
    assert untold.reserve("new", 2_000, 0, budget(3_200), output_tokens=1_000).reason == (
        ReserveReason.INSUFFICIENT_HEADROOM
    )


def test_a_first_token_is_taken_once_and_only_from_the_holder_that_reserved() -> None:
    clock = ManualClock(0.0)
    node = ledger(clock)
    node.reserve("r", 2_000, 0, budget(), "gate-a", output_tokens=1_000, reports_first_token=True)
    assert not node.first_token("r", "gate-b"), "another holder's word changes nothing"
    assert not node.first_token("unknown", "gate-a")
    assert node.first_token("r", "gate-a")
    assert not node.first_token("r", "gate-a"), "told already"
    node.release("r", "gate-a")
    assert not node.first_token("r", "gate-a"), "a released reservation takes no first token"


def test_without_a_generated_count_the_output_learned_is_the_hold_since_the_first_token() -> None:
    learned: list[int] = []

    class Recorded(OutputHistory):
        def learn(self, tokens: int) -> None:
            learned.append(tokens)

    clock = ManualClock(0.0)
    node = ReservationLedger(clock, 3600, 3600, decode_rate=lambda: RATE, outputs=Recorded())
    for request_id in ("told", "untold"):
        node.reserve(request_id, 2_000, 0, budget(), output_tokens=1_000, reports_first_token=True)
    clock.advance(5.0)  # queued and prefilling
    node.first_token("told")
    clock.advance(2.0)
    node.release("told")
    node.release("untold")
    assert learned == [2 * RATE, 7 * RATE], "2 s of decoding; without the word, the hold from the grant"


# --- over gRPC -----------------------------------------------------------------------------------


def test_first_token_over_grpc_answers_whether_a_live_reservation_of_the_caller_took_it() -> None:
    async def scenario() -> None:
        settings = NodeSettings("n1", "127.0.0.1:8000", capacity_tokens=40_000)
        async with running_agent(settings) as (agent, address):
            gate = client(address)
            try:
                reserved = await gate.reserve(
                    "r", 2_000, 60, "gate", 5.0, output_tokens=1_000, reports_first_token=True
                )
                assert reserved.granted
                assert agent.state.ledger.live()[0].reports_first_token
                answers = [
                    await gate.first_token("r", "other-gate", 5.0),
                    await gate.first_token("r", "gate", 5.0),
                    await gate.first_token("r", "gate", 5.0),
                ]
                with pytest.raises(HeadroomError, match="FirstToken failed: INVALID_ARGUMENT"):
                    await gate.first_token("x" * 300, "gate", 5.0)
            finally:
                await gate.close()
            assert answers == [False, True, False]
            assert agent.state.ledger.live()[0].first_token_at is not None

    asyncio.run(scenario())
