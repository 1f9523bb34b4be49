"""The chart as an InferencePool's endpoint picker (inferencePool.enabled): the pool and its HTTPRoute
pass the InferencePool v1 API's validation, name the gate's Service, and the gate speaks the protocol;
values that cannot work fail the render naming the value."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from test_chart import (
    CHART,
    Helm,
    HelmFailed,
    check_inference_pool,
    check_object,
    gate_config_text,
    one,
    real_helm,
)

from kvgate.config import parse_config

VALUES = CHART / "ci" / "inferencepool-values.yaml"


@pytest.fixture(scope="module")
def helm() -> Helm:
    return real_helm()


def values(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = yaml.safe_load(VALUES.read_text())
    for dotted, value in changes.items():
        node = base
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return base


def test_the_pool_names_the_gate_as_its_picker_and_the_route_sends_everything_to_the_pool(helm: Helm) -> None:
    docs = helm.template(VALUES)
    for doc in docs:
        check_object(doc)
    pool = one(docs, "InferencePool")
    gate = one(docs, "Service", "-gate")
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["kind"], picker["name"]) == ("Service", gate["metadata"]["name"])
    assert picker["port"]["number"] in {p["port"] for p in gate["spec"]["ports"]}
    assert picker["failureMode"] == "FailClose"
    route = one(docs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    config = parse_config(gate_config_text(docs))
    assert config.server.protocol == "endpoint-picker", "the gate speaks the Endpoint Picker Protocol"
    assert config.server.picker_endpoints == 3, "a fallback list for an Envoy-based gateway"
    assert not any(doc["kind"] in ("EnvoyFilter", "EnvoyExtensionPolicy") for doc in docs), "no mesh of ours"


@pytest.mark.parametrize(
    ("spec_change", "why"),
    [
        (lambda s: s["selector"].update(matchLabels={}), "an empty selector"),
        (lambda s: s.update(targetPorts=[{"number": 8000}] * 2), "a repeated port"),
        (lambda s: s.update(targetPorts=[{"number": 70000}]), "a port out of range"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Maybe"), "an unknown failure mode"),
        (lambda s: s["endpointPickerRef"].pop("port"), "a Service picker without a port"),
        (lambda s: s.update(extra=1), "a field the API does not have"),
    ],
)
def test_the_schema_check_is_real(helm: Helm, spec_change: Any, why: str) -> None:
    pool = one(helm.template(VALUES), "InferencePool")
    broken = copy.deepcopy(pool["spec"])
    spec_change(broken)
    with pytest.raises((AssertionError, KeyError)):
        check_inference_pool(broken)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {
                "envoy__mode": "istio",
                "envoy__pools": {"interactive": {"address": "a"}, "long": {"address": "b"}},
            },
            "inferencePool.enabled needs envoy.mode none",
        ),
        ({"inferencePool__selector": {}}, "inferencePool.selector is required"),
        ({"inferencePool__gateway": {"name": ""}}, "inferencePool.gateway.name is required"),
        ({"agent__pools": {"interactive": {"enabled": False}}}, "both agent.pools"),
        ({"inferencePool__failureMode": "Sometimes"}, "failureMode"),
        ({"inferencePool__targetPorts": []}, "targetPorts"),
        ({"inferencePool__pickerEndpoints": 0}, "pickerEndpoints"),
    ],
)
def test_values_that_cannot_work_fail_naming_the_value(
    helm: Helm, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(HelmFailed, match=message):
        helm.render(values(**changes))


def test_one_endpoint_a_request_for_a_gateway_that_takes_one(helm: Helm) -> None:
    docs = helm.render(values(inferencePool__pickerEndpoints=1))
    assert parse_config(gate_config_text(docs)).server.picker_endpoints == 1


def test_without_the_pool_nothing_of_it_renders(helm: Helm) -> None:
    docs = helm.render(values(inferencePool__enabled=False))
    assert not [d for d in docs if d["kind"] in ("InferencePool", "HTTPRoute")]
    assert parse_config(gate_config_text(docs)).server.protocol == "kvgate"
