"""Metrics: every name in one place, OpenTelemetry instruments, a Prometheus endpoint.

Names follow OpenTelemetry conventions (dotted, with units); the Prometheus exporter renders them as
`kvgate_gate_decisions_total`, `kvgate_gate_envoy_messages_total`, … The two histograms recorded on
every request are kept by kvgate itself and named as that exporter would name them. Label values are
bounded: pools and reasons come from fixed sets, nodes from the configured agents.

Telemetry never breaks the host: with metrics disabled every instrument is OpenTelemetry's no-op (the
local histograms still count, unread), and an exporter that fails to start is logged, not raised
into the serving path.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.util.types import AttributeValue
from prometheus_client.core import REGISTRY, HistogramMetricFamily, Metric

from kvgate.addresses import split_host_port
from kvgate.names import OTHER_TENANTS

log = logging.getLogger(__name__)

DECISIONS = "kvgate.gate.decisions"
# The two per-request histograms are kept locally (see Histogram), under their Prometheus names.
DECISION_DURATION = "kvgate_gate_decision_duration_seconds"
ESTIMATED_TOKENS = "kvgate_gate_estimated_tokens"
ENVOY_MESSAGES = "kvgate.gate.envoy.messages"
RESERVATIONS = "kvgate.gate.reservations"
ROUTE_POLICY_IGNORED = "kvgate.gate.route_policy.ignored"
# Streams the gate answered with the refusal table's internal_error row (an exception it did not expect).
INTERNAL_ERRORS = "kvgate.gate.internal_errors"
SERVED_ELSEWHERE = "kvgate.gate.picker_served_elsewhere"
FIRST_TOKEN = "kvgate_gate_picker_first_token_seconds"
LEASE_RENEWALS = "kvgate.gate.lease_renewals"
ADMISSION_WAITING = "kvgate.gate.admission.waiting"
EXACT_COUNTS_PENDING = "kvgate.gate.exact_counts.pending"
# What the fast estimate is multiplied by, learnt from exact counts on live traffic (per model match).
ESTIMATE_CORRECTION = "kvgate.gate.estimate.correction"
EVENT_LOOP_LAG = "kvgate.gate.event_loop.lag"
# Per tenant (labels bounded: TenantLabels): long requests by outcome, the service they were given, and,
# with fair shares, each tenant's weighted attained service and waiters (kvgate.policy.fair_share).
TENANT_REQUESTS = "kvgate.gate.tenant.requests"
TENANT_SERVICE = "kvgate.gate.tenant.service"
TENANT_ATTAINED = "kvgate.gate.tenant.attained"
TENANT_WAITING = "kvgate.gate.tenant.waiting"
POOL_WATER_LEVEL = "kvgate.pool.water_level"
POOL_BREAKER_OPEN = "kvgate.pool.breaker.state"
NODE_HEADROOM = "kvgate.node.headroom"
NODE_AGE = "kvgate.node.age"
NODE_FRESH = "kvgate.node.fresh"
AGENT_CAPACITY = "kvgate.agent.capacity"
AGENT_HEADROOM = "kvgate.agent.headroom"
AGENT_USED = "kvgate.agent.used"
AGENT_RESERVED = "kvgate.agent.reserved"
AGENT_RESERVATIONS_LIVE = "kvgate.agent.reservations.live"
AGENT_RESERVATIONS = "kvgate.agent.reservations"
AGENT_HOLDER_TOKENS = "kvgate.agent.holder.tokens"
AGENT_HEALTHY = "kvgate.agent.healthy"
AGENT_SAMPLE_AGE = "kvgate.agent.sample.age"
AGENT_PREFIX_CACHED = "kvgate.agent.prefix.cached"
AGENT_PREFIX_SAVED = "kvgate.agent.prefix.saved"
AGENT_PREFIX_INDEXED = "kvgate.agent.prefix.indexed"
AGENT_PREFIX_SHARED = "kvgate.agent.prefix.shared"
AGENT_PREFIX_FORGOTTEN = "kvgate.agent.prefix.forgotten"
# The admissible ratio steered by the engine's preemptions, and its steps (kvgate.agent.ratio).
AGENT_SAFETY_RATIO = "kvgate.agent.safety_ratio"
AGENT_SAFETY_RATIO_STEPS = "kvgate.agent.safety_ratio.steps"
# What an interactive node lends, and its chat reserve's floor and measured parts (kvgate.agent.lending).
AGENT_LEND = "kvgate.agent.lend_tokens"
AGENT_CHAT_RESERVE = "kvgate.agent.chat_reserve_tokens"
# Stream messages sent, by cause, and engine scrapes (kvgate.agent.push, kvgate.agent.cadence).
AGENT_STREAM_MESSAGES = "kvgate.agent.stream.messages"
AGENT_ENGINE_SCRAPES = "kvgate.agent.engine.scrapes"
# What each class of traffic (chat, long) cost the node, in all (kvgate.agent.class_usage).
AGENT_CLASS_KV = "kvgate.agent.class.kv_token_seconds"
AGENT_CLASS_PREFILL_TOKENS = "kvgate.agent.class.prefill_tokens"
AGENT_CLASS_PREFILL = "kvgate.agent.class.prefill"
PREFIX_HIT_TOKENS = "kvgate.gate.prefix.hit"
PREFIX_SAVED_TOKENS = "kvgate.gate.prefix.saved"
PLACEMENTS = "kvgate.gate.placements"
PLACEMENT_CACHED_FRACTION = "kvgate_gate_placement_cached_fraction"
ADMISSION_DURATION = "kvgate_gate_admission_duration_seconds"
# Retry-After of capacity refusals (kvgate.policy.retry_forecast), kept locally like the two above: what
# clients were told, and when the capacity they were told about freed, less that (signed).
RETRY_AFTER = "kvgate_gate_retry_after_seconds"
RETRY_AFTER_ERROR = "kvgate_gate_retry_after_error_seconds"
RETRY_AFTER_UNRESOLVED = "kvgate.gate.retry_after.unresolved"
# The async queue (kvgate queue).
QUEUE_JOBS = "kvgate.queue.jobs"
QUEUE_OLDEST_JOB_AGE = "kvgate.queue.oldest_job.age"
QUEUE_TOKENS_WAITING = "kvgate.queue.tokens_waiting"
QUEUE_RUNNING = "kvgate.queue.running"
QUEUE_ADMISSIONS = "kvgate.queue.admissions"
QUEUE_ATTEMPTS = "kvgate.queue.attempts"
QUEUE_ABANDONED = "kvgate.queue.abandoned"
QUEUE_INTERNAL_ERRORS = "kvgate.queue.internal_errors"
QUEUE_DISPATCH_WAIT = "kvgate_queue_dispatch_wait_seconds"
# OpenTelemetry hardware semantic conventions for GPUs.
GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"
GPU_MEMORY_USAGE = "hw.gpu.memory.usage"

# Token counts from a few hundred to far past any context window.
_TOKEN_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
_RETRY_BUCKETS = (0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120)
# Signed: positive when the capacity freed after the client was due back (it came too early).
_RETRY_ERROR_BUCKETS = (-30, -10, -5, -2, -1, -0.5, -0.25, 0, 0.25, 0.5, 1, 2, 5, 10, 30)
_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 2.5, 5)
# From a chat's tens of milliseconds to a 128k-token prefill queued behind others.
_FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def start_prometheus(listen: str | None) -> None:
    """Export every meter of this process on http://listen/metrics; None leaves telemetry off."""
    if not listen:
        return
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import start_http_server

    host, port = split_host_port(listen, "the metrics address")
    try:
        start_http_server(port, addr=host)
    except (OSError, OverflowError) as exc:  # OverflowError: a gate worker's port + i past 65535
        log.error("metrics endpoint %s could not start (%s); serving without metrics", listen, exc)
        return
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))
    REGISTRY.register(_HISTOGRAMS)
    log.info("metrics on http://%s/metrics", listen)


