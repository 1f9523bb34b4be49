"""`kvgate envoy-config --inference-pool`: plain Envoy as an InferencePool's gateway, with the gate as
the pool's endpoint picker (`server.protocol: endpoint-picker`, kvgate.gate.picker).

What envoy/envoy-inferencepool.yaml ships, rendered for an operator's addresses, and built the way the
gateways build it for a pool (Istio: pilot/pkg/networking/core/cluster_builder.go and
pilot/pkg/xds/filters/filters.go @86c9f01f; Envoy Gateway: internal/xds/translator/cluster.go and
extproc.go @d32f2829):
- ext_proc to the gate with every header and trailer mode SEND and both bodies FULL_DUPLEX_STREAMED,
  `envoy.lb` and the subset hint's namespace forwarded, `envoy.lb` and the gate's namespace received;
  `failure_mode_allow` from the pool's failureMode (FailClose, the API's default, unless asked). Under
  FULL_DUPLEX_STREAMED Envoy fails a request closed once its body went to the picker whatever this
  says (envoy source/extensions/filters/http/ext_proc/ext_proc.cc @v1.40.0, Filter::failureModeAllow):
  FailOpen lets only bodiless requests through.
- one cluster over the pool's engines with Envoy's override_host load balancer, which reads the
  picker's `envoy.lb` metadata, then its header, and writes the engine that served back into
  `envoy.lb`; round robin once the named engines are used up;
- every request to that cluster, retried on failures before an engine saw it. The cluster reads the
  picker's list twice (metadata, then header), so 3 retries leave a request named one engine two
  round-robin picks when that engine is down.
The ingress bounds, the identity (client copies of the routing and identity headers removed before
anything reads them, the tenant set from the operator's authentication) and the engine-failure replies
are the dialect bootstrap's (kvgate.envoyconfig.bootstrap). A route's subset hint is the gateway's to
add per route (the shipped file's `kvgate.subset_hint` filter); this render has none.
"""

from __future__ import annotations

import datetime
import ipaddress
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import betterproto2
    from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        LoadBalancingPolicy,
        LoadBalancingPolicyPolicy,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        GrpcService,
        GrpcServiceEnvoyGrpc,
        TypedExtensionConfig,
    )
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.config.listener.v3 import Listener
    from envoy_data_plane.envoy.config.route.v3 import (
        RetryPolicy,
        Route,
        RouteAction,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExternalProcessor,
        MetadataOptions,
        MetadataOptionsMetadataNamespaces,
        ProcessingMode,
        ProcessingModeBodySendMode,
        ProcessingModeHeaderSendMode,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        HttpFilter,
    )
    from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host.v3 import (
        OverrideHost,
        OverrideHostOverrideHostSource,
    )
    from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin.v3 import RoundRobin
    from envoy_data_plane.envoy.type.metadata.v3 import MetadataKey, MetadataKeyPathSegment
    from envoy_data_plane.google.protobuf import Any as AnyMessage

from kvgate.config import Config
from kvgate.envoyconfig.bootstrap import (
    EXT_PROC_FILTER,
    GATE_CLUSTER,
    GATE_HEADERS,
    address,
    auth_clusters,
    client_listener,
    decision_for_the_client,
    gate_cluster,
    ready_listener,
    router,
    upstream_failure_replies,
)
from kvgate.envoyconfig.identity import Identity, auth_filters, strip_client_headers
from kvgate.envoyconfig.limits import Limits, overload_manager
from kvgate.envoyconfig.settings import BUFFER_MARGIN_BYTES, FailureMode, GateTls, HostPort, gate_address
from kvgate.errors import ConfigError
from kvgate.names import (
    DESTINATION_HEADER,
    LB_NAMESPACE,
    REASON_HEADER,
    SERVED_KEY,
    SUBSET_NAMESPACE,
    TOKENS_HEADER,
)

