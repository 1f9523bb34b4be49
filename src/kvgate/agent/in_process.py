"""In-process agents for driving admission without gRPC, Envoy or processes: a real, tested fake.

`FakeHeadroom` answers what the gate's `HeadroomView` answers (snapshot, reserve, release,
wait_update) for a set of simulated nodes. Each node grants reservations through the agent's own
`ReservationLedger`, so a grant here is exactly a grant an agent would make: atomic, charged at
once, refused past the headroom, released or expired on its lease. Time comes from an injected
clock (`ManualClock` for tests): staleness of a node's last message and lease expiry follow it.

Script it: `update` is a message from the node's agent (new usage, health), `go_silent` stops its
messages (it goes stale as the clock moves), `disconnect` drops its stream, `restart_agent` gives it
a new, empty ledger (what a restarted agent remembers), `fail_reserves` makes its Reserve calls fail
as an unreachable agent's do, `evict_prefixes` is the node's engine evicting idle prefix blocks,
`measure_decode_rate` is its agent measuring the engine's per-request decode rate.
Reservations that carry a prefix chain share held blocks as the agent's do, and each node's messages
carry the agent's prefix summary, its reservations' expected releases (at the measured decode rate) and
the tokens ended reservations freed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvgate.agent.backfill import Waiter, WaitingClaims
from kvgate.agent.ledger import Budget, ReservationLedger
from kvgate.agent.releases import expected_releases
from kvgate.agent.tenant_service import TenantService
from kvgate.config.headroom import stale_after
from kvgate.errors import AgentCallError, HeadroomError
from kvgate.headroom.snapshot import (
    CapacitySource,
    ExpectedRelease,
    NodeHeadroom,
    NodeView,
    PrefixChain,
    ReleaseOutcome,
    ReserveOutcome,
    TenantCharge,
    admissible,
)


class ManualClock:
    """A monotonic clock that moves only when told to, and sleeps that end as it moves."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock does not go back"
        self.now += seconds
        for until, woken in self._sleepers:
            if until <= self.now and not woken.done():
                woken.set_result(None)

    @property
    def sleeping(self) -> int:
        """Sleeps not yet over: how a test knows its waiters are waiting before it moves the clock."""
        return sum(1 for _, woken in self._sleepers if not woken.done())

    async def sleep(self, seconds: float) -> None:
        """Return once the clock has been advanced `seconds` from now (on the next turn of the loop when
        that is not in the future)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        sleeper = (self.now + seconds, asyncio.get_running_loop().create_future())
        self._sleepers.append(sleeper)
        try:
            await sleeper[1]
        finally:
            self._sleepers.remove(sleeper)


@dataclass(slots=True)
class _Node:
    name: str
    endpoint: str
    capacity_tokens: int
    safety_ratio: float
    used_tokens: int
    kv_usage: float | None
    healthy: bool
    reason: str
    ledger: ReservationLedger
    claims: WaitingClaims
    received_at: float
    seq: int = 1
    connected: bool = True
    silent: bool = False
    failing_reserves: int = 0
    granting_unanswered: bool = False
    decode_tokens_per_s: float | None = None
    heartbeat_ms: int = 0  # 0: the agent sends every period; else on change and at least this often
    tenant_service: TenantService = field(default_factory=TenantService)

    def budget(self) -> Budget:
        return Budget(self.capacity_tokens, self.safety_ratio, self.used_tokens, self.healthy, self.reason)


class FakeHeadroom:
    def __init__(
        self,
        clock: Callable[[], float],
        stale_after_s: float = 0.5,
        lease_s: float = 300.0,
    ) -> None:
        self._clock = clock
        self._stale_after_s = stale_after_s
        self._lease_s = lease_s
        self._nodes: dict[str, _Node] = {}
        self._update = asyncio.Event()
        self.released: list[tuple[str, str]] = []
        self.first_tokens: list[tuple[str, str]] = []  # (node, request id) of each FirstToken
        self.renewals: list[tuple[str, tuple[str, ...]]] = []  # (node, ids) of each Renew
        # Every Reserve answered, in order: (node, request id, whether it holds its slot there).
        self.reserves: list[tuple[str, str, bool]] = []

    def add_node(
        self,
        name: str,
        capacity_tokens: int,
        *,
        used_tokens: int = 0,
        safety_ratio: float = 1.0,
        healthy: bool = True,
        heartbeat_ms: int = 0,
    ) -> None:
        """`heartbeat_ms`: the node's agent sends on change and at least this often (0: every period);
        the node stays fresh for a few heartbeats without a message (kvgate.config.headroom)."""
        self._nodes[name] = _Node(
            name=name,
            endpoint=f"{name}.engine:8000",
            capacity_tokens=capacity_tokens,
            safety_ratio=safety_ratio,
            used_tokens=used_tokens,
            kv_usage=used_tokens / capacity_tokens if capacity_tokens else None,
            healthy=healthy,
            reason="" if healthy else "unhealthy",
            ledger=self._new_ledger(),
            claims=WaitingClaims(self._clock),
            received_at=self._clock(),
            heartbeat_ms=heartbeat_ms,
        )
        self._notify()

    def update(
        self, name: str, *, used_tokens: int | None = None, healthy: bool | None = None, reason: str = ""
    ) -> None:
        """A new message from the node's agent, fresh as of now."""
        node = self._nodes[name]
        if used_tokens is not None:
            node.used_tokens = used_tokens
            node.kv_usage = used_tokens / node.capacity_tokens if node.capacity_tokens else None
        if healthy is not None:
            node.healthy = healthy
            node.reason = reason
        node.silent = False
        node.connected = True
        node.received_at = self._clock()
        node.seq += 1
        self._notify()

    def tick(self) -> None:
        """Every agent that is not silent sends its next message (what each does every period)."""
        for node in self._nodes.values():
            if not node.silent and node.connected:
                node.received_at = self._clock()
                node.seq += 1
        self._notify()

    def go_silent(self, name: str) -> None:
        self._nodes[name].silent = True

    def disconnect(self, name: str) -> None:
        self._nodes[name].connected = False
        self._notify()

    def reconnect(self, name: str) -> None:
        self._nodes[name].connected = True
        self._notify()

    def restart_agent(self, name: str) -> None:
        """The agent process starts again: its reservations are forgotten."""
        node = self._nodes[name]
        node.ledger = self._new_ledger()
        node.claims = WaitingClaims(self._clock)
        self.update(name)

    def fail_reserves(self, name: str, times: int = 1, *, granted: bool = False) -> None:
        """The next `times` Reserve calls to this node get no answer (AgentCallError), as when its
        agent is unreachable; with `granted`, as when the agent granted them and the answer was lost
        (too late for the caller's deadline)."""
        self._nodes[name].failing_reserves = times
        self._nodes[name].granting_unanswered = granted

    def evict_prefixes(self, name: str, tokens: int | None = None) -> None:
        """The node's engine evicts idle prefix blocks (all of them, or `tokens` of them, least recently
        used first), and its agent, told by the engine's signals, forgets them."""
        prefixes = self._nodes[name].ledger.prefixes
        prefixes.evict(prefixes.idle_tokens if tokens is None else tokens)
        self.update(name)

    def measure_decode_rate(self, name: str, tokens_per_s: float | None) -> None:
        """The node's agent has measured (or lost) its engine's output tokens per second per request."""
        self._nodes[name].decode_tokens_per_s = tokens_per_s
        self.update(name)

    def reserved_tokens(self, name: str) -> int:
        return self._nodes[name].ledger.reserved_tokens

    def snapshot(self) -> tuple[NodeView, ...]:
        now = self._clock()
        return tuple(
            NodeView.seen(
                name,
                self._headroom(node),
                node.received_at,
                now=now,
                connected=node.connected,
                stale_after_s=stale_after(self._stale_after_s, node.heartbeat_ms),
            )
            for name, node in sorted(self._nodes.items())
        )

    async def wait_update(self, timeout_s: float) -> bool:
        try:
            # Not asyncio.wait_for: on Python 3.11 it can swallow a cancel that meets a set event.
            async with asyncio.timeout(timeout_s):
                await self._update.wait()
        except TimeoutError:
            return False
        return True

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
    ) -> ReserveOutcome:
        """As the agent's Reserve: its ledger, capped and claimed by the node's waiting order
        (kvgate.agent.backfill) as NodeState.reserve does."""
        state = self._answering(node)
        if state.failing_reserves > 0:
            state.failing_reserves -= 1
            if state.granting_unanswered:
                state.ledger.reserve(request_id, tokens, self._lease_s, state.budget(), prefix=prefix)
                self._notify()
            raise AgentCallError(f"agent {node}: Reserve failed: DEADLINE_EXCEEDED: no answer in time")
        budget = state.budget()
        waiter = Waiter("", request_id, rank, waiting_since_unix_ns, fair_service)
        caps = state.claims.caps(waiter, lambda: state.ledger.headroom(budget), lambda: self._releases(state))
        outcome = state.ledger.reserve(
            request_id,
            tokens,
            self._lease_s,
            budget,
            prefix=prefix,
            output_tokens=output_tokens,
            caps=caps,
            reports_first_token=reports_first_token,
        )
        admissible_tokens = admissible(budget.capacity_tokens, budget.safety_ratio)
        state.claims.answered(
            outcome, waiter, tokens, hold_slot=hold_slot, admissible_tokens=admissible_tokens
        )
        self.reserves.append((node, request_id, hold_slot))
        if outcome.granted and charge is not None:
            state.tenant_service.granted(
                request_id, charge, output_tokens, outcome.charged_tokens, reserved=tokens
            )
        await asyncio.sleep(0)  # an answer arrives on a later turn of the loop, as over gRPC
        return outcome

    async def first_token(self, node: str, request_id: str) -> bool:
        state = self._answering(node)
        known = state.ledger.first_token(request_id)
        self.first_tokens.append((node, request_id))
        self._notify()
        return known

    async def release(
        self, node: str, request_id: str, *, unanswered: bool = False, generated_tokens: int = 0
    ) -> ReleaseOutcome:
        state = self._answering(node)
        output = state.ledger.output_generated(request_id, "", generated_tokens)
        released = state.ledger.release(
            request_id, unanswered_reserve=unanswered, generated_tokens=generated_tokens
        )
        if released:
            state.tenant_service.ended(request_id, output, ran=not unanswered)
        state.claims.drop(Waiter("", request_id))
        self.released.append((node, request_id))
        self._notify()
        return state.ledger.release_answer(released, state.budget(), output)

    async def renew(self, node: str, request_ids: Sequence[str]) -> frozenset[str]:
        state = self._answering(node)
        lapsed, _ = state.ledger.renew(request_ids, "", self._lease_s)
        self.renewals.append((node, tuple(request_ids)))
        await asyncio.sleep(0)
        return frozenset(lapsed)

    def _answering(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            raise HeadroomError(f"no agent {name} in the headroom view")
        if not node.connected:
            raise AgentCallError(f"agent {name} is unreachable")
        return node

    def _headroom(self, node: _Node) -> NodeHeadroom:
        budget = node.budget()
        headroom = node.ledger.headroom(budget)
        # As of the node's last message, as an agent's are.
        releases = expected_releases(node.ledger.live(), node.received_at, node.decode_tokens_per_s)
        return NodeHeadroom(
            node=node.name,
            endpoint=node.endpoint,
            seq=node.seq,
            sample_time_unix_ns=0,
            capacity_tokens=node.capacity_tokens,
            safety_ratio=node.safety_ratio,
            used_tokens=node.used_tokens,
            reserved_tokens=node.ledger.reserved_tokens,
            reservations=node.ledger.count,
            headroom_tokens=headroom,
            healthy=node.healthy,
            reason=node.reason,
            capacity_source=CapacitySource.MANUAL,
            kv_usage=node.kv_usage,
            running=None,
            waiting=None,
            preemptions_total=None,
            gpus=(),
            period_ms=100,
            heartbeat_ms=node.heartbeat_ms,
            prefix=node.ledger.prefixes.summary(node.ledger.saved_tokens),
            decode_tokens_per_s=node.decode_tokens_per_s,
            releases=releases,
            freed_tokens_total=node.ledger.freed_tokens,
            head=node.claims.published(headroom, releases),
            tenant_service=node.tenant_service.totals(),
            tenant_held=node.tenant_service.held(),
            tenant_tokens=node.tenant_service.tokens(),
            tenant_lift=node.tenant_service.lifts(),
            publishes_tenant_tokens=True,
        )

    def _releases(self, node: _Node) -> tuple[ExpectedRelease, ...]:
        return expected_releases(node.ledger.live(), self._clock(), node.decode_tokens_per_s)

    def _new_ledger(self) -> ReservationLedger:
        return ReservationLedger(self._clock, self._lease_s, max(self._lease_s, 3600.0))

    def _notify(self) -> None:
        self._update.set()
        self._update = asyncio.Event()
