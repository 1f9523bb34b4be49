"""The standalone Envoy bootstrap in front of the gate, built from envoy-data-plane's typed classes.

On the ingress listener an early header mutation strips client copies of the gate's headers and of
the identity headers before the first route selection (so when ext_proc fails open, nothing the client
sent picks the pool, and no client names its own tenant or priority). The operator's authentication
(`EnvoySettings.identity`: jwt_authn, ext_authz or client certificates) sets the tenant and priority
again, and a request without an identity gets the anonymous tenant (kvgate.envoyconfig.identity).
Envoy's own bounds (timeouts, host normalization, the gate cluster's circuit breakers, the overload
manager) come from kvgate.envoyconfig.limits. Then, by `EnvoySettings.round_trips`:
- two: ext_proc hands the headers, then the buffered body, to the gate, and the router routes on the
  x-kvgate-pool header the gate set (the gate clears the route cache);
- one: ext_proc skips the headers and hands the buffered body to the gate with the headers it reads
  as request attributes (`kvgate.gate.processor.request_attributes`, so the two cannot disagree). The
  headers have gone on by then, so the gate answers with dynamic metadata: a buffer filter holds the
  request until that answer, the routes match the metadata, and the route table copies it into the
  x-kvgate-* upstream headers. A bodiless request never reaches the gate and takes the default pool.
Either way a long request the gate pinned to a node (x-kvgate-endpoint) goes to that address through
an ORIGINAL_DST cluster. With `EnvoySettings.gate_tls` Envoy talks TLS (or mTLS) to the gate.

With a queue (`EnvoySettings.queue_pool`), `kvgate queue`'s own API goes to it first with ext_proc off,
and the route to it waits longer than the queue holds a request. Route policies
(`EnvoySettings.route_layout`) add a virtual host per set of policy hosts and a copy of the pool routes
under each policy path, carrying the gate's per-route gRPC metadata; a tenant class also goes to the
queue, as the x-kvgate-tenant-class header of the routes to it.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Sequence
from typing import Any

# envoy-data-plane 2.2's generated classes use a validator form pydantic 2.12 deprecates; the warning
# fires once, at import, and says nothing about kvgate's use of them.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import betterproto2
    from envoy_data_plane.envoy.config.accesslog.v3 import AccessLogFilter, ResponseFlagFilter
    from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterLbPolicy,
        ClusterOriginalDstLbConfig,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        Address,
        DataSource,
        GrpcService,
        GrpcServiceEnvoyGrpc,
        HeaderValue,
        HeaderValueOption,
        HeaderValueOptionHeaderAppendAction,
        Http2ProtocolOptions,
        RuntimeFeatureFlag,
        SocketAddress,
        SubstitutionFormatString,
        TransportSocket,
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
        DirectResponseAction,
        FilterConfig,
        HeaderMatcher,
        Route,
        RouteAction,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.compression.gzip.decompressor.v3 import Gzip
    from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer, BufferPerRoute
    from envoy_data_plane.envoy.extensions.filters.http.decompressor.v3 import (
        Decompressor,
        DecompressorCommonDirectionConfig,
        DecompressorRequestDirectionConfig,
        DecompressorResponseDirectionConfig,
    )
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExternalProcessor,
        ExtProcOverrides,
        ExtProcPerRoute,
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
        LocalReplyConfig,
        ResponseMapper,
    )
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
        CertificateValidationContext,
        CommonTlsContext,
        SubjectAltNameMatcher,
        SubjectAltNameMatcherSanType,
        TlsCertificate,
        UpstreamTlsContext,
    )
    from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsExplicitHttpConfig,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import (
        MetadataMatcher,
        MetadataMatcherPathSegment,
        StringMatcher,
        ValueMatcher,
    )
    from envoy_data_plane.envoy.type.v3 import Int64Range
    from envoy_data_plane.google.protobuf import Any as AnyMessage

from kvgate.config import MiB
from kvgate.envoyconfig.identity import (
    AUTHZ_CLUSTER,
    ExtAuthzAuth,
    Identity,
    MtlsAuth,
    auth_filters,
    listener_tls,
    strip_client_headers,
)
from kvgate.envoyconfig.limits import Limits, bound_manager, gate_circuit_breakers, overload_manager
from kvgate.envoyconfig.routepolicy import Metadata, PolicyPath
from kvgate.envoyconfig.settings import EnvoySettings, GateTls, HostPort
from kvgate.envoyconfig.unanswered import gate_unavailable
from kvgate.envoyconfig.upstream_failure import UPSTREAM_FAILURE_FLAGS, upstream_unavailable
from kvgate.gate.processor import request_attributes
from kvgate.names import (
    ENDPOINT_HEADER,
    HEADER_FOR_METADATA,
    META_PRIORITY,
    META_SESSION,
    POOL_HEADER,
    REASON_HEADER,
    SESSION_HEADER,
    TENANT_CLASS_HEADER,
    TOKENS_HEADER,
)

GATE_CLUSTER = "kvgate_gate"
PINNED_CLUSTER = "kvgate_pinned"
# The headers the gate sets, each with the key of the gate's dynamic metadata that carries the same
# value.
GATE_HEADERS = HEADER_FOR_METADATA
HCM_NAME = "envoy.filters.network.http_connection_manager"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
BUFFER_FILTER = "envoy.filters.http.buffer"
DECOMPRESSOR_FILTER = "envoy.filters.http.decompressor"
# `kvgate queue`'s own API: the OpenAI Batch API's files and batches, and deferred jobs (docs/queue.md).
QUEUE_API_PATHS = ("/v1/files", "/v1/batches", "/v1/kvgate/jobs")


def pool_cluster(name: str) -> str:
    return f"pool_{name}"


def address(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def router() -> HttpFilter:
    return HttpFilter(name="envoy.filters.http.router", typed_config=AnyMessage.pack(Router()))


def hcm_filter(manager: HttpConnectionManager) -> FilterChain:
    return FilterChain(filters=[Filter(name=HCM_NAME, typed_config=AnyMessage.pack(manager))])


def _metadata_of(settings: EnvoySettings, header: str, value: ValueMatcher) -> MetadataMatcher:
    """Matches the dynamic metadata that carries the gate's `header`."""
    path = [MetadataMatcherPathSegment(key=GATE_HEADERS[header])]
    return MetadataMatcher(filter=settings.metadata_namespace, path=path, value=value)


