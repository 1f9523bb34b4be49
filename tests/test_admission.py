"""Admission against a headroom view, driven in-process: the cases end-to-end tests cannot time."""

from __future__ import annotations

import asyncio
import contextlib

from test_water import node

from kvgate.config import AdmissionConfig, ModelConfig
from kvgate.gate.admission import Admission
from kvgate.headroom.snapshot import NodeView, ReleaseOutcome
from kvgate.policy import Reason, Route


class SlowAgentView:
    """One healthy node whose agent never answers Reserve; Release is recorded."""

    def __init__(self) -> None:
        self.reserving = asyncio.Event()
        self.released: list[str] = []

    def snapshot(self) -> tuple[NodeView, ...]:
        return (node("a", 30000),)

    async def reserve(self, agent: str, request_id: str, tokens: int, lease_s: float | None = None) -> None:
        self.reserving.set()
        await asyncio.sleep(3600)

    async def release(self, agent: str, request_id: str) -> ReleaseOutcome:
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
        admit = asyncio.create_task(
            admission.admit(Route("long", Reason.LONG, 12000), ModelConfig(), None, "r1")
        )
        await asyncio.wait_for(view.reserving.wait(), 5)
        admit.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await admit
        for _ in range(10):
            await asyncio.sleep(0)
        return view.released

    assert asyncio.run(scenario()) == ["r1"]
