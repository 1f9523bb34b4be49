"""Who a request is from, as Envoy establishes it before the gate sees the request.

The tenant (`x-kvgate-tenant`) and the priority (the gate's admission.priority_header) are trusted
headers: Envoy removes a client's copies in the early header mutation, ahead of every filter and of
route selection (`strip_client_headers`), and sets them again only from an identity it verified:
- `JwtAuth`: jwt_authn verifies the bearer token and copies its claims into the two headers
  (JwtProvider.claim_to_headers, which also replaces any value already there);
- `ExtAuthzAuth`: an HTTP authorization service answers each request, and only the two headers of
  its answer reach the upstream (AuthorizationResponse.allowed_upstream_headers);
- `MtlsAuth`: the listener requires a client certificate from the operator's CA, and the tenant is
  the certificate's URI SAN (`%DOWNSTREAM_PEER_URI_SAN%`, which Envoy 1.40 formats in the
  header_mutation filter; comma-joined if a certificate carries several).
After the auth filter, the header_mutation filter adds `x-kvgate-tenant: anonymous` where no identity
set one, so a request without one is charged like any other tenant, under that name.

Field docs: envoyproxy/envoy v1.40 api/envoy/extensions/filters/http/jwt_authn/v3/config.proto,
.../ext_authz/v3/ext_authz.proto, .../header_mutation/v3/header_mutation.proto,
api/envoy/extensions/transport_sockets/tls/v3/tls.proto.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation
    from envoy_data_plane.envoy.config.core.v3 import (
        DataSource,
        HeaderValue,
        HeaderValueOption,
        HeaderValueOptionHeaderAppendAction,
        HttpUri,
        TransportSocket,
        TypedExtensionConfig,
    )
    from envoy_data_plane.envoy.config.route.v3 import RouteMatch
    from envoy_data_plane.envoy.extensions.filters.http.ext_authz.v3 import (
        AuthorizationResponse,
        ExtAuthz,
        HttpService,
    )
    from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import (
        HeaderMutation as HeaderMutationFilter,
    )
    from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import Mutations
    from envoy_data_plane.envoy.extensions.filters.http.jwt_authn.v3 import (
        JwtAuthentication,
        JwtClaimToHeader,
        JwtProvider,
        JwtRequirement,
        JwtRequirementOrList,
        RequirementRule,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
    from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
        HeaderMutation as EarlyHeaderMutation,
    )
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
        CertificateValidationContext,
        CommonTlsContext,
        DownstreamTlsContext,
        TlsCertificate,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import ListStringMatcher, StringMatcher
    from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
    from envoy_data_plane.google.protobuf import Any as AnyMessage
    from envoy_data_plane.google.protobuf import Empty

from kvgate.names import ANONYMOUS_TENANT, TENANT_CLASS_HEADER, TENANT_HEADER

# Tenant headers older kvgate set-ups read (the queue's `x-tenant`, envoy/rate-limit.yaml's
# `x-tenant-id`): removed from clients like the trusted ones, so no part of the stack that still reads
# them can be told a tenant by the client.
LEGACY_TENANT_HEADERS = ("x-tenant", "x-tenant-id")
JWT_PROVIDER = "kvgate"
AUTHZ_CLUSTER = "kvgate_authz"
JWT_FILTER = "envoy.filters.http.jwt_authn"
EXT_AUTHZ_FILTER = "envoy.filters.http.ext_authz"
HEADER_MUTATION_FILTER = "envoy.filters.http.header_mutation"


@dataclass(frozen=True, slots=True)
class JwtAuth:
    """jwt_authn with one provider. `jwks` is where Envoy finds the issuer's public keys (a file on
    Envoy's machine, read at start: local_jwks)."""

    issuer: str
    jwks: str
    audiences: tuple[str, ...] = ()
    tenant_claim: str = "tenant"
    priority_claim: str = "kvgate_priority"
    # False: a request without a token is the anonymous tenant; one with a bad token is refused (401).
    required: bool = False


@dataclass(frozen=True, slots=True)
class ExtAuthzAuth:
    """An HTTP authorization service (envoy.service.auth HTTP flavour): 2xx admits, anything else is
    the client's answer; its x-kvgate-tenant and priority headers reach the upstream, no others."""

    host: str
    port: int
    timeout_ms: int = 500


@dataclass(frozen=True, slots=True)
class MtlsAuth:
    """TLS on the listener with client certificates from `client_ca`; paths on Envoy's machine."""

    cert: str
    key: str
    client_ca: str
    # False: a client without a certificate is the anonymous tenant (one with a bad one is refused).
    required: bool = False


Identity = JwtAuth | ExtAuthzAuth | MtlsAuth


def trusted_headers(priority_header: str) -> tuple[str, ...]:
    """The identity headers a client may not send: only Envoy sets them, after authentication (the
    tenant, the priority) or from the route (the tenant class, for the queue)."""
    return (TENANT_HEADER, priority_header, TENANT_CLASS_HEADER, *LEGACY_TENANT_HEADERS)


