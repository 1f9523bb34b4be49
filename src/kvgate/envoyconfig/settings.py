"""What the Envoy in front of the gate needs, derived from the gate's config and a few operator facts."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvgate.addresses import split_host_port
from kvgate.config import Config, MiB
from kvgate.envoyconfig.identity import Identity
from kvgate.envoyconfig.limits import Limits
from kvgate.envoyconfig.routepolicy import RouteLayout, RoutePolicy, layout
from kvgate.envoyconfig.unanswered import LongChoice, Unanswered, unanswered
from kvgate.errors import ConfigError
from kvgate.gate.holding import holding, least_message_timeout_s

log = logging.getLogger(__name__)
# Envoy buffers a little more than the gate accepts, so the gate, with its clear error body, is the
# one that refuses an oversized request rather than Envoy's bare 413.
BUFFER_MARGIN_BYTES = 1 * MiB
# An InferencePool's endpointPickerRef.failureMode (kvgate.envoyconfig.inference_pool).
FailureMode = Literal["FailClose", "FailOpen"]
FAILURE_MODES: tuple[FailureMode, ...] = ("FailClose", "FailOpen")
_ANY_HOST = ("", "0.0.0.0", "::", "[::]")
# Two: ext_proc sees the headers, then the body, and routes follow the headers the gate sets. One: the
# body alone, with the headers the gate reads as request attributes, and routes follow the gate's
# dynamic metadata (one gRPC message each way instead of two).
RoundTrips = Literal[1, 2]
# A held request waits in the queue up to queue.max_hold_s, then the queue answers 429 itself; the route's
# idle timeout (Envoy's stream idle timeout is 300 s by default, docs/root/faq/configuration/timeouts.rst)
# must leave that answer time to arrive.
QUEUE_IDLE_MARGIN_S = 30
# Envoy's ext_proc max_message_timeout: the gate holds a long request waiting for room past
# message_timeout by asking for more time (override_message_timeout, kvgate.gate.holding), up to its
# admission.max_hold_s (30 s by default) plus HOLD_MARGIN_S; Envoy ignores a longer ask (and any ask
# when this is unset), and the request then fails open. Envoy caps it at 1 h (ext_proc.proto).
DEFAULT_MAX_MESSAGE_TIMEOUT_MS = 60_000
HOLD_MARGIN_S = 5


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int


def parse_host_port(text: str, what: str) -> HostPort:
    """`host:port` or `[v6]:port`; raises ConfigError naming `what`."""
    return HostPort(*split_host_port(text, what))


@dataclass(frozen=True, slots=True)
class GateTls:
    """TLS from Envoy to the gate's ext_proc port. The paths are where Envoy will find the files: the
    bootstrap is often rendered on one machine for another, so nothing here reads them."""

    ca: str
    # The DNS name the gate's certificate must carry, also sent as SNI.
    server_name: str
    # Envoy's client certificate, for a gate with tls.server.client_ca (mTLS).
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class EnvoySettings:
    listen: HostPort
    ready_port: int
    admin_port: int
    gate: HostPort
    # Upstream pools by the value of x-kvgate-pool, in a stable (sorted) order.
    pools: tuple[tuple[str, HostPort], ...]
    default_pool: str
    # Pools whose requests the gate may pin to one node with x-kvgate-endpoint.
    long_pools: tuple[str, ...]
    buffer_limit_bytes: int
    # The gate's server.metadata_namespace: where its decision lands in Envoy's dynamic metadata.
    metadata_namespace: str
    # The gate's admission.priority_header, one of the headers one round trip sends as an attribute.
    priority_header: str
    round_trips: RoundTrips = 2
    message_timeout_ms: int = 5000
    # The longest the gate may ask Envoy to wait for one answer, holding a request (kvgate.gate.holding).
    max_message_timeout_ms: int = DEFAULT_MAX_MESSAGE_TIMEOUT_MS
    fail_open: bool = True
    # Failing open, where a request the gate did not answer goes by its size (kvgate.envoyconfig.unanswered);
    # None: every such request to the default pool.
    unanswered: Unanswered | None = None
    # 0 disables the upstream timeout: long generations stream for minutes.
    route_timeout_seconds: int = 0
    # None: plaintext to the gate.
    gate_tls: GateTls | None = None
    # The pool whose upstream is `kvgate queue`: its own API is routed there with ext_proc off, and its
    # route waits queue_idle_timeout_s for a held request's answer.
    queue_pool: str | None = None
    queue_idle_timeout_s: int = 330
    # Per-host and per-route policy (kvgate.envoyconfig.routepolicy).
    route_layout: RouteLayout = field(default_factory=RouteLayout)
    # How Envoy authenticates clients (kvgate.envoyconfig.identity); None: every client is anonymous.
    identity: Identity | None = None
    limits: Limits = field(default_factory=Limits)


def _referenced_pools(config: Config) -> tuple[set[str], set[str]]:
    models = (config.default_model, *config.models)
    return {m.pools.interactive for m in models}, {m.pools.long for m in models}


def envoy_settings(
    config: Config,
    pools: Mapping[str, HostPort],
    *,
    listen: HostPort,
    ready_port: int = 19001,
    admin_port: int = 9901,
    gate: HostPort | None = None,
    default_pool: str | None = None,
    message_timeout_ms: int = 5000,
    max_message_timeout_ms: int | None = None,
    fail_open: bool = True,
    fail_open_long: LongChoice = "refuse",
    route_timeout_seconds: int = 0,
    round_trips: RoundTrips = 2,
    gate_tls: GateTls | None = None,
    queue: HostPort | None = None,
    route_policies: Sequence[RoutePolicy] = (),
    route_policies_source: str = "route policies",
    identity: Identity | None = None,
    limits: Limits | None = None,
) -> EnvoySettings:
    """Check the pools against every pool name the gate can set, and size Envoy's buffers to the gate.

    `queue`: the address of `kvgate queue`, which serves the default model's async pool.
    `fail_open_long`: failing open, whether a request the gate did not answer whose body may be too long
    for the default pool is refused or sent to the long pool unreserved."""
    queue_pool = None
    if queue is not None:
        queue_pool = config.default_model.pools.async_
        if queue_pool in pools:
            raise ConfigError(
                f"--pool {queue_pool} and --queue both give the async pool {queue_pool!r}: "
                "--queue is its address"
            )
        pools = {**pools, queue_pool: queue}
    interactive, long = _referenced_pools(config)
    missing = sorted((interactive | long) - pools.keys())
    if missing:
        raise ConfigError(
            f"{config.source}: the gate routes to pool(s) {', '.join(missing)} but no address was given "
            f"(add --pool {missing[0]}=HOST:PORT)"
        )
    default = default_pool or config.default_model.pools.interactive
    if default not in pools:
        raise ConfigError(
            f"default pool {default!r} has no address (known pools: {', '.join(sorted(pools))})"
        )
    buffer_limit = config.request.max_body_bytes + BUFFER_MARGIN_BYTES
    if config.server.max_message_bytes <= buffer_limit:
        raise ConfigError(
            f"{config.source}: server.max_message_bytes ({config.server.max_message_bytes}) must exceed "
            f"request.max_body_bytes + 1 MiB ({buffer_limit}): a buffered body reaches the gate in one "
            "gRPC message"
        )
    _check_gate_tls(config, gate_tls)
    _check_message_timeout(config, message_timeout_ms)
    max_message_timeout_ms = _max_message_timeout_ms(config, max_message_timeout_ms)
    return EnvoySettings(
        listen=listen,
        ready_port=ready_port,
        admin_port=admin_port,
        gate=gate or gate_address(config),
        pools=tuple(sorted(pools.items())),
        default_pool=default,
        long_pools=tuple(sorted(long)),
        buffer_limit_bytes=buffer_limit,
        metadata_namespace=config.server.metadata_namespace,
        # Envoy matches header names in lower case; written so, the chart and this render the same.
        priority_header=config.admission.priority_header.lower(),
        round_trips=round_trips,
        message_timeout_ms=message_timeout_ms,
        max_message_timeout_ms=max_message_timeout_ms,
        fail_open=fail_open,
        # Failing closed, Envoy answers 500 itself to a request the gate did not answer.
        unanswered=unanswered(config, default, fail_open_long) if fail_open else None,
        route_timeout_seconds=route_timeout_seconds,
        gate_tls=gate_tls,
        queue_pool=queue_pool,
        queue_idle_timeout_s=math.ceil(config.queue.max_hold_s) + QUEUE_IDLE_MARGIN_S,
        route_layout=layout(route_policies, config.policies, route_policies_source, config.fairness.classes),
        identity=identity,
        limits=limits or Limits(),
    )


def gate_address(config: Config) -> HostPort:
    """Where Envoy reaches the gate when not told: its server.listen, on this host when it listens on
    every address."""
    listen_on = parse_host_port(config.server.listen, "server.listen")
    return HostPort("127.0.0.1", listen_on.port) if listen_on.host in _ANY_HOST else listen_on


def _ceil_ms(seconds: float) -> int:
    """Whole milliseconds, rounded up, of a figure given in seconds. Rounded first to a microsecond, so
    that 1.1 s + 0.5 s is 1,600 ms and not 1,601 (binary floats), as the chart's decimal arithmetic
    (sprig's addf and mulf) makes it: both refuse the same values."""
    return math.ceil(round(seconds * 1000, 3))


def _check_message_timeout(config: Config, message_timeout_ms: int) -> None:
    """Past message_timeout Envoy stops waiting for the gate and fails open, so a long request that
    waits for room would be sent on undecided (or refused 503 `gate_unavailable`). The gate answers
    within admission.max_wait_s or, when it holds requests, asks for more time at half of it
    (kvgate.gate.holding); either must reach Envoy before it gives up."""
    if holding(config.admission) is None:
        when = "answers a long request within admission.max_wait_s"
    else:
        when = "asks Envoy for more time at half of admission.max_wait_s"
    needed_ms = _ceil_ms(least_message_timeout_s(config.admission))
    if message_timeout_ms < needed_ms:
        raise ConfigError(
            f"{config.source}: the gate {when} ({config.admission.max_wait_s:g} s), so Envoy's ext_proc "
            f"message_timeout must be at least {needed_ms} ms (got {message_timeout_ms}): raise "
            "--message-timeout-ms, or lower admission.max_wait_s"
        )


def _max_message_timeout_ms(config: Config, asked_ms: int | None) -> int:
    """Envoy's max_message_timeout: what was asked (default 60 s), checked against the gate's holds."""
    admission = config.admission
    holds = admission.max_hold_s > admission.max_wait_s
    needed_ms = _ceil_ms(admission.max_hold_s + HOLD_MARGIN_S) if holds else 0
    if asked_ms is None:
        return max(DEFAULT_MAX_MESSAGE_TIMEOUT_MS, needed_ms)
    if asked_ms < needed_ms:
        raise ConfigError(
            f"{config.source}: the gate holds requests up to admission.max_hold_s "
            f"({admission.max_hold_s:g} s), so Envoy's max_message_timeout must be at least {needed_ms} ms "
            f"(got {asked_ms}): "
            "raise --max-message-timeout-ms, or lower admission.max_hold_s"
        )
    return asked_ms


def _check_gate_tls(config: Config, gate_tls: GateTls | None) -> None:
    """A TLS mismatch between Envoy and the gate fails every handshake, and ext_proc then fails open
    on every request (or, failing closed, answers 500)."""
    server = config.tls.server
    if gate_tls is None:
        if server.enabled:
            raise ConfigError(
                f"{config.source}: the gate serves only TLS (tls.server) but no --gate-tls-ca was given: "
                "Envoy's plaintext connections to it would fail"
            )
        return
    if not server.enabled:
        # Only a warning: the file rendered from is not always the gate's whole config (the Helm chart
        # writes the gate's tls section itself and refuses gate.config.tls).
        log.warning(
            "--gate-tls-ca: %s has no tls.server; if the gate runs with this config it serves plaintext "
            "and Envoy's TLS handshakes with it will fail",
            config.source,
        )
    elif server.client_ca is not None and gate_tls.cert is None:
        raise ConfigError(
            f"{config.source}: tls.server.client_ca is set, so the gate will refuse Envoy's handshake "
            "without a client certificate: add --gate-tls-cert and --gate-tls-key"
        )
