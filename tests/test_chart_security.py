"""The chart's trust boundaries (issue 27; ../shared/research/security-review.md findings 3, 4, 6-8, 10-12),
rendered by the real helm and, where Envoy is on the path, run through the real Envoy on 127.0.0.1:

- NetworkPolicies by default in every mode: the gate and the queue from Envoy only, the agents from the
  gate and the queue only, metrics from the monitoring namespace;
- agent mTLS by default, from certificates the chart generates (or cert-manager issues), each side with
  its own CA;
- identity where the operator says (auth.method): Envoy strips the client's tenant and priority headers
  and sets them from a verified JWT, an authorization service or a client certificate; a queue without
  an identity is refused;
- Envoy bounded: circuit breakers on the gate, request timeouts, the overload manager, Host
  normalization, and an alert when requests skip the gate;
- the queue's store URL never on a command line.

What runs (the real Envoy and agent) is in test_chart_security_live.py.
"""

from __future__ import annotations

import subprocess
from base64 import b64decode
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart import (
    CHART,
    EXT_AUTHZ,
    OWN_ENVOY_PEERS,
    STRIPPED_HEADERS,
    Helm,
    HelmFailed,
    by_kind,
    check_object,
    container,
    gate_config_text,
    one,
    real_helm,
    standalone,
    with_queue,
)
from test_chart_envoy import envoy_validate

from kvgate.config import parse_config
from kvgate.harness.jwt import Signer

MODES = ("standalone", "istio", "envoy-gateway", "none", "simulator")
OPENSSL_TIMEOUT_S = 30
STATUS_TIMEOUT_S = 60


@pytest.fixture(scope="session")
def helm() -> Helm:
    return real_helm()


