"""One node's headroom state: the latest samples plus the reservation ledger, turned into NodeHeadroom.

Pure: the agent's adapter feeds it samples and asks it for snapshots and reservations.
Capacity comes from the first source that knows it: the operator's --capacity-tokens, the engine's
own KV pool (kvgate.agent.sources.engines), or the model shape over NVML free memory.
Usage comes from the engine's KV figures when it publishes them. An engine that publishes none
(TGI, llama.cpp), or no engine metrics at all, makes the node reservation-only: usage is what the
ledger holds plus an allowance for each request the engine runs or queues beyond those holding a
reservation, stated as such in the reason. The engine's page only counts requests, so which of them
hold reservations is inferred: a reservation granted more than `ARRIVAL_S` ago is taken to be among
them; a younger one may not have reached the engine yet and is not subtracted (erring high).
A node whose usage is unknown must not look empty: engine figures older than
`engine_stale_after_s`, and figures that stay frozen while the engine says requests run (longer than
the engine's own refresh promise), make it unhealthy.
Reservations that carry a prefix chain share the blocks live reservations hold
(kvgate.agent.prefix_blocks), on engines that say they share cached prefixes (vLLM's
enable_prefix_caching, SGLang's radix cache); idle prefix blocks are forgotten as the engine's KV
fills and when its hit counters fall short (kvgate.agent.prefix_audit). On any other engine a chain
is ignored: every request is charged in full. With the engine's KV events (vLLM's
--kv-events-config, `kv_events` here), what the engine says it holds replaces those guesses wherever
it can be told (kvgate.agent.prefix_events).
The share of capacity granted against starts at --safety-ratio and is steered by the engine's
preemption counter (kvgate.agent.ratio): it rises while requests wait for room here and the engine
preempts nothing, and falls at once when it does.
Each message also says when the live reservations are expected to end (kvgate.agent.releases), at
the per-request decode rate measured from the engine's generation counter
(kvgate.agent.decode_rate), and how many tokens ended reservations have freed in all: what a gate
needs to tell a refused client when to come back.
Every Reserve takes its place in the one waiting order every gate and queue shares: the first waiter
that found no room holds its slot, and whoever is behind it takes only what leaves the slot whole
(kvgate.agent.backfill); the messages show that head.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvgate.agent.backfill import NO_ROOM, Waiter, WaitingClaims
from kvgate.agent.capacity import ModelShape, kv_bytes_per_token, static_capacity_tokens
from kvgate.agent.class_usage import ClassUsage
from kvgate.agent.decode_rate import DecodeRate
from kvgate.agent.kv_events import Batch
from kvgate.agent.ledger import Budget, Cap, Reservation, ReservationLedger
from kvgate.agent.lending import Lending, LendLimits, LendOffer
from kvgate.agent.prefill_backlog import PrefillBacklog
from kvgate.agent.prefill_rate import PrefillRate
from kvgate.agent.prefix_audit import PrefixAudit
from kvgate.agent.prefix_blocks import PrefixBlocks
from kvgate.agent.prefix_events import PrefixEvents
from kvgate.agent.ratio import FREEZE_S, RatioSettings, SteeredRatio
from kvgate.agent.releases import expected_releases
from kvgate.agent.sources.engines import EngineReading, PageState
from kvgate.agent.tenant_service import TenantService
from kvgate.headroom.snapshot import (
    CapacitySource,
    ExpectedRelease,
    LedgerFigures,
    NodeHeadroom,
    NodeRole,
    NvmlReading,
    PrefixChain,
    PrefixSummary,
    ReleaseOutcome,
    ReserveOutcome,
    ReserveReason,
    TenantCharge,
    UsageSource,
    admissible,
)

# A granted request reaches its engine (and the engine's request count) within this long.
ARRIVAL_S = 1.0
# The longest lease granted by default: above the gate's own lease (headroom.lease_s, 600 s) and far
# above the queue's (queue.reservation_lease_s, 60 s, renewed every claim_lease_s / 3), so neither is
# cut; a quarter of the hour a lost or hostile reservation could hold a node for before.
MAX_LEASE_S = 900.0
# What one holder's live reservations may be charged together by default, in tokens: 2^20, more than
# one holder is expected to hold on one node (an 80 GB GPU's KV for an 8B model is ~450k tokens) and
# far above the demo's and tests' nodes, so a single gate is never held back by it; a bound on a
# holder that leaks reservations or takes the node whole (docs/operations.md, agent --max-holder-tokens).
MAX_HOLDER_TOKENS = 1 << 20
# The stream's prefix summary is rebuilt at most this often (NodeState._prefix_summary).
SUMMARY_EVERY_S = 0.5
# Refusals that say a request waits for room here: what lets the admissible ratio rise.
_ROOM_WANTED = NO_ROOM | {ReserveReason.LEND_LIMIT}


@dataclass(frozen=True, slots=True)
class NodeSettings:
    node: str
    endpoint: str
    period_s: float = 0.1
    safety_ratio: float = 0.9
    capacity_tokens: int | None = None
    model_shape: ModelShape | None = None
    gpu_memory_utilization: float = 0.9
    default_lease_s: float = 300.0
    max_lease_s: float = MAX_LEASE_S
    # None: no cap beyond the node's headroom.
    max_holder_tokens: int | None = MAX_HOLDER_TOKENS
    engine_stale_after_s: float = 1.0
    # Reservation-only: what one engine request holding no reservation is assumed to hold.
    unreserved_request_tokens: int = 4096
    # Prefix blocks remembered (in use or idle), and how many the stream's summary shows.
    prefix_index_blocks: int = 16384
    prefix_summary_blocks: int = 1024
    # Where the engine's KV events come from ("" when they are not followed), and how many of its
    # blocks are followed at most.
    kv_events: str = ""
    kv_events_max_blocks: int = 262_144
    # The node's part in a soft pool, and, for an interactive node, what it lends long requests
    # (kvgate.agent.lending; its prefill rate also turns prefill tokens into seconds per class).
    role: NodeRole = NodeRole.LONG
    lending: LendLimits = field(default_factory=LendLimits)
    # The admissible ratio steered by the engine's preemptions (kvgate.agent.ratio): safety_ratio is
    # where it starts; None bounds: the start - 0.10 and 0.98. Bounds equal to the start fix it.
    safety_ratio_min: float | None = None
    safety_ratio_max: float | None = None
    safety_ratio_freeze_s: float = FREEZE_S
    # The stream sends on change and at least every heartbeat_s (0: every period, as agents did
    # before; kvgate.agent.push); the engine is scraped every period under pressure and every
    # idle_scrape_s otherwise (None: every period; kvgate.agent.cadence). `kvgate agent` defaults to
    # 1 s and 0.5 s; these defaults keep the every-period agent for embedders and tests.
    heartbeat_s: float = 0.0
    idle_scrape_s: float | None = None

    def __post_init__(self) -> None:
        if self.heartbeat_s and self.heartbeat_s < self.period_s:
            raise ValueError(f"heartbeat_s must be 0 or >= period_s, got {self.heartbeat_s}")
        if self.idle_scrape_s is not None:
            if self.idle_scrape_s < self.period_s:
                raise ValueError(f"idle_scrape_s must be >= period_s, got {self.idle_scrape_s}")
            # The oldest figures a slow scrape leaves: its interval plus its timeout (half a period).
            oldest = self.idle_scrape_s + self.period_s / 2
            if self.engine_stale_after_s <= oldest:
                raise ValueError(
                    f"engine_stale_after_s ({self.engine_stale_after_s}) must exceed the idle scrape "
                    f"interval plus its timeout ({oldest:g} s): a quiet node would flap unhealthy"
                )
        self.ratio()  # ValueError for bounds that do not hold

    def ratio(self) -> RatioSettings:
        return RatioSettings.around(
            self.safety_ratio, self.safety_ratio_min, self.safety_ratio_max, self.safety_ratio_freeze_s
        )


@dataclass(frozen=True, slots=True)
class _EngineSample:
    reading: EngineReading | None
    taken_at: float
    error: str
    changed_at: float  # when the reading's figures last differed from the one before


@dataclass(frozen=True, slots=True)
class _Assessment:
    budget: Budget
    source: CapacitySource
    rule: str
    usage: UsageSource
    engine: EngineReading | None
    unreserved: int | None


class NodeState:
    def __init__(
        self, settings: NodeSettings, clock: Callable[[], float], uses_engine: bool, uses_nvml: bool
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._uses_engine = uses_engine
        self._uses_nvml = uses_nvml
        prefixes = PrefixBlocks(settings.prefix_index_blocks, settings.prefix_summary_blocks)
        self.ledger = ReservationLedger(
            clock,
            settings.default_lease_s,
            settings.max_lease_s,
            prefixes,
            max_holder_tokens=settings.max_holder_tokens,
            # Reservations follow use once the engine's decode rate is measured (read when needed).
            decode_rate=lambda: self.decode_rate.tokens_per_s,
        )
        self._audit = PrefixAudit(ARRIVAL_S)
        self.prefix_events = (
            PrefixEvents(prefixes, settings.kv_events, settings.kv_events_max_blocks)
            if settings.kv_events
            else None
        )
        self._forgotten = 0  # idle prefix tokens the guesses forgot (free KV, the hit counters' audit)
        self._engine = _EngineSample(None, float("-inf"), "engine metrics: no sample yet", float("-inf"))
        self._nvml: NvmlReading | None = None
        self._seq = 0
        self._grants: deque[float] = deque()  # when reservations were granted, the last ARRIVAL_S
        self._bytes_per_token = kv_bytes_per_token(settings.model_shape) if settings.model_shape else None
        self.decode_rate = DecodeRate()
        self.claims = WaitingClaims(clock)
        self.lending = Lending(settings.lending) if settings.role is NodeRole.INTERACTIVE else None
        self.prefill = PrefillBacklog(settings.lending.prefill_tokens_per_s)
        self.prefill_rate = PrefillRate()
        self.tenant_service = TenantService()
        self.class_usage = ClassUsage()
        self.ratio = SteeredRatio(settings.ratio(), clock())
        # The latest Reserve that waited or found no room: the engine is scraped every period for a
        # while after (kvgate.agent.cadence).
        self.waited_at = float("-inf")
        self._summary: PrefixSummary | None = None
        self._summary_at = float("-inf")

    def observe_engine(self, reading: EngineReading) -> None:
        now = self._clock()
        before = self._engine.reading
        if self.prefix_events is not None and before is not None and _restarted(before, reading):
            self.prefix_events.engine_restarted()
        changed = self._engine.changed_at
        if self._engine.reading is None or _figures(reading) != _figures(self._engine.reading):
            changed = now
        self._engine = _EngineSample(reading, now, "", changed)
        self._age_prefixes(now, reading)
        self.decode_rate.observe(now, reading.generation_tokens_total, reading.running)
        self.prefill_rate.observe(
            now, reading.finished_prompt_tokens_sum, reading.finished_prefill_seconds_sum
        )
        measured = self.prefill_rate.tokens_per_s
        nominal = self.settings.lending.prefill_tokens_per_s
        # An engine slower than --prefill-tokens-per-s drains its backlog slower: a lent prompt holds
        # chat up for as long as the engine, not the flag, takes to prefill it.
        self.prefill.follow(now, nominal if measured is None else min(nominal, measured))
        self._observe_classes(now, reading)
        self.ratio.observe(now, reading.preemptions_total, reading.kv_usage)

    def _observe_classes(self, now: float, reading: EngineReading) -> None:
        """Chat's use (the engine's less what reservations hold) for the lending rule and the
        per-class figures (kvgate.agent.class_usage)."""
        reserved = self.ledger.reserved_tokens
        self.class_usage.observe(now, reserved, reading.used_tokens)
        self.class_usage.observe_prefill(reading.prompt_tokens_total, reading.prefix_hits_total)
        if self.lending is not None and reading.used_tokens is not None:
            self.lending.observe_chat(now, max(0, reading.used_tokens - reserved))

    def _age_prefixes(self, now: float, reading: EngineReading) -> None:
        """Forget idle prefix blocks the engine can no longer hold: they must fit in its free KV (it
        evicts cached blocks only to make room), and its hit counters must not fall short."""
        prefixes = self.ledger.prefixes
        if reading.capacity_tokens is not None and reading.used_tokens is not None:
            self._forgotten += prefixes.fit_idle(reading.capacity_tokens - reading.used_tokens)
        shortfall = self._audit.observe(
            now, reading.prefix_hits_total, reading.cache_hit_rate, reading.waiting
        )
        self._forgotten += prefixes.evict(shortfall)

    @property
    def prefix_forgotten(self) -> int:
        """Idle prefix tokens forgotten by the engine's signals, in all: its free KV and hit counters,
        and its KV events where they are followed."""
        events = self.prefix_events.stats.forgotten_tokens if self.prefix_events is not None else 0
        return self._forgotten + events

    def observe_kv_events(self, batches: list[Batch]) -> None:
        """The engine's KV-event batches received since the last call, in order; called every period,
        with none as well."""
        if self.prefix_events is None:
            return
        for batch in batches:
            self.prefix_events.apply(batch)
        self.prefix_events.settle(self._clock(), {r.request_id for r in self.ledger.live()})

    def engine_failed(self, error: str) -> None:
        self._engine = _EngineSample(
            self._engine.reading, self._engine.taken_at, error, self._engine.changed_at
        )

    def observe_nvml(self, reading: NvmlReading) -> None:
        self._nvml = reading

    def budget(self) -> Budget:
        return self._assess().budget

    def reserve(
        self,
        request_id: str,
        tokens: int,
        lease_s: float,
        holder: str = "",
        *,
        prefix: PrefixChain | None = None,
        output_tokens: int = 0,
        waiting_since_unix_ns: int = 0,
        rank: int = 0,
        fair_service: float = 0.0,
        hold_slot: bool = False,
        charge: TenantCharge | None = None,
        reports_first_token: bool = False,
    ) -> ReserveOutcome:
        """`waiting_since_unix_ns`, `rank` and `fair_service`: the request's place in the one waiting
        order (a waiting time of 0: a try that names none, behind every waiter); `hold_slot`: a waiter
        that finds no room here keeps its claim on the node (kvgate.agent.backfill); `charge`: its
        tenant's cost, for fair shares (kvgate.agent.tenant_service); `reports_first_token`: its
        holder will say when the engine starts answering it (first_token)."""
        shares = self._engine.reading is not None and self._engine.reading.prefix_caching is True
        chain = prefix if shares else None
        budget = self.budget()
        waiter = Waiter(holder, request_id, rank, waiting_since_unix_ns, fair_service)
        head_cap = self.claims.caps(waiter, lambda: self.ledger.headroom(budget), self._releases)
        result = self.ledger.reserve(
            request_id,
            tokens,
            lease_s,
            budget,
            holder,
            prefix=chain,
            output_tokens=output_tokens,
            caps=self._lend_caps(budget, tokens - output_tokens, chain) + head_cap,
            reports_first_token=reports_first_token,
        )
        admissible_tokens = admissible(budget.capacity_tokens, budget.safety_ratio)
        # A request waited for room here: refused it, or granted it after it held its place here. Not a
        # grant to a try that names the time it waits since: a gate names its request's arrival on every
        # try, the first included, and counting those raised the ratio, and kept the engine scraped
        # every period, wherever traffic ran, whether anyone waited or not.
        waited_here = result.reason in _ROOM_WANTED or self.claims.holds(waiter)
        self.claims.answered(result, waiter, tokens, hold_slot=hold_slot, admissible_tokens=admissible_tokens)
        if waited_here:
            self.ratio.waited()
            self.waited_at = self._clock()
        if result.reason == ReserveReason.GRANTED:
            now = self._clock()
            self._grants.append(now)
            self._audit.expect(now, result.cached_tokens)
            uncached = max(0, tokens - output_tokens - result.cached_tokens)
            self.class_usage.granted(uncached)
            self.prefill.granted(now, uncached)
            if self.prefix_events is not None and chain is not None and chain.blocks:
                self.prefix_events.granted(request_id, chain, now, tokens - output_tokens)
            if charge is not None:
                self.tenant_service.granted(
                    request_id, charge, output_tokens, result.charged_tokens, reserved=tokens
                )
        tenant = charge.tenant if charge is not None else None
        return dataclasses.replace(result, after=self._figures(self.budget(), tenant))

    def _releases(self) -> tuple[ExpectedRelease, ...]:
        """When the live reservations are expected to end, from now."""
        return expected_releases(self.ledger.live(), self._clock(), self.decode_rate.tokens_per_s)

    def _lend_caps(self, budget: Budget, prompt_tokens: int, chain: PrefixChain | None) -> tuple[Cap, ...]:
        """On an interactive node every Reserve is a long request borrowing: it may take what the node
        lends (kvgate.agent.lending), and nothing when its uncached prompt is past the node's cap."""
        if self.lending is None:
            return ()
        offer = self._lend_offer(budget)
        cached = self.ledger.prefixes.cached_blocks(chain) * chain.block_tokens if chain is not None else 0
        fits = prompt_tokens - cached <= offer.max_prompt_tokens
        return (Cap(offer.tokens if fits else 0, ReserveReason.LEND_LIMIT),)

    def _lend_offer(self, budget: Budget) -> LendOffer:
        assert self.lending is not None
        now = self._clock()
        return self.lending.offer(
            admissible(budget.capacity_tokens, budget.safety_ratio),
            budget.capacity_tokens,
            self.ledger.reserved_tokens,
            self.prefill.tokens(now),
            self.prefill.tokens_per_s,
            prefilling=self.prefill.prompts(now),
        )

    def first_token(self, request_id: str, holder: str = "") -> bool:
        """The engine sent the request its first token (kvgate.agent.ledger.ReservationLedger.first_token)."""
        return self.ledger.first_token(request_id, holder)

    def release(
        self,
        request_id: str,
        holder: str = "",
        *,
        unanswered_reserve: bool = False,
        generated_tokens: int = 0,
    ) -> ReleaseOutcome:
        # The tenant's charge is settled on what ran: the answer's count where the releaser read it,
        # else the engine's measured rate over the hold, not the output budget the client declared.
        output = self.ledger.output_generated(request_id, holder, generated_tokens)
        tenant = self.tenant_service.tenant_of(request_id)
        released = self.ledger.release(
            request_id, holder, unanswered_reserve=unanswered_reserve, generated_tokens=generated_tokens
        )
        if released:
            # An unanswered Reserve's grant ran nothing: its caller never sent the request there.
            self.tenant_service.ended(request_id, output, ran=not unanswered_reserve)
        # A waiter that went elsewhere or gave up says so with a Release: its claim goes with it.
        self.claims.drop(Waiter(holder, request_id))
        budget = self.budget()
        answer = self.ledger.release_answer(released, budget, output)
        return dataclasses.replace(answer, after=self._figures(budget, tenant if released else None))

    def _figures(self, budget: Budget, tenant: str | None) -> LedgerFigures:
        """The figures a call changed, as the next stream message would show them (by the budget after
        the call: a reservation-only node's usage is its reservations), `tenant`'s standing among them
        where the call charged or settled one: its caller's view takes them at once, so the stream need
        not send it what the call alone changed (kvgate.agent.subscribers)."""
        return LedgerFigures(
            self.ledger.headroom(budget),
            self.ledger.reserved_tokens,
            self.ledger.count,
            self.ledger.freed_tokens,
            self._releases(),
            self._seq,
            self.tenant_service.standing(tenant) if tenant is not None else None,
        )

    def renew(self, request_ids: Sequence[str], holder: str, lease_s: float) -> tuple[list[str], float]:
        """Extend `holder`'s leases of `request_ids`: the ids it holds nothing under, and the lease."""
        return self.ledger.renew(request_ids, holder, lease_s)

    def expire(self) -> list[Reservation]:
        """End the reservations whose lease ran out; every one ended since the last call (a Reserve,
        Renew or Release may have ended some first)."""
        lapsed = self.ledger.take_expired()
        for reservation in lapsed:
            self.tenant_service.ended(reservation.request_id)
        return lapsed

    def snapshot(self, sample_time_unix_ns: int) -> NodeHeadroom:
        """The next message of the stream (its seq is one more than the last one's)."""
        self._seq += 1
        now = self._clock()
        a = self._assess()
        engine = a.engine
        budget = a.budget
        kv_usage = engine.kv_usage if engine is not None and a.usage is UsageSource.ENGINE else None
        if a.usage is UsageSource.RESERVATIONS and budget.capacity_tokens > 0:
            kv_usage = (budget.observed_tokens or 0) / budget.capacity_tokens
        last = self._engine.reading
        offer = self._lend_offer(budget) if self.lending is not None else None
        releases = self._releases()
        headroom = self.ledger.headroom(budget)
        return NodeHeadroom(
            node=self.settings.node,
            endpoint=self.settings.endpoint,
            seq=self._seq,
            sample_time_unix_ns=sample_time_unix_ns,
            capacity_tokens=budget.capacity_tokens,
            safety_ratio=budget.safety_ratio,
            used_tokens=budget.observed_tokens,
            reserved_tokens=self.ledger.reserved_tokens,
            reservations=self.ledger.count,
            headroom_tokens=headroom,
            healthy=budget.healthy,
            reason=budget.reason,
            capacity_source=a.source,
            kv_usage=kv_usage,
            running=engine.running if engine else None,
            waiting=engine.waiting if engine else None,
            preemptions_total=engine.preemptions_total if engine else None,
            gpus=self._nvml.gpus if self._nvml else (),
            period_ms=round(self.settings.period_s * 1000),
            engine_kind=last.kind.value if last else "",
            engines=last.engines if last else (),
            capacity_rule=a.rule,
            usage_source=a.usage,
            unreserved_tokens=a.unreserved,
            engine_sample_age_ms=(
                round((now - self._engine.taken_at) * 1000) if self._engine.reading is not None else None
            ),
            prefix=self._prefix_summary(now),
            decode_tokens_per_s=self.decode_rate.tokens_per_s,
            releases=releases,
            freed_tokens_total=self.ledger.freed_tokens,
            prefix_source=self._prefix_source(last),
            role=self.settings.role,
            lend_tokens=offer.tokens if offer is not None else None,
            lend_max_prompt_tokens=offer.max_prompt_tokens if offer is not None else 0,
            heartbeat_ms=round(self.settings.heartbeat_s * 1000),
            head=self.claims.published(headroom, releases),
            prefill_backlog_tokens=math.ceil(self.prefill.tokens(now)),
            prefill_tokens_per_s=self.prefill.tokens_per_s,
            tenant_service=self.tenant_service.totals(),
            tenant_held=self.tenant_service.held(),
            tenant_tokens=self.tenant_service.tokens(),
            tenant_lift=self.tenant_service.lifts(),
            publishes_tenant_tokens=True,
            # A fact of the engine's start, not of one sample: the last one known holds.
            max_model_len=(last.max_model_len or 0) if last is not None else 0,
        )

    def _prefix_summary(self, now: float) -> PrefixSummary:
        """The prefix summary the stream shows, rebuilt at most every SUMMARY_EVERY_S: under load every
        grant and release changes it, and each rebuild costs the agent a walk of its index and every
        gate a new block set to read (issue 28's profile: the agents' largest per-request cost with
        prefix placement on). A summary half a second old places a repeat as well."""
        if self._summary is None or now - self._summary_at >= SUMMARY_EVERY_S:
            self._summary = self.ledger.prefixes.summary(self.ledger.saved_tokens)
            self._summary_at = now
        return self._summary

    def _prefix_source(self, engine: EngineReading | None) -> str:
        """Where the prefix index comes from, for operators."""
        if engine is None or engine.prefix_caching is not True:
            return "none: the engine does not say it caches prefixes"
        if self.prefix_events is not None:
            return self.prefix_events.describe()
        return "guessed from reservations, the engine's free KV and its hit counters (no KV events)"

    def _assess(self) -> _Assessment:
        engine = self._fresh_engine()
        capacity, source, rule = self._capacity(engine)
        usage, observed, unreserved, note = self._usage(engine, capacity)
        problem = self._problem(engine, capacity)
        healthy = not problem
        budget = Budget(capacity, self.ratio.value, observed, healthy, problem or note)
        return _Assessment(budget, source, rule, usage, engine, unreserved)

    def _fresh_engine(self) -> EngineReading | None:
        if self._clock() - self._engine.taken_at > self.settings.engine_stale_after_s:
            return None
        return self._engine.reading

    def _capacity(self, engine: EngineReading | None) -> tuple[int, CapacitySource, str]:
        if self.settings.capacity_tokens is not None:
            return self.settings.capacity_tokens, CapacitySource.MANUAL, "--capacity-tokens"
        if engine is not None and engine.capacity_tokens is not None:
            return engine.capacity_tokens, CapacitySource.ENGINE, engine.rule
        if self._bytes_per_token is not None and self._nvml is not None:
            static = static_capacity_tokens(
                self._nvml.gpus, self._bytes_per_token, self.settings.gpu_memory_utilization
            )
            if static is not None:
                return static, CapacitySource.STATIC, "model shape over free GPU memory"
        return 0, CapacitySource.NONE, engine.rule if engine is not None else ""

    def _usage(
        self, engine: EngineReading | None, capacity: int
    ) -> tuple[UsageSource, int | None, int | None, str]:
        """Where usage comes from, the tokens observed, the unreserved allowance, and a note for a
        healthy node."""
        if self._uses_engine and engine is None:
            return UsageSource.NONE, None, None, ""
        if engine is not None and engine.used_tokens is not None:
            if engine.state is PageState.IDLE:
                writes = f"{engine.kind.value} writes it from its first request on"
                note = f"engine idle, usage not yet published ({writes})"
                return UsageSource.ENGINE, 0, None, note
            if engine.state is PageState.NOT_READY:
                return UsageSource.ENGINE, engine.used_tokens, None, f"{_not_ready(engine)} ({engine.rule})"
            return UsageSource.ENGINE, engine.used_tokens, None, ""
        if capacity <= 0:
            return UsageSource.NONE, None, None, ""
        why = f"{engine.rule}" if engine is not None else "no engine metrics"
        requests = None
        if engine is not None and (engine.running is not None or engine.waiting is not None):
            requests = (engine.running or 0) + (engine.waiting or 0)
        if requests is None:
            note = f"reservation-only: {why}; used = reservations (unreserved engine traffic unknown)"
            return UsageSource.RESERVATIONS, self.ledger.reserved_tokens, None, note
        beyond = max(0, requests - self._arrived())
        unreserved = beyond * self.settings.unreserved_request_tokens
        note = (
            f"reservation-only: {why}; used = reservations + {beyond} unreserved requests"
            f" x {self.settings.unreserved_request_tokens} tokens"
        )
        return UsageSource.RESERVATIONS, self.ledger.reserved_tokens + unreserved, unreserved, note

    def _arrived(self) -> int:
        """Live reservations old enough to be among the engine's requests."""
        horizon = self._clock() - ARRIVAL_S
        while self._grants and self._grants[0] < horizon:
            self._grants.popleft()
        return max(0, self.ledger.count - len(self._grants))

    def _problem(self, engine: EngineReading | None, capacity: int) -> str:
        """Why the node cannot take requests, or "" when it can."""
        if self._uses_nvml and (self._nvml is None or not self._nvml.healthy):
            return self._nvml.reason if self._nvml else "nvml: no reading yet"
        if self._uses_engine and engine is None:
            return f"engine_metrics_stale: {self._engine.error or 'no recent sample'}"
        if engine is not None and (frozen := self._frozen(engine)):
            return frozen
        if capacity > 0:
            return ""
        if engine is None:
            return "no_capacity"
        if engine.state is PageState.NO_KV:
            return f"{engine.rule}: no KV gauge to read; set --capacity-tokens to admit on reservations alone"
        return f"{_not_ready(engine)}: {engine.rule}"

    def _frozen(self, engine: EngineReading) -> str:
        promise = engine.busy_refresh_s
        if promise is None or not engine.running:
            return ""
        still = self._clock() - self._engine.changed_at
        if still <= promise:
            return ""
        return (
            f"engine figures frozen: {engine.kind.value} reports {engine.running} running requests but "
            f"its figures have not changed for {still:.0f} s (it refreshes them at least every "
            f"{promise:.0f} s while busy)"
        )


def _not_ready(engine: EngineReading) -> str:
    # An engine that shows its usage but not its capacity is up, only idle (older SGLang).
    return "engine not ready" if engine.used_tokens is None else "engine idle, capacity not yet published"


def _restarted(before: EngineReading, now: EngineReading) -> bool:
    """The engine's counters went back: it restarted (and its prefix cache is empty)."""
    return any(
        b is not None and n is not None and n < b
        for b, n in (
            (before.prefix_queries_total, now.prefix_queries_total),
            (before.generation_tokens_total, now.generation_tokens_total),
        )
    )


def _figures(reading: EngineReading) -> tuple[int | None, ...]:
    return (
        reading.capacity_tokens,
        reading.used_tokens,
        reading.running,
        reading.waiting,
        reading.preemptions_total,
    )