POOL_CLUSTER = "inference_pool"
# Each named engine is tried twice (metadata, then header) before round robin: see the module doc.
RETRIES = 3
_RETRY_ON = "connect-failure,refused-stream,reset-before-request"
# FULL_DUPLEX_STREAMED has no per-message timeout; this bounds the rest, as Istio sets it.
_MESSAGE_TIMEOUT = datetime.timedelta(seconds=1000)


@dataclass(frozen=True, slots=True)
class PoolGatewaySettings:
    listen: HostPort
    gate: HostPort
    # The pool's engines, as the InferencePool's selector and targetPorts would list them.
    endpoints: tuple[HostPort, ...]
    metadata_namespace: str
    priority_header: str
    buffer_limit_bytes: int
    failure_mode: FailureMode = "FailClose"
    ready_port: int = 19001
    admin_port: int = 9901
    route_timeout_seconds: int = 0
    gate_tls: GateTls | None = None
    identity: Identity | None = None
    limits: Limits = field(default_factory=Limits)


def pool_gateway_settings(
    config: Config,
    endpoints: Sequence[HostPort],
    *,
    listen: HostPort,
    gate: HostPort | None = None,
    failure_mode: FailureMode = "FailClose",
    ready_port: int = 19001,
    admin_port: int = 9901,
    route_timeout_seconds: int = 0,
    gate_tls: GateTls | None = None,
    identity: Identity | None = None,
    limits: Limits | None = None,
) -> PoolGatewaySettings:
    """Check that the gate picks endpoints and that the pool has engines."""
    if config.server.protocol != "endpoint-picker":
        raise ConfigError(
            f"{config.source}: server.protocol is {config.server.protocol!r}; --inference-pool puts the gate "
            "behind Envoy as the pool's endpoint picker, which needs server.protocol: endpoint-picker"
        )
    if not endpoints:
        raise ConfigError("--inference-pool needs the pool's engines: one --endpoint HOST:PORT or more")
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError("--endpoint: an engine is given twice")
    for engine in endpoints:
        try:
            ipaddress.ip_address(engine.host)
        except ValueError:
            # The picker names engines by ip:port (its agents' endpoints), and override_host finds them
            # among the cluster's hosts by that address.
            raise ConfigError(
                f"--endpoint {engine.host}:{engine.port}: give the engine's IP address, as the picker "
                "names it"
            ) from None
    return PoolGatewaySettings(
        listen=listen,
        gate=gate or gate_address(config),
        endpoints=tuple(endpoints),
        metadata_namespace=config.server.metadata_namespace,
        priority_header=config.admission.priority_header.lower(),
        buffer_limit_bytes=config.request.max_body_bytes + BUFFER_MARGIN_BYTES,
        failure_mode=failure_mode,
        ready_port=ready_port,
        admin_port=admin_port,
        route_timeout_seconds=route_timeout_seconds,
        gate_tls=gate_tls,
        identity=identity,
        limits=limits or Limits(),
    )


def _picker_filter(settings: PoolGatewaySettings) -> HttpFilter:
    send = ProcessingModeHeaderSendMode.SEND
    streamed = ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED
    processor = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=GATE_CLUSTER)),
        failure_mode_allow=settings.failure_mode == "FailOpen",
        message_timeout=_MESSAGE_TIMEOUT,
        processing_mode=ProcessingMode(
            request_header_mode=send,
            response_header_mode=send,
            request_body_mode=streamed,
            response_body_mode=streamed,
            request_trailer_mode=send,
            response_trailer_mode=send,
        ),
        metadata_options=MetadataOptions(
            forwarding_namespaces=MetadataOptionsMetadataNamespaces(untyped=[LB_NAMESPACE, SUBSET_NAMESPACE]),
            receiving_namespaces=MetadataOptionsMetadataNamespaces(
                untyped=[LB_NAMESPACE, settings.metadata_namespace]
            ),
        ),
    )
    return HttpFilter(name=EXT_PROC_FILTER, typed_config=AnyMessage.pack(processor))