def mode_docs(helm: Helm, mode: str, **values: Any) -> list[dict[str, Any]]:
    """Every mode as an operator would install it: the ci/ values (the queue on, with JWT, in the meshes)."""
    if mode in ("istio", "envoy-gateway"):
        return helm.render(values, CHART / "ci" / f"{mode}-values.yaml")
    base = {
        "standalone": standalone(),
        "none": {"envoy": {"mode": "none"}, "networkPolicy": OWN_ENVOY_PEERS},
        "simulator": {"simulator": {"enabled": True}},
    }[mode]
    return helm.render(base | values)


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions with In) against `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def admitted(policy: dict[str, Any], port: int, labels: dict[str, str], namespace: str) -> bool:
    """Whether `policy` lets a pod with `labels` in `namespace` connect to `port`."""
    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule["ports"]]:
            continue
        for peer in rule["from"]:
            namespaces = peer.get("namespaceSelector")
            in_namespace = (
                namespace == policy["metadata"]["namespace"]
                if namespaces is None
                else matches(namespaces, {"kubernetes.io/metadata.name": namespace})
            )
            if in_namespace and matches(peer.get("podSelector", {}), labels):
                return True
    return False


def policy_for(docs: list[dict[str, Any]], workload: dict[str, Any]) -> dict[str, Any]:
    (policy,) = [
        p for p in by_kind(docs, "NetworkPolicy") if matches(p["spec"]["podSelector"], pod_labels(workload))
    ]
    return policy


# --- NetworkPolicies ---------------------------------------------------------------------------------------

ENVOY_PODS = {
    # mode: (labels, namespace) of a pod of that mode's Envoy
    "standalone": ({"app.kubernetes.io/name": "kvgate", "app.kubernetes.io/instance": "rel"}, "llm"),
    "istio": ({"istio": "ingressgateway"}, "istio-ingress"),
    "envoy-gateway": (
        {
            "gateway.envoyproxy.io/owning-gateway-name": "llm",
            "gateway.envoyproxy.io/owning-gateway-namespace": "gateways",
        },
        "envoy-gateway-system",
    ),
    "none": ({"app": "my-envoy"}, "llm"),
}
ANY_POD = ({"app": "curl"}, "llm")
PROMETHEUS = ({"app.kubernetes.io/name": "prometheus"}, "monitoring")


@pytest.mark.parametrize("mode", MODES)
def test_network_policies_are_rendered_by_default_in_every_mode(helm: Helm, mode: str) -> None:
    docs = mode_docs(helm, mode)
    for doc in by_kind(docs, "NetworkPolicy"):
        check_object(doc)
        assert doc["spec"]["policyTypes"] == ["Ingress"], "egress is left alone"
    envoy = ENVOY_PODS["standalone" if mode == "simulator" else mode]
    if mode in ("standalone", "simulator"):
        envoy = (pod_labels(one(docs, "Deployment", "-envoy")), "llm")
    gate = one(docs, "Deployment", "-gate")
    gate_pod = (pod_labels(gate), "llm")
    queues = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-queue")]
    queue_pod = (pod_labels(queues[0]), "llm") if queues else None

    policy = policy_for(docs, gate)
    assert admitted(policy, 9002, *envoy)
    for stranger in (ANY_POD, PROMETHEUS, gate_pod):
        assert not admitted(policy, 9002, *stranger), "only Envoy speaks ext_proc to the gate"
    assert admitted(policy, 9464, *PROMETHEUS) and not admitted(policy, 9464, *ANY_POD)

    agent_pods = by_kind(docs, "DaemonSet") or [one(docs, "Deployment", "-sim-long")]
    for agents in agent_pods:
        policy = policy_for(docs, agents)
        assert admitted(policy, 9100, *gate_pod)
        if queue_pod:
            assert admitted(policy, 9100, *queue_pod)
        for stranger in (ANY_POD, envoy, PROMETHEUS):
            assert not admitted(policy, 9100, *stranger), "a Reserve holds a node's KV capacity"
        assert admitted(policy, 9465, *PROMETHEUS) and not admitted(policy, 9465, *ANY_POD)

    if queue_pod:
        (queue,) = queues
        policy = policy_for(docs, queue)
        assert admitted(policy, 8003, *envoy)
        assert not admitted(policy, 8003, *ANY_POD) and not admitted(policy, 8003, *gate_pod)
        assert admitted(policy, 9466, *PROMETHEUS)
    if mode == "simulator":
        # The simulated engine: Envoy routes to it, and the queue (when on) runs jobs on it.
        policy = policy_for(docs, one(docs, "Deployment", "-sim-interactive"))
        assert admitted(policy, 8000, *envoy) and not admitted(policy, 8000, *ANY_POD)


def test_network_policy_peers_are_settable(helm: Helm) -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"team": "edge"}}}]
    docs = helm.render(
        standalone(networkPolicy={"envoyPeers": peers, "metricsNamespaces": ["observability"]})
    )
    gate = policy_for(docs, one(docs, "Deployment", "-gate"))
    assert gate["spec"]["ingress"][0]["from"] == peers
    assert admitted(gate, 9464, {"app": "prometheus"}, "observability")
    assert not admitted(gate, 9464, *PROMETHEUS)
    scrapers = [{"podSelector": {"matchLabels": {"app": "vmagent"}}}]
    docs = helm.render(standalone(networkPolicy={"metricsPeers": scrapers}))
    assert policy_for(docs, one(docs, "Deployment", "-gate"))["spec"]["ingress"][1]["from"] == scrapers
    eg = helm.render(
        {"envoy": {"envoyGateway": {"proxyNamespace": "llm-gateways"}}},
        CHART / "ci" / "envoy-gateway-values.yaml",
    )
    (peer,) = policy_for(eg, one(eg, "Deployment", "-gate"))["spec"]["ingress"][0]["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "llm-gateways"}}
    assert not by_kind(helm.render(standalone(networkPolicy={"enabled": False})), "NetworkPolicy")


def test_your_own_envoy_must_be_named(helm: Helm) -> None:
    with pytest.raises(HelmFailed, match=r"networkPolicy\.envoyPeers is required with envoy\.mode none"):
        helm.render({"envoy": {"mode": "none"}})


# --- agent mTLS ------------------------------------------------------------------------------------------


def secret_files(docs: list[dict[str, Any]], name: str, directory: Path) -> Path:
    """A rendered kubernetes.io/tls Secret's keys as files under directory/name."""
    (secret,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == name]
    assert secret["type"] == "kubernetes.io/tls"
    target = directory / name
    target.mkdir(parents=True)
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (target / key).write_bytes(b64decode(secret["data"][key]))
    return target


def verifies(ca: Path, cert: Path, purpose: str) -> bool:
    result = subprocess.run(
        ["openssl", "verify", "-purpose", purpose, "-CAfile", str(ca), str(cert)],
        capture_output=True,
        text=True,
        timeout=OPENSSL_TIMEOUT_S,
        check=False,
    )
    return result.returncode == 0


def sans(cert: Path) -> str:
    result = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        timeout=OPENSSL_TIMEOUT_S,
        check=True,
    )
    return result.stdout


def projected_secrets(workload: dict[str, Any]) -> dict[str, str]:
    """tls-agents volume: file -> Secret."""
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls-agents"]
    return {
        item["path"]: source["secret"]["name"]
        for source in volume["projected"]["sources"]
        for item in source["secret"]["items"]
    }


@pytest.mark.parametrize("mode", MODES)
def test_agent_mtls_is_on_by_default_in_every_mode(helm: Helm, mode: str, tmp_path: Path) -> None:
    docs = mode_docs(helm, mode)
    config = parse_config(gate_config_text(docs))
    assert config.tls.agents.enabled and config.tls.agents.cert and config.tls.agents.key
    agents = by_kind(docs, "DaemonSet") or [one(docs, "Deployment", "-sim-long")]
    server, gate, queue = (f"rel-kvgate-{name}-tls" for name in ("agent", "gate-client", "queue-client"))
    for workload in agents:
        args = container(workload, "agent")["args"]
        assert "--tls-cert" in args and "--tls-client-ca" in args, "every RPC needs a client's certificate"
        assert projected_secrets(workload) == {"tls.crt": server, "tls.key": server, "ca.crt": gate}
    assert projected_secrets(one(docs, "Deployment", "-gate")) == {
        "tls.crt": gate,
        "tls.key": gate,
        "ca.crt": server,
    }
    queues = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-queue")]
    for workload in queues:
        # Its own certificate: the agent caps each holder, and the queue's jobs are not the gates'.
        assert projected_secrets(workload) == {"tls.crt": queue, "tls.key": queue, "ca.crt": server}

    # Two CAs: an agent's certificate never passes for a client, nor a client's for an agent.
    agent_dir, gate_dir, queue_dir = (secret_files(docs, name, tmp_path) for name in (server, gate, queue))
    assert "DNS:kvgate-agent" in sans(agent_dir / "tls.crt"), "the gate checks tls.agents.serverName"
    assert verifies(agent_dir / "ca.crt", agent_dir / "tls.crt", "sslserver")
    for client in (gate_dir, queue_dir):
        # The agents trust the CA in the gate's Secret; the queue's certificate comes from it too.
        assert verifies(gate_dir / "ca.crt", client / "tls.crt", "sslclient")
        assert not verifies(agent_dir / "ca.crt", client / "tls.crt", "sslserver")
    assert not verifies(gate_dir / "ca.crt", agent_dir / "tls.crt", "sslclient")
    assert "DNS:kvgate-gate" in sans(gate_dir / "tls.crt") and "DNS:kvgate-queue" in sans(
        queue_dir / "tls.crt"
    )


def test_cert_manager_issues_the_agents_certificates_when_an_issuer_is_given(helm: Helm) -> None:
    issuer = {"name": "kvgate-ca", "kind": "ClusterIssuer"}
    clients = {"name": "kvgate-clients-ca"}
    docs = helm.render(standalone(tls={"agents": {"issuerRef": issuer, "clientIssuerRef": clients}}))
    assert not by_kind(docs, "Secret"), "cert-manager writes them"
    certificates = {c["spec"]["secretName"]: c["spec"] for c in by_kind(docs, "Certificate")}
    for doc in by_kind(docs, "Certificate"):
        check_object(doc)
    server = certificates.pop("rel-kvgate-agent-tls")
    assert server["dnsNames"] == ["kvgate-agent"] and "server auth" in server["usages"]
    assert server["issuerRef"] == issuer | {"group": "cert-manager.io"}
    assert sorted(certificates) == ["rel-kvgate-gate-client-tls", "rel-kvgate-queue-client-tls"]
    for client in certificates.values():
        assert "client auth" in client["usages"]
        assert client["issuerRef"] == {
            "name": "kvgate-clients-ca",
            "kind": "Issuer",
            "group": "cert-manager.io",
        }


def test_secrets_of_your_own_make_no_certificates(helm: Helm) -> None:
    tls = {"agents": {"secretName": "mine", "clientSecretName": "mine-client"}}
    docs = helm.render(with_queue(standalone(tls=tls)))
    assert not by_kind(docs, "Secret") and not by_kind(docs, "Certificate")
    assert set(projected_secrets(one(docs, "DaemonSet")).values()) == {"mine", "mine-client"}
    assert set(projected_secrets(one(docs, "Deployment", "-queue")).values()) == {"mine", "mine-client"}
    tls["agents"]["queueClientSecretName"] = "mine-queue"
    docs = helm.render(with_queue(standalone(tls=tls)))
    assert set(projected_secrets(one(docs, "Deployment", "-queue")).values()) == {"mine", "mine-queue"}


# --- identity --------------------------------------------------------------------------------------------

JWT = {
    "method": "jwt",
    "jwt": {
        "issuer": "https://idp.example.com",
        "audiences": ["kvgate"],
        "jwks": {"remoteUri": "https://idp.example.com:8443/keys"},
    },
}
MTLS = {"method": "mtls", "mtls": {"secretName": "envoy-serving", "clientCaSecretName": "clients-ca"}}
# Stands for a JWKS the test makes (Envoy refuses a key set without a usable key).
OWN_KEYS = "the test's own JWKS"


@pytest.mark.parametrize("mode", ["standalone", "none"])
def test_a_queue_without_identity_is_refused(helm: Helm, mode: str) -> None:
    """Finding 1: without an identity every client is one tenant, and sees the others' files and jobs.
    With envoy.mode none, auth.method says how your own Envoy authenticates."""
    base = (
        standalone()
        if mode == "standalone"
        else {"envoy": {"mode": "none"}, "networkPolicy": OWN_ENVOY_PEERS}
    )
    values = base | {"queue": {"enabled": True}}
    with pytest.raises(HelmFailed, match=r"queue\.enabled needs an authentication method \(auth\.method"):
        helm.render(values)
    helm.render(values | {"queue": {"enabled": True, "unauthenticated": True}})
    for auth in (JWT, EXT_AUTHZ, MTLS):
        helm.render(values | {"auth": auth})


def bootstrap_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    bootstrap: dict[str, Any] = yaml.safe_load(one(docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"])
    return bootstrap


def manager_of(bootstrap: dict[str, Any]) -> dict[str, Any]:
    manager: dict[str, Any] = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return manager


def filters_of(manager: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f["typed_config"] for f in manager["http_filters"]}


def clusters_of(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def tenant_mutations(filters: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    mutations = filters["envoy.filters.http.header_mutation"]["mutations"]["request_mutations"]
    return [(m["append"]["header"]["value"], m["append"]["append_action"]) for m in mutations]


def test_standalone_jwt_sets_the_tenant_from_the_verified_claims(helm: Helm) -> None:
    bootstrap = bootstrap_of(helm.render(with_queue(standalone()) | {"auth": JWT}))
    manager = manager_of(bootstrap)
    names = [f["name"] for f in manager["http_filters"]]
    assert names[:4] == [
        "envoy.filters.http.jwt_authn",
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.decompressor",
        "envoy.filters.http.ext_proc",
    ], "authentication, then the anonymous default, before the gate"
    early = manager["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert [m["remove"] for m in early] == STRIPPED_HEADERS
    jwt = filters_of(manager)["envoy.filters.http.jwt_authn"]
    provider = jwt["providers"]["kvgate"]
    assert provider["issuer"] == "https://idp.example.com" and provider["audiences"] == ["kvgate"]
    assert provider["claim_to_headers"] == [
        {"header_name": "x-kvgate-tenant", "claim_name": "tenant"},
        {"header_name": "x-kvgate-priority", "claim_name": "kvgate_priority"},
    ]
    assert provider["forward"] is False, "the client's token goes no further than Envoy"
    assert jwt["rules"] == [{"match": {"prefix": "/"}, "requires": {"provider_name": "kvgate"}}]
    assert provider["remote_jwks"]["http_uri"]["cluster"] == "kvgate_jwks"
    jwks = clusters_of(bootstrap)["kvgate_jwks"]
    endpoint = jwks["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert endpoint["socket_address"] == {"address": "idp.example.com", "port_value": 8443}
    context = jwks["transport_socket"]["typed_config"]
    assert context["sni"] == "idp.example.com"
    validation = context["common_tls_context"]["validation_context"]
    assert validation["match_typed_subject_alt_names"][0]["matcher"] == {"exact": "idp.example.com"}
    assert tenant_mutations(filters_of(manager)) == [("anonymous", "ADD_IF_ABSENT")]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_standalone_ext_authz_lets_the_service_set_only_the_identity_headers(
    helm: Helm, protocol: str
) -> None:
    auth = {"method": "extAuthz", "extAuthz": {"address": "authz.sec", "port": 9191, "protocol": protocol}}
    bootstrap = bootstrap_of(helm.render(standalone(auth=auth)))
    filters = filters_of(manager_of(bootstrap))
    authz = filters["envoy.filters.http.ext_authz"]
    assert authz["failure_mode_allow"] is False, "the service down refuses, never admits unchecked"
    assert authz["status_on_error"] == {"code": "ServiceUnavailable"}
    if protocol == "grpc":
        assert authz["grpc_service"]["envoy_grpc"]["cluster_name"] == "kvgate_authz"
        rules = authz["decoder_header_mutation_rules"]
        assert rules == {
            "disallow_all": True,
            "allow_expression": {"regex": "^(x-kvgate-tenant|x-kvgate-priority)$"},
        }
    else:
        response = authz["http_service"]["authorization_response"]
        assert response["allowed_upstream_headers"]["patterns"] == [
            {"exact": "x-kvgate-tenant"},
            {"exact": "x-kvgate-priority"},
        ]
    address = clusters_of(bootstrap)["kvgate_authz"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"] == {"address": "authz.sec", "port_value": 9191}


def test_standalone_mtls_takes_the_tenant_from_the_client_certificate(helm: Helm) -> None:
    docs = helm.render(standalone(auth=MTLS))
    bootstrap = bootstrap_of(docs)
    chain = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]
    context = chain["transport_socket"]["typed_config"]
    assert context["require_client_certificate"] is True
    assert tenant_mutations(filters_of(manager_of(bootstrap))) == [
        ("%DOWNSTREAM_PEER_URI_SAN%", "OVERWRITE_IF_EXISTS_OR_ADD"),
        ("anonymous", "ADD_IF_ABSENT"),
    ]
    envoy = one(docs, "Deployment", "-envoy")
    (volume,) = [v for v in envoy["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls-clients"]
    sources = {
        s["secret"]["name"]: [i["key"] for i in s["secret"]["items"]] for s in volume["projected"]["sources"]
    }
    assert sources == {"envoy-serving": ["tls.crt", "tls.key"], "clients-ca": ["ca.crt"]}
    assert {"listener-certificate.yaml", "clients-ca.yaml"} <= set(one(docs, "ConfigMap", "-envoy")["data"])


def test_istio_jwt_sets_the_claims_and_refuses_requests_without_a_token(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "istio-values.yaml")
    (authn,) = by_kind(docs, "RequestAuthentication")
    (rule,) = authn["spec"]["jwtRules"]
    assert rule["outputClaimToHeaders"] == [
        {"header": "x-kvgate-tenant", "claim": "tenant"},
        {"header": "x-kvgate-priority", "claim": "kvgate_priority"},
    ]
    assert authn["spec"]["selector"]["matchLabels"] == {"istio": "ingressgateway"}
    (deny,) = by_kind(docs, "AuthorizationPolicy")
    assert deny["spec"]["action"] == "DENY"
    (denied,) = deny["spec"]["rules"]
    assert denied["from"] == [{"source": {"notRequestPrincipals": ["*"]}}]
    # Only the chart's hosts: another application on the same gateway keeps its own rules.
    assert denied["to"][0]["operation"]["hosts"] == [
        "llm.example.com",
        "llm.example.com:*",
        "strict.example.com",
        "strict.example.com:*",
    ]
    optional = helm.render({"auth": {"jwt": {"allowMissing": True}}}, CHART / "ci" / "istio-values.yaml")
    assert not by_kind(optional, "AuthorizationPolicy"), "a missing token is the anonymous tenant"
    patches = one(docs, "EnvoyFilter")["spec"]["configPatches"]
    (early,) = [p for p in patches if p["applyTo"] == "NETWORK_FILTER"]
    mutation = early["patch"]["value"]["typed_config"]["early_header_mutation_extensions"][0]
    assert [m["remove"] for m in mutation["typed_config"]["mutations"]] == STRIPPED_HEADERS


def test_istio_ext_authz_and_mtls(helm: Helm) -> None:
    istio = CHART / "ci" / "istio-values.yaml"
    docs = helm.render({"auth": {"method": "extAuthz", "extAuthz": {"istioProvider": "kvgate-authz"}}}, istio)
    (custom,) = by_kind(docs, "AuthorizationPolicy")
    assert custom["spec"]["action"] == "CUSTOM" and custom["spec"]["provider"] == {"name": "kvgate-authz"}
    assert not by_kind(docs, "RequestAuthentication")
    with pytest.raises(HelmFailed, match=r"auth\.extAuthz\.istioProvider is required"):
        helm.render({"auth": {"method": "extAuthz"}}, istio)
    docs = helm.render({"auth": {"method": "mtls"}}, istio)
    assert not by_kind(docs, "AuthorizationPolicy") and not by_kind(docs, "RequestAuthentication")
    identity = [
        p["patch"]["value"]
        for p in one(docs, "EnvoyFilter")["spec"]["configPatches"]
        if p["applyTo"] == "HTTP_FILTER"
        and p["patch"]["value"]["name"] == "envoy.filters.http.header_mutation"
    ]
    assert tenant_mutations(filters_of({"http_filters": identity}))[0] == (
        "%DOWNSTREAM_PEER_URI_SAN%",
        "OVERWRITE_IF_EXISTS_OR_ADD",
    )


def test_envoy_gateway_security_policy(helm: Helm) -> None:
    eg = CHART / "ci" / "envoy-gateway-values.yaml"
    (policy,) = by_kind(helm.template(eg), "SecurityPolicy")
    check_object(policy)
    (provider,) = policy["spec"]["jwt"]["providers"]
    assert policy["spec"]["jwt"]["optional"] is False
    assert provider["claimToHeaders"] == [
        {"header": "x-kvgate-tenant", "claim": "tenant"},
        {"header": "x-kvgate-priority", "claim": "kvgate_priority"},
    ]
    assert provider["remoteJWKS"]["uri"] == "https://idp.example.com/.well-known/jwks.json"
    authz = {"method": "extAuthz", "extAuthz": {"address": "authz.security", "protocol": "http"}}
    (policy,) = by_kind(helm.render({"auth": authz}, eg), "SecurityPolicy")
    ext = policy["spec"]["extAuth"]
    assert ext["failOpen"] is False
    assert ext["http"]["backendRefs"] == [{"name": "authz", "namespace": "security", "port": 9001}]
    assert ext["http"]["headersToBackend"] == ["x-kvgate-tenant", "x-kvgate-priority"]
    docs = helm.render({"auth": {"method": "mtls", "mtls": {"clientCaSecretName": "clients-ca"}}}, eg)
    traffic = one(docs, "ClientTrafficPolicy")
    assert traffic["spec"]["tls"]["clientValidation"]["caCertificateRefs"] == [
        {"group": "", "kind": "Secret", "name": "clients-ca"}
    ]
    (patch,) = one(docs, "EnvoyPatchPolicy", "-identity")["spec"]["jsonPatches"]
    assert patch["operation"]["path"] == "/0"
    assert patch["operation"]["value"]["name"] == "envoy.filters.http.header_mutation"
    assert not by_kind(docs, "SecurityPolicy")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"auth": {"method": "jwt", "jwt": {"issuer": "i"}}}, r"exactly one of auth\.jwt\.jwks\.remoteUri"),
        (
            {"auth": {"method": "jwt", "jwt": {"jwks": {"inline": "{}"}}}},
            r"auth\.jwt\.issuer is required with auth\.method jwt",
        ),
        (
            {"auth": {"method": "jwt", "jwt": {"issuer": "i", "jwks": {"remoteUri": "http://idp/keys"}}}},
            r"at '/auth/jwt/jwks/remoteUri': '[^']+' does not match pattern",
        ),
        ({"auth": {"method": "extAuthz"}}, r"auth\.extAuthz\.address is required with auth\.method extAuthz"),
        ({"auth": {"method": "mtls"}}, r"auth\.mtls\.secretName is required with auth\.method mtls"),
        ({"auth": {"method": "oauth"}}, r"at '/auth/method': value must be one of"),
        (
            {"envoy": {"standalone": {"resources": {"limits": {"memory": "8Gi"}}}}},
            r"envoy\.gateCircuitBreaker\.maxRequests \(100000\) must exceed the requests Envoy's heap",
        ),
        (
            {"envoy": {"requestTimeoutSeconds": 5}},
            r"envoy\.requestTimeoutSeconds \(5\) must exceed envoy\.messageTimeoutMs",
        ),
    ],
    ids=[
        "jwt-without-keys",
        "jwt-without-issuer",
        "jwks-over-http",
        "authz-without-address",
        "mtls-without-certificate",
        "unknown-method",
        "breaker-below-what-the-heap-holds",
        "request-timeout-below-message-timeout",
    ],
)
def test_bad_identity_and_bound_values_fail_naming_the_value(
    helm: Helm, values: dict[str, Any], message: str
) -> None:
    merged = standalone() | {key: value for key, value in values.items() if key != "envoy"}
    merged["envoy"] |= values.get("envoy", {})
    with pytest.raises(HelmFailed, match=message):
        helm.render(merged)


@pytest.mark.parametrize(
    "auth",
    [
        JWT,
        {"method": "jwt", "jwt": {"issuer": "i", "allowMissing": True, "jwks": {"inline": OWN_KEYS}}},
        EXT_AUTHZ,
        {"method": "extAuthz", "extAuthz": {"address": "authz", "protocol": "http"}},
    ],
    ids=["jwt-remote", "jwt-inline-optional", "ext-authz-grpc", "ext-authz-http"],
)
def test_identity_bootstraps_pass_envoy_validate(helm: Helm, auth: dict[str, Any], tmp_path: Path) -> None:
    if auth["method"] == "jwt" and auth["jwt"]["jwks"].get("inline") == OWN_KEYS:
        auth = auth | {"jwt": auth["jwt"] | {"jwks": {"inline": Signer.create(tmp_path).jwks()}}}
    envoy_validate(bootstrap_of(helm.render(with_queue(standalone()) | {"auth": auth})), tmp_path)


# --- Envoy's bounds --------------------------------------------------------------------------------------


def test_standalone_envoy_is_bounded(helm: Helm) -> None:
    bootstrap = bootstrap_of(helm.render(standalone()))
    (thresholds,) = clusters_of(bootstrap)["kvgate_gate"]["circuit_breakers"]["thresholds"]
    assert {
        k: thresholds[k] for k in ("max_connections", "max_pending_requests", "max_requests")
    } == dict.fromkeys(("max_connections", "max_pending_requests", "max_requests"), 100000), (
        "past Envoy's default 1,024 streams every request would skip the gate"
    )
    manager = manager_of(bootstrap)
    assert manager["request_headers_timeout"] == "10s" and manager["request_timeout"] == "60s"
    assert manager["strip_trailing_host_dot"] is True and manager["strip_any_host_port"] is True
    monitors = {m["name"]: m["typed_config"] for m in bootstrap["overload_manager"]["resource_monitors"]}
    assert (
        monitors["envoy.resource_monitors.global_downstream_max_connections"][
            "max_active_downstream_connections"
        ]
        == 50000
    )
    assert monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"] == int(2 * 1024**3 * 0.8)
    actions = {
        a["name"]: a["triggers"][0]["threshold"]["value"] for a in bootstrap["overload_manager"]["actions"]
    }
    assert actions == {
        "envoy.overload_actions.shrink_heap": 0.95,
        "envoy.overload_actions.stop_accepting_requests": 0.98,
    }
    ready = bootstrap["static_resources"]["listeners"][1]
    assert ready["ignore_global_conn_limit"] is True, "the liveness probe still connects under a flood"

    values = standalone(
        envoy={
            "gateCircuitBreaker": {"maxRequests": 20000},
            "requestTimeoutSeconds": 0,
            "standalone": {
                "overload": {"maxHeapBytes": 123456789},
                "resources": {"limits": {"memory": "512Mi"}},
            },
        }
    )
    bootstrap = bootstrap_of(helm.render(values))
    assert clusters_of(bootstrap)["kvgate_gate"]["circuit_breakers"]["thresholds"][0]["max_requests"] == 20000
    assert "request_timeout" not in manager_of(bootstrap)
    monitors = {m["name"]: m["typed_config"] for m in bootstrap["overload_manager"]["resource_monitors"]}
    assert monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"] == 123456789
    values["envoy"]["standalone"]["overload"] = {}
    monitors = {
        m["name"]: m["typed_config"]
        for m in bootstrap_of(helm.render(values))["overload_manager"]["resource_monitors"]
    }
    assert monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"] == int(512 * 1024**2 * 0.8)


def test_mesh_gateways_are_bounded(helm: Helm) -> None:
    istio = helm.template(CHART / "ci" / "istio-values.yaml")
    (rule,) = by_kind(istio, "DestinationRule")
    assert rule["spec"]["host"] == "rel-kvgate-gate.llm.svc.cluster.local" and rule["spec"]["exportTo"] == [
        "."
    ]
    assert rule["spec"]["trafficPolicy"]["connectionPool"] == {
        "tcp": {"maxConnections": 100000},
        "http": {"http1MaxPendingRequests": 100000, "http2MaxRequests": 100000},
    }
    (early,) = [
        p for p in one(istio, "EnvoyFilter")["spec"]["configPatches"] if p["applyTo"] == "NETWORK_FILTER"
    ]
    manager = early["patch"]["value"]["typed_config"]
    assert manager["request_headers_timeout"] == "10s" and manager["request_timeout"] == "60s"
    assert manager["strip_trailing_host_dot"] is True and manager["strip_any_host_port"] is True

    eg = helm.template(CHART / "ci" / "envoy-gateway-values.yaml")
    (ext_proc,) = one(eg, "EnvoyExtensionPolicy")["spec"]["extProc"]
    assert ext_proc["backendSettings"]["circuitBreaker"] == {
        "maxConnections": 100000,
        "maxPendingRequests": 100000,
        "maxParallelRequests": 100000,
    }
    traffic = one(eg, "ClientTrafficPolicy")["spec"]
    assert traffic["timeout"]["http"] == {
        "requestHeadersReceivedTimeout": "10s",
        "requestReceivedTimeout": "60s",
    }
    assert traffic["headers"]["host"] == {"stripTrailingHostDot": True}


def test_policy_hosts_match_any_port(helm: Helm) -> None:
    """The HCM strips the port (and a trailing dot) before matching, so the hosts alone are listed,
    as `kvgate envoy-config` lists them."""
    policies = [
        {"name": "strict", "hosts": ["strict.local", "*.tenants.example.com"], "maxTotalTokens": 2000}
    ]
    manager = manager_of(bootstrap_of(helm.render(standalone(envoy={"routePolicies": policies}))))
    assert manager["strip_any_host_port"] is True and manager["strip_trailing_host_dot"] is True
    (strict,) = [v for v in manager["route_config"]["virtual_hosts"] if v["name"] == "policy-strict"]
    assert strict["domains"] == ["*.tenants.example.com", "strict.local"]


# --- alerts ----------------------------------------------------------------------------------------------


def test_monitoring_alerts_when_requests_skip_the_gate(helm: Helm) -> None:
    docs = helm.render(standalone(metrics={"serviceMonitor": {"enabled": True}}))
    (rule,) = by_kind(docs, "PrometheusRule")
    check_object(rule)
    (alert,) = rule["spec"]["groups"][0]["rules"]
    assert "envoy_http_ext_proc_failure_mode_allowed" in alert["expr"] and "increase(" in alert["expr"]
    (monitor,) = by_kind(docs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == pod_labels(one(docs, "Deployment", "-envoy"))
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "ready", "path": "/stats/prometheus", "interval": "15s"}
    ]
    bootstrap = bootstrap_of(docs)
    (stats,) = bootstrap["static_resources"]["listeners"][1]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["route_config"]["virtual_hosts"]
    assert stats["routes"] == [{"match": {"path": "/stats/prometheus"}, "route": {"cluster": "kvgate_admin"}}]
    quiet = helm.render(standalone())
    assert not by_kind(quiet, "PrometheusRule") and not by_kind(quiet, "PodMonitor")
    assert "kvgate_admin" not in clusters_of(bootstrap_of(quiet))


# --- secrets ---------------------------------------------------------------------------------------------


def test_the_store_url_is_on_no_command_line(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "queue-postgresql-values.yaml")
    for workload in [*by_kind(docs, "Deployment"), *by_kind(docs, "DaemonSet")]:
        for spec in workload["spec"]["template"]["spec"]["containers"]:
            assert not [arg for arg in spec.get("args", []) if "STORE" in arg or "postgresql://" in arg]
    (store,) = [
        e
        for e in container(one(docs, "Deployment", "-queue"), "queue")["env"]
        if e["name"] == "KVGATE_QUEUE_STORE"
    ]
    assert store == {
        "name": "KVGATE_QUEUE_STORE",
        "valueFrom": {"secretKeyRef": {"name": "kvgate-queue-db", "key": "url"}},
    }


# --- the engine endpoints the gate takes from agents ----------------------------------------------------


def test_gpu_agents_engines_on_the_nodes_addresses_are_taken_on_their_port_only(helm: Helm) -> None:
    """Without hostNetwork an agent answers from its pod's address and reports its engine on the node's:
    the gate takes that from agent.allowedEndpoints, on the pool's engine port only."""
    config = parse_config(gate_config_text(helm.render(standalone())))
    rule = config.headroom.endpoint_rule()
    pod, node = frozenset({ip_address("10.244.3.7")}), ip_address("10.0.12.5")
    assert rule.problem("10.0.12.5", 8000, frozenset({node}), pod) == ""
    assert "endpoint_ports" in rule.problem("10.0.12.5", 19901, frozenset({node}), pod)
    public = ip_address("203.0.113.9")
    assert "allowed_endpoints" in rule.problem("203.0.113.9", 8000, frozenset({public}), pod)
    narrowed = helm.render(standalone(agent={"allowedEndpoints": ["10.0.0.0/16"], "engine": {"port": 8080}}))
    rule = parse_config(gate_config_text(narrowed)).headroom.endpoint_rule()
    assert rule.problem("10.0.12.5", 8080, frozenset({node}), pod) == ""
    assert "allowed_endpoints" in rule.problem("10.1.0.5", 8080, frozenset({ip_address("10.1.0.5")}), pod)
    named = helm.render(standalone(agent={"engine": {"host": "vllm.models.svc.cluster.local"}}))
    rule = parse_config(gate_config_text(named)).headroom.endpoint_rule()
    assert rule.problem("vllm.models.svc.cluster.local", 8000, frozenset({public}), pod) == ""