def _pool_match(settings: EnvoySettings, pool: str | None, pinned: bool, path: str | None) -> RouteMatch:
    """Requests under `path` (every path when None) the gate sent to `pool` (any pool when None)."""
    match = RouteMatch(prefix="/") if path is None else RouteMatch(path_separated_prefix=path)
    if pool is None:
        return match
    if settings.round_trips == 2:
        headers = [HeaderMatcher(name=POOL_HEADER, string_match=StringMatcher(exact=pool))]
        if pinned:
            headers.append(HeaderMatcher(name=ENDPOINT_HEADER, present_match=True))
        match.headers = headers
        return match
    # The route table adds the gate's headers only once a route is chosen, so the match reads the
    # metadata they come from.
    metadata = [_metadata_of(settings, POOL_HEADER, ValueMatcher(string_match=StringMatcher(exact=pool)))]
    if pinned:
        metadata.append(_metadata_of(settings, ENDPOINT_HEADER, ValueMatcher(present_match=True)))
    match.dynamic_metadata = metadata
    return match


def _ext_proc_metadata(metadata: Metadata) -> dict[str, AnyMessage]:
    """A route's (or virtual host's) policy: the gRPC metadata of its requests' ext_proc streams."""
    if not metadata:
        return {}
    headers = [HeaderValue(key=key, value=value) for key, value in metadata]
    per_route = ExtProcPerRoute(overrides=ExtProcOverrides(grpc_initial_metadata=headers))
    return {EXT_PROC_FILTER: AnyMessage.pack(per_route)}


def _pool_action(settings: EnvoySettings, pool: str) -> RouteAction:
    action = RouteAction(
        cluster=pool_cluster(pool), timeout=datetime.timedelta(seconds=settings.route_timeout_seconds)
    )
    if pool == settings.queue_pool:
        # A held request waits in the queue up to queue.max_hold_s: Envoy's stream idle timeout (300 s by
        # default) must not answer before the queue does.
        action.idle_timeout = datetime.timedelta(seconds=settings.queue_idle_timeout_s)
    return action


def tenant_class_of(metadata: Metadata) -> str | None:
    """The tenant class a route policy's metadata names, if any."""
    return next((value for key, value in metadata if key == TENANT_CLASS_HEADER), None)


def _to_the_queue(settings: EnvoySettings, pool: str, tenant_class: str | None) -> list[HeaderValueOption]:
    """A classed route's requests to `kvgate queue` carry their class, which the queue reads to weigh the
    job as the gate weighs the request (the gate reads it from the ext_proc metadata instead)."""
    if tenant_class is None or pool != settings.queue_pool:
        return []
    return _header_options([(TENANT_CLASS_HEADER, tenant_class)])


