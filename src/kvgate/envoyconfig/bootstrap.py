"""The standalone Envoy bootstrap in front of the gate, built from envoy-data-plane's typed classes.

On the ingress listener an early header mutation strips client copies of the gate's headers before
the first route selection (so when ext_proc fails open, nothing the client sent picks the pool; the
client's priority header is left for the gate), ext_proc hands headers and the buffered body to the
gate, and the router routes on the x-kvgate-pool header the gate set (the gate clears the route
cache). A long request the gate pinned to a node (x-kvgate-endpoint) goes to that address through an
ORIGINAL_DST cluster.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

# envoy-data-plane 2.2's generated classes use a validator form pydantic 2.12 deprecates; the warning
# fires once, at import, and says nothing about kvgate's use of them.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import betterproto2
    from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterLbPolicy,
        ClusterOriginalDstLbConfig,
    )
    from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation
    from envoy_data_plane.envoy.config.core.v3 import (
        Address,
        GrpcService,
        GrpcServiceEnvoyGrpc,
        Http2ProtocolOptions,
        SocketAddress,
        TypedExtensionConfig,
    )
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
    from envoy_data_plane.envoy.config.route.v3 import (
        HeaderMatcher,
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
    from envoy_data_plane.envoy.extensions.filters.http.health_check.v3 import HealthCheck
    from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        HttpFilter,
    )
    from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
        HeaderMutation as EarlyHeaderMutation,
    )
    from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsExplicitHttpConfig,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
    from envoy_data_plane.google.protobuf import Any as AnyMessage

from kvgate.envoyconfig.settings import EnvoySettings, HostPort

GATE_CLUSTER = "kvgate_gate"
PINNED_CLUSTER = "kvgate_pinned"
POOL_HEADER = "x-kvgate-pool"
ENDPOINT_HEADER = "x-kvgate-endpoint"
# The headers the gate sets, and only those: the client's priority header must reach the gate.
GATE_HEADERS = (POOL_HEADER, ENDPOINT_HEADER, "x-kvgate-tokens", "x-kvgate-reason")
# The namespace the gate writes dynamic metadata into (the pool, for one-round-trip routing).
METADATA_NAMESPACE = "kvgate"
HCM_NAME = "envoy.filters.network.http_connection_manager"


def pool_cluster(name: str) -> str:
    return f"pool_{name}"


def _address(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _router() -> HttpFilter:
    return HttpFilter(name="envoy.filters.http.router", typed_config=AnyMessage.pack(Router()))


def _hcm_filter(manager: HttpConnectionManager) -> FilterChain:
    return FilterChain(filters=[Filter(name=HCM_NAME, typed_config=AnyMessage.pack(manager))])


def _pool_match(pool: str, pinned: bool) -> RouteMatch:
    headers = [HeaderMatcher(name=POOL_HEADER, string_match=StringMatcher(exact=pool))]
    if pinned:
        headers.append(HeaderMatcher(name=ENDPOINT_HEADER, present_match=True))
    return RouteMatch(prefix="/", headers=headers)


def routes(settings: EnvoySettings) -> list[Route]:
    """Pool routes by header; the default pool's catch-all comes last because it matches everything."""
    timeout = datetime.timedelta(seconds=settings.route_timeout_seconds)
    result: list[Route] = []
    for name, _ in settings.pools:
        if name == settings.default_pool:
            continue
        if name in settings.long_pools:
            result.append(
                Route(
                    match=_pool_match(name, True), route=RouteAction(cluster=PINNED_CLUSTER, timeout=timeout)
                )
            )
        result.append(
            Route(
                match=_pool_match(name, False), route=RouteAction(cluster=pool_cluster(name), timeout=timeout)
            )
        )
    catch_all = RouteAction(cluster=pool_cluster(settings.default_pool), timeout=timeout)
    result.append(Route(match=RouteMatch(prefix="/"), route=catch_all))
    return result


