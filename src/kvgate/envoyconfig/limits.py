"""Envoy's own bounds in front of the gate: no client can hold Envoy's memory, connections or the
gate's ext_proc streams long enough to make Envoy skip the gate for everyone.

- Circuit breakers on the gate cluster. A request holds one ext_proc stream to the gate while it is
  decided, and one that holds a reservation until it ends; Envoy's default limit is 1,024 streams per
  cluster (cluster.proto, CircuitBreakers.Thresholds: max_connections, max_pending_requests and
  max_requests default to 1024, max_retries to 3). Past it the stream fails and ext_proc's
  failure_mode_allow sends the request on with no decision. GATE_MAX_REQUESTS sits above what Envoy's
  heap can hold, so the heap monitor answers 503 before the breaker can overflow: on Envoy 1.40 an open
  request costs about 45 KiB of heap (headers sent, body awaited, two round trips) to 66 KiB (held
  upstream, one round trip), measured over 1,030 of each (tests/test_envoy_trust.py), so the default 1
  GiB holds 16,000 to 23,000.
- The HCM's `request_headers_timeout` and `request_timeout` (http_connection_manager.proto: "the amount
  of time that Envoy will wait for the entire request to be received", disarmed once the request is
  sent upstream or the response starts): a client that sends headers and no body, or a body slowly,
  holds its buffer and its gate stream that long at most. Held and streamed answers are not cut: the
  request has been received by then.
- HTTP/2 `max_concurrent_streams` 100 per client connection, and the overload manager: at most
  `max_connections` downstream connections (global_downstream_max_connections, refused past it), and a
  heap monitor that shrinks the heap at 95 % and answers new requests 503 at 98 % (the values of
  Envoy's docs/root/configuration/best_practices/edge.rst).
- `strip_trailing_host_dot` and `strip_any_host_port`: `strict.local.` and `strict.local:80` select the
  same virtual host as `strict.local`, so a per-host policy is not bypassed by spelling the host.
- `headers_with_underscores_action: DROP_HEADER`: `x_kvgate_tenant` cannot reach an upstream that reads
  `_` as `-` (CGI-style servers), past the early header mutation that removes `x-kvgate-tenant`.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from envoy_data_plane.envoy.config.cluster.v3 import CircuitBreakers, CircuitBreakersThresholds
    from envoy_data_plane.envoy.config.core.v3 import (
        Http2ProtocolOptions,
        HttpProtocolOptions,
        HttpProtocolOptionsHeadersWithUnderscoresAction,
    )
    from envoy_data_plane.envoy.config.overload.v3 import (
        OverloadAction,
        OverloadManager,
        ResourceMonitor,
        ThresholdTrigger,
        Trigger,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
    )
    from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import (
        DownstreamConnectionsConfig,
    )
    from envoy_data_plane.envoy.extensions.resource_monitors.fixed_heap.v3 import FixedHeapConfig
    from envoy_data_plane.google.protobuf import Any as AnyMessage

from kvgate.config import MiB

# Four times what the default heap can hold (1 GiB at 45 KiB per open request: 23,000), and far above
# the requests one Envoy carries at once (each a generation on a GPU, or a request held in the queue).
GATE_MAX_REQUESTS = 100_000
# ext_proc streams are not retried (no retry_policy on the gate's grpc_service): Envoy's default.
GATE_MAX_RETRIES = 3
# Envoy's edge recommendation (best_practices/edge.rst): bounds the streams one connection can open.
MAX_CONCURRENT_STREAMS = 100
HEAP_MONITOR = "envoy.resource_monitors.fixed_heap"
CONNECTIONS_MONITOR = "envoy.resource_monitors.global_downstream_max_connections"
SHRINK_HEAP_AT = 0.95
STOP_ACCEPTING_REQUESTS_AT = 0.98


@dataclass(frozen=True, slots=True)
class Limits:
    request_headers_timeout_s: int = 10
    # Long enough for a 200 MiB batch upload to the queue at 28 Mbit/s; a slow body holds its buffer
    # (up to the listener's 32 MiB) no longer than this.
    request_timeout_s: int = 60
    max_connections: int = 50_000
    max_heap_bytes: int = 1024 * MiB


def bound_manager(manager: HttpConnectionManager, limits: Limits) -> None:
    """The ingress HCM's timeouts, host normalization and per-connection limits."""
    manager.request_headers_timeout = datetime.timedelta(seconds=limits.request_headers_timeout_s)
    manager.request_timeout = datetime.timedelta(seconds=limits.request_timeout_s)
    manager.strip_trailing_host_dot = True
    manager.strip_any_host_port = True
    manager.http2_protocol_options = Http2ProtocolOptions(max_concurrent_streams=MAX_CONCURRENT_STREAMS)
    manager.common_http_protocol_options = HttpProtocolOptions(
        headers_with_underscores_action=HttpProtocolOptionsHeadersWithUnderscoresAction.DROP_HEADER
    )


def gate_circuit_breakers() -> CircuitBreakers:
    return CircuitBreakers(
        thresholds=[
            CircuitBreakersThresholds(
                max_connections=GATE_MAX_REQUESTS,
                max_pending_requests=GATE_MAX_REQUESTS,
                max_requests=GATE_MAX_REQUESTS,
                max_retries=GATE_MAX_RETRIES,
            )
        ]
    )


def _when(monitor: str, value: float) -> list[Trigger]:
    return [Trigger(name=monitor, threshold=ThresholdTrigger(value=value))]


def overload_manager(limits: Limits) -> OverloadManager:
    heap = FixedHeapConfig(max_heap_size_bytes=limits.max_heap_bytes)
    connections = DownstreamConnectionsConfig(max_active_downstream_connections=limits.max_connections)
    return OverloadManager(
        refresh_interval=datetime.timedelta(milliseconds=250),
        resource_monitors=[
            ResourceMonitor(name=HEAP_MONITOR, typed_config=AnyMessage.pack(heap)),
            # Checked as each connection is accepted (a proactive monitor): needs no action.
            ResourceMonitor(name=CONNECTIONS_MONITOR, typed_config=AnyMessage.pack(connections)),
        ],
        actions=[
            OverloadAction(
                name="envoy.overload_actions.shrink_heap", triggers=_when(HEAP_MONITOR, SHRINK_HEAP_AT)
            ),
            OverloadAction(
                name="envoy.overload_actions.stop_accepting_requests",
                triggers=_when(HEAP_MONITOR, STOP_ACCEPTING_REQUESTS_AT),
            ),
        ],
    )