def pool_routes(
    settings: EnvoySettings, path: str | None = None, metadata: Metadata = (), tenant_class: str | None = None
) -> list[Route]:
    """Pool routes by the gate's decision, under `path` (every path when None), each carrying the route
    policy `metadata`; the default pool's catch-all comes last because it matches everything. The route
    to the queue carries `tenant_class`, the class of the route's policy with its virtual host's under it."""
    timeout = datetime.timedelta(seconds=settings.route_timeout_seconds)
    policy = _ext_proc_metadata(metadata)
    result: list[Route] = []
    for name, _ in settings.pools:
        if name == settings.default_pool:
            continue
        if name in settings.long_pools:
            result.append(
                Route(
                    match=_pool_match(settings, name, True, path),
                    route=RouteAction(cluster=PINNED_CLUSTER, timeout=timeout),
                    typed_per_filter_config=policy,
                )
            )
        result.append(
            Route(
                match=_pool_match(settings, name, False, path),
                route=_pool_action(settings, name),
                typed_per_filter_config=policy,
                request_headers_to_add=_to_the_queue(settings, name, tenant_class),
            )
        )
    result += unanswered_routes(settings, path, policy)
    catch_all = _pool_action(settings, settings.default_pool)
    result.append(
        Route(
            match=_pool_match(settings, None, False, path),
            route=catch_all,
            typed_per_filter_config=policy,
            request_headers_to_add=_to_the_queue(settings, settings.default_pool, tenant_class),
        )
    )
    return result


_INT64_MAX = 2**63 - 1


def unanswered_routes(
    settings: EnvoySettings, path: str | None, policy: dict[str, AnyMessage]
) -> list[Route]:
    """Requests the gate did not answer that may be too long for the default pool (a body of
    `unsafe_bytes` or more, a POST of unknown size, a compressed one), refused or sent to the long
    pool unreserved; each carries the route `policy`, since before the gate answers Envoy asks it from
    these routes too (kvgate.envoyconfig.unanswered)."""
    unanswered = settings.unanswered
    if unanswered is None:
        return []
    post = HeaderMatcher(name=":method", string_match=StringMatcher(exact="POST"))
    sizes = [
        [
            HeaderMatcher(
                name="content-length",
                range_match=Int64Range(start=unanswered.unsafe_bytes, end=_INT64_MAX),
            )
        ],
        [post, HeaderMatcher(name="content-length", present_match=False)],
        [post, HeaderMatcher(name="content-encoding", present_match=True)],
    ]
    answer = gate_unavailable()
    result = []
    for headers in sizes:
        match = _pool_match(settings, None, False, path)
        if settings.round_trips == 2:
            match.headers = [HeaderMatcher(name=POOL_HEADER, present_match=False), *headers]
        else:
            pool = _metadata_of(settings, POOL_HEADER, ValueMatcher(present_match=True))
            pool.invert = True
            match.dynamic_metadata = [pool]
            match.headers = headers
        route = Route(match=match, typed_per_filter_config=policy)
        if unanswered.long_pool is not None:
            route.route = _pool_action(settings, unanswered.long_pool)
        else:
            route.direct_response = DirectResponseAction(
                status=answer.status, body=DataSource(inline_string=answer.body.decode())
            )
            route.response_headers_to_add = _header_options(answer.headers)
        result.append(route)
    return result


def queue_api_routes(settings: EnvoySettings, tenant_class: str | None = None) -> list[Route]:
    """`kvgate queue`'s own API straight to it: nothing there for the gate to size (the queue admits each
    batch line itself), and a batch file may be larger than any request body the gate buffers. Nor is
    it inflated: no buffer caps these streamed routes, so a 548 KB gzip upload would reach the queue as
    191 MiB; the queue refuses a compressed upload (415) before reading it. A route's FilterConfig
    `disabled` turns any HTTP filter off for it (envoy/config/route/v3/route_components.proto). In a
    virtual host of a tenant class, they carry it: the batches and jobs sent there are the class's."""
    if settings.queue_pool is None:
        return []
    off = {
        EXT_PROC_FILTER: AnyMessage.pack(ExtProcPerRoute(disabled=True)),
        DECOMPRESSOR_FILTER: AnyMessage.pack(FilterConfig(disabled=True)),
    }
    if settings.round_trips == 1:
        off[BUFFER_FILTER] = AnyMessage.pack(BufferPerRoute(disabled=True))
    timeout = datetime.timedelta(seconds=settings.route_timeout_seconds)
    return [
        Route(
            match=RouteMatch(path_separated_prefix=path),
            route=RouteAction(cluster=pool_cluster(settings.queue_pool), timeout=timeout),
            typed_per_filter_config=dict(off),
            request_headers_to_add=_to_the_queue(settings, settings.queue_pool, tenant_class),
        )
        for path in QUEUE_API_PATHS
    ]