def ext_proc_filter(settings: EnvoySettings) -> HttpFilter:
    processor = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=GATE_CLUSTER)),
        failure_mode_allow=settings.fail_open,
        allow_mode_override=True,
        # Envoy's 200 ms default is too short to ship a multi-megabyte body to the gate.
        message_timeout=datetime.timedelta(milliseconds=settings.message_timeout_ms),
        processing_mode=ProcessingMode(
            request_header_mode=ProcessingModeHeaderSendMode.SEND,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            response_header_mode=ProcessingModeHeaderSendMode.SKIP,
        ),
        metadata_options=MetadataOptions(
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[METADATA_NAMESPACE])
        ),
    )
    return HttpFilter(name="envoy.filters.http.ext_proc", typed_config=AnyMessage.pack(processor))


def _strip_client_headers() -> TypedExtensionConfig:
    mutation = EarlyHeaderMutation(mutations=[HeaderMutation(remove=name) for name in GATE_HEADERS])
    return TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation", typed_config=AnyMessage.pack(mutation)
    )


def ingress_listener(settings: EnvoySettings) -> Listener:
    manager = HttpConnectionManager(
        stat_prefix="ingress",
        early_header_mutation_extensions=[_strip_client_headers()],
        route_config=RouteConfiguration(
            name="pools", virtual_hosts=[VirtualHost(name="pools", domains=["*"], routes=routes(settings))]
        ),
        http_filters=[ext_proc_filter(settings), _router()],
    )
    return Listener(
        name="ingress",
        address=_address(settings.listen.host, settings.listen.port),
        # BUFFERED ext_proc holds the whole body here; Envoy answers 413 itself past this size.
        per_connection_buffer_limit_bytes=settings.buffer_limit_bytes,
        filter_chains=[_hcm_filter(manager)],
    )


def ready_listener(settings: EnvoySettings) -> Listener:
    """GET /ready answers 200 until Envoy starts draining, for a readiness probe; admin stays local."""
    check = HealthCheck(
        pass_through_mode=False,
        headers=[HeaderMatcher(name=":path", string_match=StringMatcher(exact="/ready"))],
    )
    manager = HttpConnectionManager(
        stat_prefix="ready",
        route_config=RouteConfiguration(name="ready"),
        http_filters=[
            HttpFilter(name="envoy.filters.http.health_check", typed_config=AnyMessage.pack(check)),
            _router(),
        ],
    )
    return Listener(
        name="ready",
        address=_address(settings.listen.host, settings.ready_port),
        filter_chains=[_hcm_filter(manager)],
    )


def _dns_cluster(
    name: str, target: HostPort, connect_timeout: datetime.timedelta, buffer_limit: int
) -> Cluster:
    endpoint = LbEndpoint(endpoint=Endpoint(address=_address(target.host, target.port)))
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STRICT_DNS,
        connect_timeout=connect_timeout,
        per_connection_buffer_limit_bytes=buffer_limit,
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=[endpoint])]
        ),
    )


def clusters(settings: EnvoySettings) -> list[Cluster]:
    gate = _dns_cluster(
        GATE_CLUSTER, settings.gate, datetime.timedelta(seconds=1), settings.buffer_limit_bytes
    )
    http2 = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions()
        )
    )
    gate.typed_extension_protocol_options = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": AnyMessage.pack(http2)
    }
    pinned = Cluster(
        name=PINNED_CLUSTER,
        type=ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
        connect_timeout=datetime.timedelta(seconds=2),
        per_connection_buffer_limit_bytes=settings.buffer_limit_bytes,
        original_dst_lb_config=ClusterOriginalDstLbConfig(
            use_http_header=True, http_header_name=ENDPOINT_HEADER
        ),
    )
    pools = [
        _dns_cluster(pool_cluster(name), target, datetime.timedelta(seconds=2), settings.buffer_limit_bytes)
        for name, target in settings.pools
    ]
    return [gate, pinned, *pools]


def render_bootstrap(settings: EnvoySettings) -> dict[str, Any]:
    """The bootstrap as a plain mapping in Envoy's own (snake_case proto JSON) form, ready for YAML."""
    bootstrap = Bootstrap(
        admin=Admin(address=_address("127.0.0.1", settings.admin_port)),
        static_resources=BootstrapStaticResources(
            listeners=[ingress_listener(settings), ready_listener(settings)],
            clusters=clusters(settings),
        ),
    )
    rendered: dict[str, Any] = bootstrap.to_dict(casing=betterproto2.Casing.SNAKE)
    return rendered
