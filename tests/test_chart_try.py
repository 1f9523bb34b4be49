"""Trying the chart without GPUs (simulator.enabled, examples/try.yaml), and the image it runs.

The simulated nodes replace the pools and the agent DaemonSets in every Envoy mode; the normal install
still asks for real pool addresses (test_chart.py). tests/test_image.py runs these pods for real.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart import CHART, Helm, HelmFailed, by_kind, check_object, container, one, real_helm

from kvgate.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
TRY_VALUES = CHART / "examples" / "try.yaml"
MODES = ("standalone", "istio", "envoy-gateway")


@pytest.fixture(scope="session")
def helm() -> Helm:
    return real_helm()


def simulated(mode: str, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"simulator": {"enabled": True}, "envoy": {"mode": mode}}
    return values | overrides


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = doc["spec"]["template"]["metadata"]["labels"]
    return labels


def test_try_example_lints_and_renders_valid_objects(helm: Helm) -> None:
    output = helm.run("lint", "--strict", str(CHART), "-f", str(TRY_VALUES))
    assert "0 chart(s) failed" in output
    docs = helm.template(TRY_VALUES)
    for doc in docs:
        check_object(doc)
    assert not by_kind(docs, "DaemonSet"), "no GPU node to run on"
    assert sorted(d["metadata"]["name"] for d in by_kind(docs, "Deployment")) == [
        "rel-kvgate-envoy",
        "rel-kvgate-gate",
        "rel-kvgate-sim-interactive",
        "rel-kvgate-sim-long",
    ]
    # An agent beside each simulated node, feeding the gate's two sections.
    for pool in ("interactive", "long"):
        assert [
            c["name"]
            for c in one(docs, "Deployment", f"-sim-{pool}")["spec"]["template"]["spec"]["containers"]
        ] == [
            "sim",
            "agent",
        ]
    config = parse_config(one(docs, "ConfigMap", "-gate")["data"]["kvgate.yaml"])
    assert config.headroom.dns == "rel-kvgate-agent-long.llm.svc.cluster.local:9100"
    assert config.interactive_headroom.dns == "rel-kvgate-agent-interactive.llm.svc.cluster.local:9100"
    assert config.server.workers == 1


@pytest.mark.parametrize("mode", MODES)
def test_simulated_pools_need_no_addresses_in_any_mode(helm: Helm, mode: str) -> None:
    docs = helm.render(simulated(mode))
    for doc in docs:
        check_object(doc)
    services = {
        pool: one(docs, "Service", f"-sim-{pool}")["metadata"]["name"] for pool in ("interactive", "long")
    }
    if mode == "standalone":
        bootstrap = yaml.safe_load(one(docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"])
        clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
        for pool, service in services.items():
            endpoint = clusters[f"pool_{pool}"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
            assert endpoint["endpoint"]["address"]["socket_address"] == {
                "address": f"{service}.llm.svc.cluster.local",
                "port_value": 8000,
            }
    elif mode == "istio":
        routes = one(docs, "VirtualService")["spec"]["http"]
        hosts = [route["route"][0]["destination"]["host"] for route in routes]
        assert hosts == [
            f"{services['long']}.llm.svc.cluster.local",
            f"{services['interactive']}.llm.svc.cluster.local",
        ]
    else:
        # The rules that route (the fail-open rule answers itself: test_failopen).
        rules = [rule for rule in one(docs, "HTTPRoute")["spec"]["rules"] if "backendRefs" in rule]
        assert [rule["backendRefs"][0] for rule in rules] == [
            {"name": services["long"], "namespace": "llm", "port": 8000},
            {"name": services["interactive"], "namespace": "llm", "port": 8000},
            {"name": services["interactive"], "namespace": "llm", "port": 8000},
        ]
        # The HTTPRoute lives in the Gateway's namespace: a grant lets it reach the simulators.
        (grant,) = [
            g for g in by_kind(docs, "ReferenceGrant") if g["metadata"]["name"].endswith("-sim-pools")
        ]
        assert grant["spec"]["from"] == [
            {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "default"}
        ]
        assert {ref["name"] for ref in grant["spec"]["to"]} == set(services.values())


def test_each_agent_service_selects_the_simulated_nodes_of_its_pool(helm: Helm) -> None:
    docs = helm.template(TRY_VALUES)
    for pool in ("interactive", "long"):
        selector = one(docs, "Service", f"-agent-{pool}")["spec"]["selector"]
        sims = one(docs, "Deployment", f"-sim-{pool}")
        assert selector.items() <= pod_labels(sims).items()
        other = "long" if pool == "interactive" else "interactive"
        assert not selector.items() <= pod_labels(one(docs, "Deployment", f"-sim-{other}")).items()
        assert one(docs, "Service", f"-sim-{pool}")["spec"]["selector"] == selector


def test_simulated_node_and_its_agent(helm: Helm) -> None:
    sims = one(helm.template(TRY_VALUES), "Deployment", "-sim-long")
    pod = sims["spec"]["template"]["spec"]
    assert sims["spec"]["replicas"] == 2
    assert "runtimeClassName" not in pod and "nodeSelector" not in pod, "any node will do"
    sim = container(sims, "sim")
    assert sim["args"][:3] == ["sim", "--listen", "0.0.0.0:8000"]
    assert sim["args"][sim["args"].index("--kv-capacity-tokens") + 1] == "40000"
    assert sim["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    agent = container(sims, "agent")
    args = agent["args"]
    # The sim in its own pod; requests pinned to the pod's address; named after the pod; fake GPUs.
    assert args[args.index("--engine-metrics") + 1] == "http://127.0.0.1:8000/metrics"
    assert args[args.index("--endpoint") + 1] == "$(POD_IP):8000"
    assert args[args.index("--node-name") + 1] == "$(POD_NAME)"
    assert args[args.index("--nvml") + 1] == "fake"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"] if "valueFrom" in e}
    assert env == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    for spec in (sim, agent):
        assert spec["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_simulator_alone_gives_the_long_pool_its_agents(helm: Helm) -> None:
    """simulator.enabled keeps agent.pools' meaning: by default only the long pool has agents."""
    docs = helm.template(CHART / "ci" / "simulator-values.yaml")
    containers = {
        pool: [
            c["name"]
            for c in one(docs, "Deployment", f"-sim-{pool}")["spec"]["template"]["spec"]["containers"]
        ]
        for pool in ("interactive", "long")
    }
    assert containers == {"interactive": ["sim"], "long": ["sim", "agent"]}
    assert not [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-agent-interactive")]


def test_simulator_refuses_a_pool_address(helm: Helm) -> None:
    values = simulated("standalone")
    values["envoy"]["pools"] = {"long": {"address": "vllm-long.models.svc.cluster.local", "port": 8000}}
    with pytest.raises(
        HelmFailed, match=r"envoy\.pools\.long\.address must stay empty with simulator\.enabled"
    ):
        helm.render(values)


def test_notes_say_how_to_try_it(helm: Helm) -> None:
    output = helm.run("install", "kvgate", str(CHART), "-f", str(TRY_VALUES), "--dry-run=client", "-n", "llm")
    notes = output[output.index("NOTES:") :]
    assert "kubectl -n llm port-forward svc/kvgate-envoy 8080:80" in notes
    assert '"model":"sim-model"' in notes
    assert "x-kvgate-pool" in notes
    assert (
        "Simulated long pool: Deployment and Service kvgate-sim-long (2 x `kvgate sim`, an agent beside each)"
        in notes
    )


# --- the image the chart runs ------------------------------------------------------------------------------


def pyproject_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as file:
        version: str = tomllib.load(file)["project"]["version"]
    return version


def test_image_reference_is_the_published_tag(helm: Helm) -> None:
    """The chart runs the tag the release workflow pushes: the repository it publishes to, and the
    version that is pyproject.toml's and the chart's appVersion."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "image.yml").read_text())
    version = pyproject_version()
    assert chart["appVersion"] == version
    assert workflow["env"]["IMAGE_REPOSITORY"] == values["image"]["repository"] == "ghcr.io/kvgate/kvgate"
    docs = helm.template(TRY_VALUES)
    images = {
        spec["image"]
        for doc in docs
        if doc["kind"] == "Deployment" and not doc["metadata"]["name"].endswith("-envoy")
        for spec in doc["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"ghcr.io/kvgate/kvgate:{version}"}


def test_dockerfile_exposes_the_chart_ports_and_runs_as_its_user(helm: Helm) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    (exposed,) = re.findall(r"^EXPOSE (.+)$", dockerfile, re.MULTILINE)
    docs = helm.template(TRY_VALUES)
    ports = {
        port["containerPort"]
        for doc in docs
        if doc["kind"] == "Deployment" and not doc["metadata"]["name"].endswith("-envoy")
        for spec in doc["spec"]["template"]["spec"]["containers"]
        for port in spec["ports"]
    }
    assert {int(port) for port in exposed.split()} == ports
    security = one(docs, "Deployment", "-gate")["spec"]["template"]["spec"]["securityContext"]
    assert re.search(rf"^USER {security['runAsUser']}:{security['runAsGroup']}$", dockerfile, re.MULTILINE)
    assert re.search(r'^ENTRYPOINT \["kvgate"\]$', dockerfile, re.MULTILINE)