def routes(
    settings: EnvoySettings, paths: Sequence[PolicyPath] = (), host_metadata: Metadata = ()
) -> list[Route]:
    """One virtual host's routes: the queue's API, the route policies' paths (longest first), the pools.
    A route's tenant class is its policy's, else its virtual host's (`host_metadata`), set on each route:
    Envoy adds a virtual host's request headers after its route's, so a host's class set on the host
    would overwrite a path's (route.proto, RouteConfiguration.most_specific_header_mutations_wins)."""
    host_class = tenant_class_of(host_metadata)
    result = queue_api_routes(settings, host_class)
    for path in paths:
        result += pool_routes(
            settings, path.prefix, path.metadata, tenant_class_of(path.metadata) or host_class
        )
    return result + pool_routes(settings, tenant_class=host_class)


def virtual_hosts(settings: EnvoySettings) -> list[VirtualHost]:
    """Every host's, then one per set of policy hosts (Envoy picks the most specific domain)."""
    route_layout = settings.route_layout
    result = [VirtualHost(name="pools", domains=["*"], routes=routes(settings, route_layout.paths))]
    for host in route_layout.hosts:
        result.append(
            VirtualHost(
                name=f"policy-{host.name}",
                domains=list(host.domains),
                routes=routes(settings, host.paths, host.metadata),
                typed_per_filter_config=_ext_proc_metadata(host.metadata),
            )
        )
    return result


def _headers_from_metadata(settings: EnvoySettings) -> list[HeaderValueOption]:
    """One round trip: the gate's decision, from its metadata, as upstream headers (the pinned cluster
    reads x-kvgate-endpoint), and a reserved request's session, the gate's reservation id, which
    replaces a client's X-Session-ID (the engine's KV events must name the gate's reservation), and the
    priority the gate admitted with, for the queue. Absent metadata formats empty, and an empty header
    is not written (HeaderValueOption.keep_empty_value): Envoy's own priority header then stays."""
    pairs = [
        *GATE_HEADERS.items(),
        (SESSION_HEADER, META_SESSION),
        (settings.priority_header, META_PRIORITY),
    ]
    return [
        HeaderValueOption(
            header=HeaderValue(key=header, value=f"%DYNAMIC_METADATA({settings.metadata_namespace}:{key})%"),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for header, key in pairs
    ]


def decision_for_the_client(namespace: str, headers: Sequence[str]) -> list[HeaderValueOption]:
    """The gate's `headers` (its pool, tokens, reason) echoed in the response from its metadata in
    `namespace` (no extra round trip). A refusal the gate answers itself carries its own, which these
    never replace."""
    return [
        HeaderValueOption(
            header=HeaderValue(
                key=header, value=f"%DYNAMIC_METADATA({namespace}:{HEADER_FOR_METADATA[header]})%"
            ),
            append_action=HeaderValueOptionHeaderAppendAction.ADD_IF_ABSENT,
        )
        for header in headers
    ]


# zlib's own ceiling: Envoy's default ratio (100) silently truncates repetitive prompts; a zip bomb
# stops at the listener's buffer limit instead, with Envoy's 413.
_MAX_INFLATE_RATIO = 1032


def decompressor_filter() -> HttpFilter:
    """Inflates gzip request bodies ahead of ext_proc: engines do not, and the gate must size what
    the engine will read. Responses are left alone, and upstreams are not told Envoy accepts gzip."""
    decompressor = Decompressor(
        decompressor_library=TypedExtensionConfig(
            name="gzip", typed_config=AnyMessage.pack(Gzip(max_inflate_ratio=_MAX_INFLATE_RATIO))
        ),
        request_direction_config=DecompressorRequestDirectionConfig(advertise_accept_encoding=False),
        response_direction_config=DecompressorResponseDirectionConfig(
            common_config=DecompressorCommonDirectionConfig(
                enabled=RuntimeFeatureFlag(default_value=False, runtime_key="kvgate.decompress_responses")
            )
        ),
    )
    return HttpFilter(name=DECOMPRESSOR_FILTER, typed_config=AnyMessage.pack(decompressor))


def ext_proc_filter(settings: EnvoySettings) -> HttpFilter:
    one_trip = settings.round_trips == 1
    processor = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=GATE_CLUSTER)),
        failure_mode_allow=settings.fail_open,
        # The gate skips the body of a request it decided on the headers alone with a mode override
        # in its headers answer; one round trip has no headers answer.
        allow_mode_override=not one_trip,
        # Envoy's 200 ms default is too short to ship a multi-megabyte body to the gate.
        message_timeout=datetime.timedelta(milliseconds=settings.message_timeout_ms),
        # The gate holds a long request waiting for room by asking for more time, up to this.
        max_message_timeout=datetime.timedelta(milliseconds=settings.max_message_timeout_ms),
        request_attributes=list(request_attributes(settings.priority_header)) if one_trip else [],
        processing_mode=ProcessingMode(
            request_header_mode=(
                ProcessingModeHeaderSendMode.SKIP if one_trip else ProcessingModeHeaderSendMode.SEND
            ),
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            response_header_mode=ProcessingModeHeaderSendMode.SKIP,
        ),
        metadata_options=MetadataOptions(
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[settings.metadata_namespace])
        ),
    )
    return HttpFilter(name=EXT_PROC_FILTER, typed_config=AnyMessage.pack(processor))