def start_otlp(endpoint: str | None, service: str) -> bool:
    """Send traces (and metrics) to an OTLP/gRPC collector; False when no endpoint is configured.

    Without it the tracer is OpenTelemetry's no-op, so the gate never builds spans nobody reads.
    """
    if not endpoint:
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    # Batched and bounded: a slow or absent collector drops spans, it never blocks a request.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    log.info("traces to OTLP collector %s", endpoint)
    return True


def meter(name: str) -> Meter:
    return metrics.get_meter(name)


Gauge = Callable[[], Iterable[tuple[float, dict[str, str]]]]


def observe(meter_: Meter, name: str, unit: str, description: str, read: Gauge) -> None:
    """An observable gauge whose callback never raises into the SDK's collection."""

    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        try:
            return [Observation(value, attributes) for value, attributes in read()]
        except Exception:  # a broken gauge must not break the metrics endpoint
            log.exception("metric %s could not be read", name)
            return []

    meter_.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)


class Tally:
    """Counts kept in a plain dict and read by the SDK at scrape time.

    An SDK counter.add costs about 10 µs; a dict increment about 0.2 µs. On a path that handles each
    request in a few hundred microseconds, the difference is worth an observable counter.
    """

    def __init__(
        self, meter_: Meter, name: str, unit: str, description: str, labels: tuple[str, ...]
    ) -> None:
        self._labels = labels
        self.counts: dict[tuple[str, ...], int] = {}

        def read(_options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(n, dict(zip(self._labels, key, strict=True)))
                for key, n in list(self.counts.items())
            ]

        meter_.create_observable_counter(name, callbacks=[read], unit=unit, description=description)

    def add(self, *key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


class Histogram:
    """A histogram with one label, its bucket counts kept in plain lists and rendered by the Prometheus
    endpoint at scrape time.

    The SDK's Histogram.record costs 10-17 µs (attribute cleaning and hashing in Python); this costs
    about 1 µs. Rendered under the name the SDK's exporter would give it (`name` is that name).
    """

    def __init__(self, name: str, description: str, label: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self._description = description
        self._label = label
        self._bounds = bounds
        # Per label value: one count per bound, one for +Inf, then the sum.
        self._series: dict[str, list[float]] = {}

    def record(self, value: float, label_value: str) -> None:
        series = self._series.get(label_value)
        if series is None:
            series = self._series[label_value] = [0.0] * (len(self._bounds) + 2)
        series[bisect_left(self._bounds, value)] += 1
        series[-1] += value

    @property
    def recorded(self) -> bool:
        return bool(self._series)

    def family(self) -> HistogramMetricFamily:
        # Runs on the scrape thread while the event loop records: list reads are atomic under the
        # GIL, so at worst a bucket and the sum are one request apart.
        family = HistogramMetricFamily(self.name, self._description, labels=[self._label])
        for label_value, series in list(self._series.items()):
            buckets, cumulative = [], 0.0
            for bound, count in zip((*map(str, self._bounds), "+Inf"), series, strict=False):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([label_value], buckets, sum_value=series[-1])
        return family


class _Histograms:
    """The Prometheus collector of this process's Histograms, registered once by start_prometheus."""

    def __init__(self) -> None:
        self.by_name: dict[str, Histogram] = {}

    def collect(self) -> Iterator[Metric]:
        # One with nothing recorded yet is left out, as the SDK leaves out a counter never added to:
        # an endpoint picker's series do not show on a gate that is none.
        for histogram in list(self.by_name.values()):
            if histogram.recorded:
                yield histogram.family()


_HISTOGRAMS = _Histograms()


def histogram(name: str, description: str, label: str, bounds: tuple[float, ...]) -> Histogram:
    """A Histogram exported by this process's metrics endpoint (the latest one of that name)."""
    _HISTOGRAMS.by_name[name] = made = Histogram(name, description, label, bounds)
    return made


# Tenants labelled by name besides those kvgate.yaml names (fairness.tenants); the rest are
# OTHER_TENANTS, as in the queue's per-tenant series.
TENANTS_LABELLED = 20


class TenantLabels:
    """A tenant's label: its name for the tenants kvgate.yaml names and the first `limit` others seen,
    `_other` for the rest, so a client population cannot grow the metrics without bound."""

    def __init__(self, named: Iterable[str] = (), limit: int = TENANTS_LABELLED) -> None:
        self._named = frozenset(named)
        self._limit = limit
        self._seen: set[str] = set()

    def name(self, named: Iterable[str]) -> None:
        self._named = frozenset(named)

    def __call__(self, tenant: str) -> str:
        if tenant in self._named or tenant in self._seen:
            return tenant
        if len(self._seen) < self._limit:
            self._seen.add(tenant)
            return tenant
        return OTHER_TENANTS


class GateMetrics:
    """The gate's instruments. Construct once per process after `start_prometheus`."""

    def __init__(self) -> None:
        m = meter("kvgate.gate")
        self.tenant_label = TenantLabels()
        self._tenant_requests = Tally(
            m,
            TENANT_REQUESTS,
            "{request}",
            "Long requests by tenant and outcome: at_once or waited (admitted), or the refusal's reason",
            ("tenant", "outcome"),
        )
        self._tenant_service = Tally(
            m,
            TENANT_SERVICE,
            "{token}",
            "Service given to each tenant's long requests, counted when each ended: prompt + "
            "fairness.output_weight x output tokens (what the answer says it generated where the gate "
            "read it, else the budget reserved)",
            ("tenant",),
        )
        self._decisions = Tally(
            m,
            DECISIONS,
            "{request}",
            "Decisions by target (pool or status), reason and method",
            ("target", "reason", "method"),
        )
        self._duration = histogram(
            DECISION_DURATION,
            "Time from the body's arrival to the gate's answer",
            "method",
            _SECONDS_BUCKETS,
        )
        self._tokens = histogram(
            ESTIMATED_TOKENS,
            "Estimated total tokens (prompt + output budget)",
            "method",
            _TOKEN_BUCKETS,
        )
        self._first_token = histogram(
            FIRST_TOKEN,
            "Endpoint picker: time from the gate's answer to the engine's first response body bytes "
            "(its first token, for a stream), by the pool of the engine picked; answers with status 200",
            "pool",
            _FIRST_TOKEN_BUCKETS,
        )
        self._messages = Tally(m, ENVOY_MESSAGES, "{message}", "ext_proc messages by kind", ("kind",))
        self._reservations = Tally(
            m,
            RESERVATIONS,
            "{reservation}",
            "Reserve attempts by result (granted, refused, error)",
            ("result",),
        )
        self._route_policy_ignored = Tally(
            m,
            ROUTE_POLICY_IGNORED,
            "{value}",
            "Envoy route policy values ignored because they did not parse, by metadata key",
            ("key",),
        )
        self._internal_errors = Tally(
            m,
            INTERNAL_ERRORS,
            "{error}",
            "Requests answered 503 internal_error because the gate failed on them, by the Envoy message "
            "it failed on",
            ("message",),
        )
        self._served_elsewhere = Tally(
            m,
            SERVED_ELSEWHERE,
            "{request}",
            "Endpoint picker: reserved requests the gateway served on another engine than the one that "
            "held the reservation (a fallback or a retry), by whether the reservation moved to that "
            "engine's agent or was only released (no agent follows it, or it had no room)",
            ("reservation",),
        )
        self._lease_renewals = Tally(
            m,
            LEASE_RENEWALS,
            "{reservation}",
            "Reservations whose lease the gate renewed (renewed), found lapsed at the agent (lapsed: that "
            "request runs on unreserved), or could not renew this period (error: the agent gave no answer)",
            ("result",),
        )
        self._placements = Tally(
            m,
            PLACEMENTS,
            "{request}",
            "Long requests placed with prefix affinity, by how: affinity (on a node holding the prefix), "
            "bounded (the nodes holding it were past the load bound), cold (no node held it)",
            ("placement",),
        )
        self._prefix_hit = Tally(
            m,
            PREFIX_HIT_TOKENS,
            "{token}",
            "Prompt tokens placed requests were expected to find in their node's prefix cache",
            (),
        )
        self._prefix_saved = Tally(
            m,
            PREFIX_SAVED_TOKENS,
            "{token}",
            "Tokens placed requests did not reserve: prefix blocks live requests on their node already held",
            (),
        )
        self._cached_fraction = histogram(
            PLACEMENT_CACHED_FRACTION,
            "Of a placed request's prefix, the fraction its node was expected to hold (the placement score)",
            "placement",
            _FRACTION_BUCKETS,
        )
        self._admission = histogram(
            ADMISSION_DURATION,
            "Time a long request spent in admission (its Reserves and any wait for room), by result: "
            "granted at once, granted after waiting, or refused",
            "result",
            _SECONDS_BUCKETS,
        )
        self._retry_after = histogram(
            RETRY_AFTER,
            "Retry-After of capacity refusals, by what it was made from (forecast, fallback, fixed)",
            "basis",
            _RETRY_BUCKETS,
        )
        self._retry_error = histogram(
            RETRY_AFTER_ERROR,
            "When the capacity a refused client was told about freed, less when it was told to come back "
            "(positive: it came back too early), by what the Retry-After was made from",
            "basis",
            _RETRY_ERROR_BUCKETS,
        )
        self._retry_unresolved = Tally(
            m,
            RETRY_AFTER_UNRESOLVED,
            "{refusal}",
            "Retry-After answers whose capacity had not freed when their watch ran out",
            ("basis",),
        )
        self.meter = m

    def admitted(self, result: str, seconds: float) -> None:
        self._admission.record(seconds, result)

    def tenant_outcome(self, tenant: str, outcome: str) -> None:
        self._tenant_requests.add(self.tenant_label(tenant), outcome)

    def tenant_served(self, tenant: str, cost: float) -> None:
        self._tenant_service.add(self.tenant_label(tenant), n=round(cost))

    def admission_family(self) -> HistogramMetricFamily:
        """The admission-time histogram as the metrics endpoint renders it."""
        return self._admission.family()

    def retry_advised(self, basis: str, seconds: float) -> None:
        self._retry_after.record(seconds, basis)

    def retry_checked(self, basis: str, error_s: float | None) -> None:
        """A Retry-After checked against when its capacity freed (None: it had not, in time)."""
        if error_s is None:
            self._retry_unresolved.add(basis)
        else:
            self._retry_error.record(error_s, basis)

    def decision(self, target: str, reason: str, method: str, tokens: int, seconds: float) -> None:
        self._decisions.add(target, reason, method)
        self._duration.record(seconds, method)
        if tokens:
            self._tokens.record(tokens, method)

    def message(self, kind: str) -> None:
        self._messages.add(kind)

    def reservation(self, result: str) -> None:
        self._reservations.add(result)

    def route_policy_ignored(self, key: str) -> None:
        self._route_policy_ignored.add(key)

    def internal_error(self, message: str) -> None:
        self._internal_errors.add(message)

    def first_token(self, seconds: float, pool: str) -> None:
        self._first_token.record(seconds, pool)

    def reservation_moved(self, moved: bool) -> None:
        self._served_elsewhere.add("moved" if moved else "released")

    def renewed(self, result: str, reservations: int) -> None:
        self._lease_renewals.add(result, n=reservations)

    def placed(self, placement: str, cached_tokens: int, saved_tokens: int, prefix_tokens: int) -> None:
        self._placements.add(placement)
        self._prefix_hit.add(n=cached_tokens)
        self._prefix_saved.add(n=saved_tokens)
        if prefix_tokens:
            self._cached_fraction.record(min(1.0, cached_tokens / prefix_tokens), placement)


@dataclass(frozen=True, slots=True)
class NodeGauges:
    """One agent's figures as the gate sees them; None where it has not heard from the agent yet."""

    agent: str
    headroom_tokens: int | None
    age_s: float | None
    fresh: bool


@dataclass(frozen=True, slots=True)
class PoolGauges:
    pool: str
    water_level: int  # 0 green, 1 yellow, 2 red
    breaker: str  # closed, half_open, open
    nodes: tuple[NodeGauges, ...]


@dataclass(frozen=True, slots=True)
class AdmissionGauges:
    """What admission shows at one instant, read at scrape time."""

    waiting: int
    pools: tuple[PoolGauges, ...]
    # With fair shares, per tenant: (tenant, weighted attained service, requests waiting).
    tenants: tuple[tuple[str, float, int], ...] = ()


_BREAKER_VALUES = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


def observe_admission(meter_: Meter, read: Callable[[], AdmissionGauges]) -> None:
    """The gauges of admission and of the nodes it sees, each read from one `read()` at scrape time."""

    def pools(value: Callable[[PoolGauges], float]) -> Gauge:
        return lambda: [(value(pool), {"pool": pool.pool}) for pool in read().pools]

    def nodes(value: Callable[[NodeGauges], float | None]) -> Gauge:
        def gauge() -> list[tuple[float, dict[str, str]]]:
            found = []
            for pool in read().pools:
                for node in pool.nodes:
                    reading = value(node)
                    if reading is not None:
                        found.append((reading, {"pool": pool.pool, "agent": node.agent}))
            return found

        return gauge

    observe(
        meter_,
        ADMISSION_WAITING,
        "{request}",
        "Long requests waiting for capacity",
        lambda: [(read().waiting, {})],
    )
    observe(
        meter_,
        TENANT_ATTAINED,
        "{token}",
        "Fair shares: each tenant's weighted attained service, the order of the gate's line (least first)",
        lambda: [(attained, {"tenant": tenant}) for tenant, attained, _ in read().tenants],
    )
    observe(
        meter_,
        TENANT_WAITING,
        "{request}",
        "Fair shares: long requests waiting for capacity, by tenant",
        lambda: [(float(waiting), {"tenant": tenant}) for tenant, _, waiting in read().tenants],
    )
    observe(meter_, POOL_WATER_LEVEL, "1", "0 green, 1 yellow, 2 red", pools(lambda p: float(p.water_level)))
    observe(
        meter_,
        POOL_BREAKER_OPEN,
        "1",
        "0 closed, 1 half-open, 2 open",
        pools(lambda p: _BREAKER_VALUES[p.breaker]),
    )
    observe(
        meter_,
        NODE_HEADROOM,
        "{token}",
        "Headroom the node's agent last reported",
        nodes(lambda n: None if n.headroom_tokens is None else float(n.headroom_tokens)),
    )
    observe(
        meter_,
        NODE_AGE,
        "s",
        "Age of the node's latest headroom message",
        nodes(lambda n: n.age_s),
    )
    observe(meter_, NODE_FRESH, "1", "1 when the node's headroom is fresh", nodes(lambda n: float(n.fresh)))


class DecisionSpans:
    """One span per decision, a child of the trace Envoy started when the request carries one."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        provider = provider or trace.get_tracer_provider()
        self.enabled = not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
        self._tracer = provider.get_tracer("kvgate.gate")

    def record(
        self,
        carrier: dict[str, str],
        start_ns: int,
        end_ns: int,
        attributes: dict[str, AttributeValue],
    ) -> None:
        if not self.enabled:
            return
        span = self._tracer.start_span(
            "kvgate.decision", context=propagate.extract(carrier), start_time=start_ns, attributes=attributes
        )
        span.end(end_time=end_ns)