def _ingress(settings: PoolGatewaySettings) -> Listener:
    action = RouteAction(
        cluster=POOL_CLUSTER,
        timeout=datetime.timedelta(seconds=settings.route_timeout_seconds),
        retry_policy=RetryPolicy(retry_on=_RETRY_ON, num_retries=RETRIES),
    )
    manager = HttpConnectionManager(
        stat_prefix="inference",
        early_header_mutation_extensions=[
            strip_client_headers((DESTINATION_HEADER, *GATE_HEADERS), settings.priority_header)
        ],
        route_config=RouteConfiguration(
            name="inference_pool",
            virtual_hosts=[
                VirtualHost(
                    name="llm", domains=["*"], routes=[Route(match=RouteMatch(prefix="/"), route=action)]
                )
            ],
            response_headers_to_add=decision_for_the_client(
                settings.metadata_namespace, (REASON_HEADER, TOKENS_HEADER)
            ),
        ),
        local_reply_config=upstream_failure_replies(),
        http_filters=[
            *auth_filters(settings.identity, settings.priority_header),
            _picker_filter(settings),
            router(),
        ],
    )
    return client_listener(
        "inference_gateway",
        manager,
        listen=settings.listen,
        identity=settings.identity,
        limits=settings.limits,
        buffer_limit=settings.buffer_limit_bytes,
    )


def _lb_key(key: str) -> MetadataKey:
    return MetadataKey(key=LB_NAMESPACE, path=[MetadataKeyPathSegment(key=key)])


def _policy(name: str, config: betterproto2.Message) -> LoadBalancingPolicy:
    extension = TypedExtensionConfig(name=name, typed_config=AnyMessage.pack(config))
    return LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(typed_extension_config=extension)])


def _pool_cluster(settings: PoolGatewaySettings) -> Cluster:
    override = OverrideHost(
        override_host_sources=[
            OverrideHostOverrideHostSource(metadata=_lb_key(DESTINATION_HEADER)),
            OverrideHostOverrideHostSource(header=DESTINATION_HEADER),
        ],
        selected_host_key=_lb_key(SERVED_KEY),
        fallback_policy=_policy("envoy.load_balancing_policies.round_robin", RoundRobin()),
    )
    engines = [
        LbEndpoint(endpoint=Endpoint(address=address(engine.host, engine.port)))
        for engine in settings.endpoints
    ]
    return Cluster(
        name=POOL_CLUSTER,
        # An engine named by the picker must be a host of the cluster: the addresses as given, no DNS.
        type=ClusterDiscoveryType.STATIC,
        connect_timeout=datetime.timedelta(seconds=1),
        per_connection_buffer_limit_bytes=settings.buffer_limit_bytes,
        load_balancing_policy=_policy("envoy.load_balancing_policies.override_host", override),
        load_assignment=ClusterLoadAssignment(
            cluster_name=POOL_CLUSTER, endpoints=[LocalityLbEndpoints(lb_endpoints=engines)]
        ),
    )


def render_pool_gateway(settings: PoolGatewaySettings) -> dict[str, Any]:
    """The bootstrap as a plain mapping in Envoy's own (snake_case proto JSON) form, ready for YAML."""
    bootstrap = Bootstrap(
        admin=Admin(address=address("127.0.0.1", settings.admin_port)),
        overload_manager=overload_manager(settings.limits),
        static_resources=BootstrapStaticResources(
            listeners=[_ingress(settings), ready_listener(settings.listen.host, settings.ready_port)],
            clusters=[
                gate_cluster(settings.gate, settings.gate_tls, settings.buffer_limit_bytes),
                _pool_cluster(settings),
                *auth_clusters(settings.identity),
            ],
        ),
    )
    rendered: dict[str, Any] = bootstrap.to_dict(casing=betterproto2.Casing.SNAKE)
    return rendered