def _buffer(settings: EnvoySettings) -> HttpFilter:
    """One round trip: holds the request, headers included, until ext_proc has the gate's answer, so
    the route is chosen with its metadata in place."""
    hold = Buffer(max_request_bytes=settings.buffer_limit_bytes)
    return HttpFilter(name=BUFFER_FILTER, typed_config=AnyMessage.pack(hold))


def _header_options(headers: Sequence[tuple[str, str]]) -> list[HeaderValueOption]:
    # OVERWRITE: Envoy's own Content-Type for a direct response or a local reply is text/plain.
    return [
        HeaderValueOption(
            header=HeaderValue(key=key, value=value),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for key, value in headers
    ]


def upstream_failure_replies() -> LocalReplyConfig:
    """Envoy's own answer to a node that failed before it answered, as an explicit, retryable refusal
    (kvgate.envoyconfig.upstream_failure)."""
    answer = upstream_unavailable()
    mapper = ResponseMapper(
        filter=AccessLogFilter(response_flag_filter=ResponseFlagFilter(flags=list(UPSTREAM_FAILURE_FLAGS))),
        status_code=answer.status,
        body=DataSource(inline_string=answer.body.decode()),
        body_format_override=SubstitutionFormatString(
            text_format_source=DataSource(inline_string="%LOCAL_REPLY_BODY%"), content_type="application/json"
        ),
        headers_to_add=_header_options(answer.headers),
    )
    return LocalReplyConfig(mappers=[mapper])


def ingress_listener(settings: EnvoySettings) -> Listener:
    one_trip = settings.round_trips == 1
    manager = HttpConnectionManager(
        stat_prefix="ingress",
        early_header_mutation_extensions=[
            strip_client_headers(tuple(GATE_HEADERS), settings.priority_header)
        ],
        route_config=RouteConfiguration(
            name="pools",
            virtual_hosts=virtual_hosts(settings),
            request_headers_to_add=_headers_from_metadata(settings) if one_trip else [],
            response_headers_to_add=decision_for_the_client(
                settings.metadata_namespace, (POOL_HEADER, TOKENS_HEADER, REASON_HEADER)
            ),
        ),
        local_reply_config=upstream_failure_replies(),
        http_filters=[
            *auth_filters(settings.identity, settings.priority_header),
            decompressor_filter(),
            ext_proc_filter(settings),
            *([_buffer(settings)] if one_trip else []),
            router(),
        ],
    )
    # Policy hosts are named without a port or a trailing dot: the HCM strips both from Host.
    # BUFFERED ext_proc holds the whole body in the listener's buffer; Envoy answers 413 itself past it.
    return client_listener(
        "ingress",
        manager,
        listen=settings.listen,
        identity=settings.identity,
        limits=settings.limits,
        buffer_limit=settings.buffer_limit_bytes,
    )


def client_listener(
    name: str,
    manager: HttpConnectionManager,
    *,
    listen: HostPort,
    identity: Identity | None,
    limits: Limits,
    buffer_limit: int,
) -> Listener:
    """The listener clients reach: Envoy's bounds on them, and TLS with client certificates under
    --auth mtls."""
    bound_manager(manager, limits)
    chain = hcm_filter(manager)
    if isinstance(identity, MtlsAuth):
        chain.transport_socket = listener_tls(identity)
    return Listener(
        name=name,
        address=address(listen.host, listen.port),
        per_connection_buffer_limit_bytes=buffer_limit,
        filter_chains=[chain],
    )


def ready_listener(host: str, port: int) -> Listener:
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
            router(),
        ],
    )
    return Listener(
        name="ready",
        address=address(host, port),
        filter_chains=[hcm_filter(manager)],
        # A flood of client connections at the overload manager's global limit must not fail the
        # probes too: a failed liveness probe restarts Envoy and drops every request in flight.
        ignore_global_conn_limit=True,
    )