def strip_client_headers(gate_headers: tuple[str, ...], priority_header: str) -> TypedExtensionConfig:
    """The early header mutation: runs before route selection and every filter, so neither a failed
    open ext_proc nor an auth filter that lets a request through unauthenticated leaves a client's
    copy of a routing or identity header in place."""
    names = dict.fromkeys((*gate_headers, *trusted_headers(priority_header)))
    mutation = EarlyHeaderMutation(mutations=[HeaderMutation(remove=name) for name in names])
    return TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation", typed_config=AnyMessage.pack(mutation)
    )


def _header(key: str, value: str, action: HeaderValueOptionHeaderAppendAction) -> HeaderMutation:
    return HeaderMutation(
        append=HeaderValueOption(header=HeaderValue(key=key, value=value), append_action=action)
    )


def auth_filters(identity: Identity | None, priority_header: str) -> list[HttpFilter]:
    """The filters ahead of ext_proc: the operator's authentication, then the tenant's default."""
    result: list[HttpFilter] = []
    if isinstance(identity, JwtAuth):
        result.append(_jwt_filter(identity, priority_header))
    elif isinstance(identity, ExtAuthzAuth):
        result.append(_ext_authz_filter(identity, priority_header))
    actions = HeaderValueOptionHeaderAppendAction
    mutations = []
    if isinstance(identity, MtlsAuth):
        # No certificate formats empty, and an empty value is not written (keep_empty_value false):
        # the anonymous default below applies. The early mutation already removed a client's copy.
        mutations.append(
            _header(TENANT_HEADER, "%DOWNSTREAM_PEER_URI_SAN%", actions.OVERWRITE_IF_EXISTS_OR_ADD)
        )
    mutations.append(_header(TENANT_HEADER, ANONYMOUS_TENANT, actions.ADD_IF_ABSENT))
    tenant = HeaderMutationFilter(mutations=Mutations(request_mutations=mutations))
    result.append(HttpFilter(name=HEADER_MUTATION_FILTER, typed_config=AnyMessage.pack(tenant)))
    return result


def _jwt_filter(jwt: JwtAuth, priority_header: str) -> HttpFilter:
    provider = JwtProvider(
        issuer=jwt.issuer,
        audiences=list(jwt.audiences),
        local_jwks=DataSource(filename=jwt.jwks),
        # forward false (the default): the token is removed once verified, so no engine or queue sees
        # a client's credential.
        claim_to_headers=[
            JwtClaimToHeader(header_name=TENANT_HEADER, claim_name=jwt.tenant_claim),
            JwtClaimToHeader(header_name=priority_header, claim_name=jwt.priority_claim),
        ],
    )
    requires = JwtRequirement(provider_name=JWT_PROVIDER)
    if not jwt.required:
        # allow_missing: no token passes (anonymous), a token that fails verification is refused.
        requires = JwtRequirement(
            requires_any=JwtRequirementOrList(requirements=[requires, JwtRequirement(allow_missing=Empty())])
        )
    config = JwtAuthentication(
        providers={JWT_PROVIDER: provider},
        rules=[RequirementRule(match=RouteMatch(prefix="/"), requires=requires)],
    )
    return HttpFilter(name=JWT_FILTER, typed_config=AnyMessage.pack(config))


def _ext_authz_filter(authz: ExtAuthzAuth, priority_header: str) -> HttpFilter:
    allowed = ListStringMatcher(
        patterns=[StringMatcher(exact=TENANT_HEADER), StringMatcher(exact=priority_header)]
    )
    config = ExtAuthz(
        http_service=HttpService(
            server_uri=HttpUri(
                uri=f"http://{authz.host}:{authz.port}",
                cluster=AUTHZ_CLUSTER,
                timeout=datetime.timedelta(milliseconds=authz.timeout_ms),
            ),
            # Only the identity headers of the service's answer go upstream (they replace any there).
            authorization_response=AuthorizationResponse(allowed_upstream_headers=allowed),
        ),
        # The service down: refuse (503), never admit unauthenticated. The service sees Host, Method,
        # Path, Content-Length and Authorization (ExtAuthz.allowed_headers' default for HTTP).
        failure_mode_allow=False,
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
    )
    return HttpFilter(name=EXT_AUTHZ_FILTER, typed_config=AnyMessage.pack(config))


def listener_tls(mtls: MtlsAuth) -> TransportSocket:
    """The ingress listener's TLS: Envoy's serving certificate, and client certificates checked
    against `client_ca` (required unless `mtls.required` is off; a bad one is always refused)."""
    context = DownstreamTlsContext(
        require_client_certificate=mtls.required,
        common_tls_context=CommonTlsContext(
            tls_certificates=[
                TlsCertificate(
                    certificate_chain=DataSource(filename=mtls.cert),
                    private_key=DataSource(filename=mtls.key),
                )
            ],
            validation_context=CertificateValidationContext(trusted_ca=DataSource(filename=mtls.client_ca)),
        ),
    )
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=AnyMessage.pack(context))
