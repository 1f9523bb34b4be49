"""`kvgate envoy-config`: print the Envoy bootstrap for plain Envoy in front of the gate, in the gate's
own dialect (kvgate.envoyconfig.bootstrap) or as an InferencePool's gateway
(kvgate.envoyconfig.inference_pool)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from kvgate.config import Config, MiB, load_config
from kvgate.envoyconfig.identity import ExtAuthzAuth, Identity, JwtAuth, MtlsAuth
from kvgate.envoyconfig.limits import Limits
from kvgate.envoyconfig.routepolicy import load_route_policies
from kvgate.envoyconfig.settings import FAILURE_MODES, GateTls, HostPort, envoy_settings, parse_host_port
from kvgate.envoyconfig.unanswered import LONG_CHOICES
from kvgate.errors import ConfigError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "envoy-config",
        help="render the Envoy bootstrap for plain Envoy in front of the gate",
        description=(
            "Write a static Envoy bootstrap (YAML) that strips client copies of the gate's headers, "
            "sends each request's headers and buffered body to the gate over ext_proc, and routes on the "
            "gate's decision (--round-trips). Buffer limits, pool names, the priority header and the "
            "metadata namespace come from the gate's config; pool addresses from --pool. The Helm "
            "chart's standalone mode renders the same bootstrap. With --inference-pool it renders Envoy as "
            "an InferencePool's gateway instead, the gate as the pool's endpoint picker."
        ),
        epilog=(
            "example: kvgate envoy-config --config kvgate.yaml --pool interactive=10.0.0.5:8000 "
            "--pool long=10.0.0.6:8000 --pool async=10.0.0.7:8080 > envoy.yaml"
        ),
    )
    parser.add_argument(
        "--config", type=Path, help="the gate's kvgate YAML file (default: built-in defaults)"
    )
    parser.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="an upstream pool by its x-kvgate-pool value; every pool the config routes to is required",
    )
    parser.add_argument(
        "--default-pool", help="pool for requests without a pool header (default: the interactive pool)"
    )
    parser.add_argument(
        "--queue",
        metavar="HOST:PORT",
        help=(
            "`kvgate queue`, as the async pool (default_model.pools.async): its own API (/v1/files, "
            "/v1/batches, /v1/kvgate/jobs) is routed there with ext_proc off, and the async route waits "
            "queue.max_hold_s + 30 s for a held request's answer"
        ),
    )
    parser.add_argument(
        "--route-policies",
        type=Path,
        metavar="FILE",
        help=(
            "YAML with `route_policies:`, a list of per-host / per-route policies (name, hosts, path_prefix, "
            "interactive_max_tokens, max_total_tokens, default_output_tokens, model_policy, async), "
            "rendered as ext_proc per-route gRPC metadata on virtual hosts and routes (docs/operations.md)"
        ),
    )
    parser.add_argument("--listen", default="0.0.0.0:10000", help="Envoy's listener (default 0.0.0.0:10000)")
    parser.add_argument(
        "--ready-port", type=_positive_int, default=19001, help="port of the /ready listener (default 19001)"
    )
    parser.add_argument(
        "--admin-port", type=_positive_int, default=9901, help="admin port, on 127.0.0.1 (default 9901)"
    )
    parser.add_argument("--gate", help="the gate's HOST:PORT (default: from server.listen)")
    parser.add_argument(
        "--message-timeout-ms",
        type=_positive_int,
        default=5000,
        help="ext_proc per-message timeout (default 5000): the gate must answer a body, or ask for more "
        "time, within it (admission.max_wait_s, or half of it when the gate holds requests, + 0.5 s)",
    )
    parser.add_argument(
        "--max-message-timeout-ms",
        type=_positive_int,
        default=None,
        help="the longest the gate may ask Envoy to wait for one answer, holding a long request for "
        "room (ext_proc max_message_timeout; default 60000, or admission.max_hold_s + 5 s if longer)",
    )
    parser.add_argument(
        "--fail-closed",
        action="store_true",
        help="answer 500 when the gate is unreachable (default: fail open)",
    )
    parser.add_argument(
        "--fail-open-long",
        choices=LONG_CHOICES,
        default="refuse",
        help=(
            "failing open, where a request the gate did not answer (down, or past --message-timeout-ms) "
            "goes when its body may hold more tokens than the default pool's interactive_max_tokens (at "
            "one token per byte: that many bytes and more), or is of unknown size (no Content-Length) "
            "or compressed: refuse (default: 503 gate_unavailable with Retry-After) or long-pool (the "
            "long pool, unreserved). Smaller bodies fail open to the default pool"
        ),
    )
    parser.add_argument(
        "--route-timeout-seconds",
        type=_non_negative_int,
        default=0,
        help="upstream request timeout, 0 = none (default 0)",
    )
    parser.add_argument(
        "--round-trips",
        type=int,
        choices=(1, 2),
        default=2,
        help=(
            "ext_proc round trips per request (default 2: the headers, then the body; routes follow the "
            "x-kvgate-pool header the gate sets). 1 sends the body alone, with the headers the gate reads "
            "as request attributes: one gRPC message each way instead of two, but bodiless requests never "
            "reach the gate (they take the default pool), a buffer filter holds each request until "
            "the gate answers, and the upstream x-kvgate-* headers are copied from the gate's dynamic "
            "metadata"
        ),
    )
    pool = parser.add_argument_group(
        "an InferencePool's gateway (docs/picker.md)",
        "--inference-pool renders Envoy as the gateway of an InferencePool whose endpoint picker is the gate "
        "(kvgate.yaml: server.protocol: endpoint-picker), as envoy/envoy-inferencepool.yaml: ext_proc with "
        "both bodies FULL_DUPLEX_STREAMED, one cluster over the pool's engines with Envoy's override_host "
        "load balancer following the engine the picker names. The pool and queue flags above do not apply.",
    )
    pool.add_argument("--inference-pool", action="store_true", help="render the pool's gateway")
    pool.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="an engine of the pool, as its agent names it (repeat for each)",
    )
    pool.add_argument(
        "--failure-mode",
        choices=FAILURE_MODES,
        default="FailClose",
        help=(
            "the pool's endpointPickerRef.failureMode while the gate is unreachable (default FailClose: "
            "500). FailOpen lets through only requests without a body: Envoy cannot take back a body it "
            "streamed to the picker"
        ),
    )
    parser.add_argument("--output", type=Path, help="write here instead of standard output")
    _register_identity(parser)
    _register_limits(parser)
    tls = parser.add_argument_group(
        "TLS to the gate (see docs/tls.md)",
        "Paths are where Envoy will find the files: they are not read or checked here, since the "
        "bootstrap is often rendered on one machine for another. Envoy reads them once, at start, so a "
        "renewed certificate takes an Envoy restart (or hot restart); the Helm chart's standalone Envoy "
        "reloads them through file-based SDS instead. The gate's config must agree: with tls.server "
        "these flags are required, and with tls.server.client_ca so are --gate-tls-cert and --gate-tls-key.",
    )
    tls.add_argument(
        "--gate-tls-ca",
        type=_non_empty,
        metavar="PEM",
        help="talk TLS to the gate, whose certificate must come from this CA (default: plaintext)",
    )
    tls.add_argument(
        "--gate-server-name",
        type=_non_empty,
        metavar="NAME",
        help=(
            "required with --gate-tls-ca: the DNS name the gate's certificate must carry, also sent as "
            "SNI. Without a name to match, any certificate from the CA would pass for the gate"
        ),
    )
    tls.add_argument(
        "--gate-tls-cert",
        type=_non_empty,
        metavar="PEM",
        help="Envoy's client certificate (chain), for a gate with tls.server.client_ca (mTLS)",
    )
    tls.add_argument(
        "--gate-tls-key", type=_non_empty, metavar="PEM", help="that certificate's private key (unencrypted)"
    )
    parser.set_defaults(func=run)


AUTH_MODES = ("none", "jwt", "ext-authz", "mtls")
# The flags each --auth mode takes: given with another mode, they are refused rather than ignored.
_MODE_FLAGS = {
    "jwt": ("jwt_issuer", "jwt_jwks", "jwt_audience", "jwt_tenant_claim", "jwt_priority_claim"),
    "ext-authz": ("ext_authz", "ext_authz_timeout_ms"),
    "mtls": ("tls_cert", "tls_key", "client_ca"),
}


def _register_identity(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "client identity (docs/operations.md, Security model)",
        "Envoy removes x-kvgate-tenant, the priority header (admission.priority_header), x-tenant and "
        "x-tenant-id from every client request before anything reads them, and sets the tenant and the "
        "priority again only from an identity it verified. A request without one is the tenant "
        "'anonymous', charged like any other. Paths are where Envoy will find the files (not read here).",
    )
    group.add_argument(
        "--auth",
        choices=AUTH_MODES,
        default="none",
        help=(
            "none (default): every client is anonymous. jwt: jwt_authn verifies the bearer token against "
            "--jwt-jwks and copies its claims into the tenant and priority headers (the token is removed "
            "once verified). ext-authz: an HTTP authorization service (--ext-authz) answers each request, "
            "and only its x-kvgate-tenant and priority headers reach the upstream (if it is down, "
            "requests get 503). mtls: TLS on the listener with client certificates from --client-ca; "
            "the tenant is the certificate's URI SAN"
        ),
    )
    group.add_argument(
        "--auth-required",
        action="store_true",
        help=(
            "jwt: a request without a token gets 401 (default: it is anonymous); mtls: a client without a "
            "certificate is refused at the handshake (default without this flag: anonymous). A bad token "
            "or certificate is always refused. With ext-authz the service decides"
        ),
    )
    group.add_argument("--jwt-issuer", type=_non_empty, metavar="ISS", help="jwt: the tokens' `iss`")
    group.add_argument(
        "--jwt-jwks", type=_non_empty, metavar="FILE", help="jwt: the issuer's public keys (a JWKS file)"
    )
    group.add_argument(
        "--jwt-audience",
        action="append",
        metavar="AUD",
        help="jwt: an accepted `aud` (repeat for several; default: any audience)",
    )
    group.add_argument(
        "--jwt-tenant-claim",
        type=_non_empty,
        metavar="CLAIM",
        help="jwt: the tenant's claim (default tenant)",
    )
    group.add_argument(
        "--jwt-priority-claim",
        type=_non_empty,
        metavar="CLAIM",
        help="jwt: the priority's claim (default kvgate_priority); the route's max_priority still caps it",
    )
    group.add_argument("--ext-authz", metavar="HOST:PORT", help="ext-authz: the HTTP authorization service")
    group.add_argument(
        "--ext-authz-timeout-ms",
        type=_positive_int,
        metavar="MS",
        help="ext-authz: how long to wait for its answer (default 500)",
    )
    group.add_argument("--tls-cert", type=_non_empty, metavar="PEM", help="mtls: Envoy's serving certificate")
    group.add_argument("--tls-key", type=_non_empty, metavar="PEM", help="mtls: its private key")
    group.add_argument(
        "--client-ca", type=_non_empty, metavar="PEM", help="mtls: the CA the client certificates come from"
    )


def _register_limits(parser: argparse.ArgumentParser) -> None:
    defaults = Limits()
    group = parser.add_argument_group(
        "Envoy's bounds",
        "A client can hold at most these of Envoy. The gate cluster's circuit breakers sit above what the "
        "heap can hold, so a flood of requests meets a 503 rather than Envoy skipping the gate.",
    )
    group.add_argument(
        "--request-timeout-seconds",
        type=_positive_int,
        metavar="S",
        default=defaults.request_timeout_s,
        help=(
            "time to receive a whole request, body included (default %(default)s; uploads to the queue's "
            "/v1/files must finish within it)"
        ),
    )
    group.add_argument(
        "--request-headers-timeout-seconds",
        type=_positive_int,
        metavar="S",
        default=defaults.request_headers_timeout_s,
        help="time to receive a request's headers (default %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=_positive_int,
        metavar="N",
        default=defaults.max_connections,
        help="downstream connections Envoy accepts at once, all listeners (default %(default)s)",
    )
    group.add_argument(
        "--max-heap-mib",
        type=_positive_int,
        metavar="MIB",
        default=defaults.max_heap_bytes // MiB,
        help=(
            "Envoy's heap budget: new requests get 503 past 98%% of it (default %(default)s; about 75%% of "
            "the container's memory limit)"
        ),
    )


def identity_from_args(args: argparse.Namespace) -> Identity | None:
    for mode, flags in _MODE_FLAGS.items():
        given = [flag for flag in flags if getattr(args, flag) is not None]
        if given and args.auth != mode:
            raise ConfigError(f"--{given[0].replace('_', '-')} is for --auth {mode} (got --auth {args.auth})")
    if args.auth == "jwt":
        if args.jwt_issuer is None or args.jwt_jwks is None:
            raise ConfigError("--auth jwt needs --jwt-issuer and --jwt-jwks")
        claims = {"tenant_claim": args.jwt_tenant_claim, "priority_claim": args.jwt_priority_claim}
        return JwtAuth(
            issuer=args.jwt_issuer,
            jwks=args.jwt_jwks,
            audiences=tuple(args.jwt_audience or ()),
            required=args.auth_required,
            **{name: claim for name, claim in claims.items() if claim is not None},
        )
    if args.auth == "ext-authz":
        if args.ext_authz is None:
            raise ConfigError("--auth ext-authz needs --ext-authz HOST:PORT")
        if args.auth_required:
            raise ConfigError("--auth-required: with --auth ext-authz the authorization service decides")
        service = parse_host_port(args.ext_authz, "--ext-authz")
        if args.ext_authz_timeout_ms is None:
            return ExtAuthzAuth(service.host, service.port)
        return ExtAuthzAuth(service.host, service.port, args.ext_authz_timeout_ms)
    if args.auth == "mtls":
        if args.tls_cert is None or args.tls_key is None or args.client_ca is None:
            raise ConfigError("--auth mtls needs --tls-cert, --tls-key and --client-ca")
        return MtlsAuth(args.tls_cert, args.tls_key, args.client_ca, required=args.auth_required)
    if args.auth_required:
        raise ConfigError(
            "--auth-required needs --auth jwt or mtls: without authentication, who is required?"
        )
    return None


def parse_pools(items: list[str]) -> dict[str, HostPort]:
    pools: dict[str, HostPort] = {}
    for item in items:
        name, sep, address = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--pool: expected NAME=HOST:PORT, got {item!r}")
        if name in pools:
            raise ConfigError(f"--pool: pool {name!r} given twice")
        pools[name] = parse_host_port(address, f"--pool {name}")
    return pools


def gate_tls_from_args(args: argparse.Namespace) -> GateTls | None:
    if (args.gate_tls_cert is None) != (args.gate_tls_key is None):
        raise ConfigError("--gate-tls-cert and --gate-tls-key go together")
    if args.gate_tls_ca is None:
        if args.gate_server_name is not None or args.gate_tls_cert is not None:
            flag = "--gate-server-name" if args.gate_server_name is not None else "--gate-tls-cert"
            raise ConfigError(f"{flag} needs --gate-tls-ca: without it Envoy talks plaintext to the gate")
        return None
    if args.gate_server_name is None:
        raise ConfigError(
            "--gate-tls-ca needs --gate-server-name: without a name to match, any certificate from the CA "
            "would pass for the gate"
        )
    return GateTls(args.gate_tls_ca, args.gate_server_name, args.gate_tls_cert, args.gate_tls_key)


def _non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# Flags of the dialect's bootstrap, each with its default: given with --inference-pool, they are refused
# rather than ignored.
_DIALECT_FLAGS: dict[str, object] = {
    "pool": [],
    "default_pool": None,
    "queue": None,
    "route_policies": None,
    "message_timeout_ms": 5000,
    "max_message_timeout_ms": None,
    "fail_closed": False,
    "fail_open_long": "refuse",
    "round_trips": 2,
}

# And the pool gateway's own flags, refused without --inference-pool.
_POOL_FLAGS: dict[str, object] = {"endpoint": [], "failure_mode": "FailClose"}


def run(args: argparse.Namespace) -> int:
    from kvgate.envoyconfig.bootstrap import render_bootstrap
    from kvgate.envoyconfig.inference_pool import pool_gateway_settings, render_pool_gateway

    gate_tls = gate_tls_from_args(args)
    identity = identity_from_args(args)
    limits = Limits(
        request_headers_timeout_s=args.request_headers_timeout_seconds,
        request_timeout_s=args.request_timeout_seconds,
        max_connections=args.max_connections,
        max_heap_bytes=args.max_heap_mib * MiB,
    )
    config = load_config(args.config) if args.config else Config()
    if args.inference_pool:
        for flag, default in _DIALECT_FLAGS.items():
            if getattr(args, flag) != default:
                raise ConfigError(f"--{flag.replace('_', '-')} does not apply to --inference-pool")
        pool_settings = pool_gateway_settings(
            config,
            [parse_host_port(endpoint, "--endpoint") for endpoint in args.endpoint],
            listen=parse_host_port(args.listen, "--listen"),
            gate=parse_host_port(args.gate, "--gate") if args.gate else None,
            failure_mode=args.failure_mode,
            ready_port=args.ready_port,
            admin_port=args.admin_port,
            route_timeout_seconds=args.route_timeout_seconds,
            gate_tls=gate_tls,
            identity=identity,
            limits=limits,
        )
        return _write(args.output, render_pool_gateway(pool_settings))
    for pool_flag, unset in _POOL_FLAGS.items():
        if getattr(args, pool_flag) != unset:
            raise ConfigError(f"--{pool_flag.replace('_', '-')} is for --inference-pool")
    settings = envoy_settings(
        config,
        parse_pools(args.pool),
        listen=parse_host_port(args.listen, "--listen"),
        ready_port=args.ready_port,
        admin_port=args.admin_port,
        gate=parse_host_port(args.gate, "--gate") if args.gate else None,
        default_pool=args.default_pool,
        message_timeout_ms=args.message_timeout_ms,
        max_message_timeout_ms=args.max_message_timeout_ms,
        fail_open=not args.fail_closed,
        fail_open_long=args.fail_open_long,
        route_timeout_seconds=args.route_timeout_seconds,
        round_trips=args.round_trips,
        gate_tls=gate_tls,
        queue=parse_host_port(args.queue, "--queue") if args.queue else None,
        route_policies=load_route_policies(args.route_policies) if args.route_policies else (),
        route_policies_source=str(args.route_policies),
        identity=identity,
        limits=limits,
    )
    return _write(args.output, render_bootstrap(settings))


def _write(output: Path | None, bootstrap: dict[str, object]) -> int:
    text = yaml.safe_dump(bootstrap, sort_keys=False)
    if output:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--output {output}: cannot write: {exc.strerror}") from None
    else:
        sys.stdout.write(text)
    return 0