def _dns_cluster(
    name: str, target: HostPort, connect_timeout: datetime.timedelta, buffer_limit: int
) -> Cluster:
    endpoint = LbEndpoint(endpoint=Endpoint(address=address(target.host, target.port)))
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STRICT_DNS,
        connect_timeout=connect_timeout,
        per_connection_buffer_limit_bytes=buffer_limit,
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=[endpoint])]
        ),
    )


def _gate_tls_socket(tls: GateTls) -> TransportSocket:
    """The UpstreamTlsContext of envoy/envoy-tls.yaml. `filename` sources are read once, at start: the
    chart's file-based SDS reloads them, but needs SDS files beside the bootstrap, on Envoy's machine."""
    certificates = []
    if tls.cert is not None and tls.key is not None:
        certificates.append(
            TlsCertificate(
                certificate_chain=DataSource(filename=tls.cert), private_key=DataSource(filename=tls.key)
            )
        )
    context = UpstreamTlsContext(
        sni=tls.server_name,
        common_tls_context=CommonTlsContext(
            # gRPC over TLS negotiates HTTP/2 by ALPN.
            alpn_protocols=["h2"],
            tls_certificates=certificates,
            validation_context=CertificateValidationContext(
                trusted_ca=DataSource(filename=tls.ca),
                # Without a name to match, any certificate from the CA would pass for the gate.
                match_typed_subject_alt_names=[
                    SubjectAltNameMatcher(
                        san_type=SubjectAltNameMatcherSanType.DNS,
                        matcher=StringMatcher(exact=tls.server_name),
                    )
                ],
            ),
        ),
    )
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=AnyMessage.pack(context))


def gate_cluster(target: HostPort, tls: GateTls | None, buffer_limit: int) -> Cluster:
    """The gate's ext_proc cluster: HTTP/2, circuit breakers above what Envoy's heap holds, TLS when
    asked."""
    gate = _dns_cluster(GATE_CLUSTER, target, datetime.timedelta(seconds=1), buffer_limit)
    http2 = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions()
        )
    )
    gate.typed_extension_protocol_options = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": AnyMessage.pack(http2)
    }
    # A request holds a stream to the gate while decided (and while reserved): Envoy's default of 1,024
    # would let a client that opens that many make Envoy skip the gate for everyone
    # (kvgate.envoyconfig.limits).
    gate.circuit_breakers = gate_circuit_breakers()
    if tls is not None:
        gate.transport_socket = _gate_tls_socket(tls)
    return gate


def auth_clusters(identity: Identity | None) -> list[Cluster]:
    """The authorization service's cluster, with --auth ext-authz."""
    if not isinstance(identity, ExtAuthzAuth):
        return []
    service = HostPort(identity.host, identity.port)
    return [_dns_cluster(AUTHZ_CLUSTER, service, datetime.timedelta(seconds=1), MiB)]


def clusters(settings: EnvoySettings) -> list[Cluster]:
    gate = gate_cluster(settings.gate, settings.gate_tls, settings.buffer_limit_bytes)
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
    return [gate, pinned, *pools, *auth_clusters(settings.identity)]


def render_bootstrap(settings: EnvoySettings) -> dict[str, Any]:
    """The bootstrap as a plain mapping in Envoy's own (snake_case proto JSON) form, ready for YAML."""
    bootstrap = Bootstrap(
        admin=Admin(address=address("127.0.0.1", settings.admin_port)),
        overload_manager=overload_manager(settings.limits),
        static_resources=BootstrapStaticResources(
            listeners=[ingress_listener(settings), ready_listener(settings.listen.host, settings.ready_port)],
            clusters=clusters(settings),
        ),
    )
    rendered: dict[str, Any] = bootstrap.to_dict(casing=betterproto2.Casing.SNAKE)
    return rendered
