"""The chart's Grafana dashboard: a well-formed dashboard, shipped as a sidecar ConfigMap by the real
helm when `dashboards.enabled`, whose every PromQL metric a real running gate or queue exports, and on
which every metric family they export has a panel."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_chart import CHART, Helm, by_kind, real_helm, standalone

from kvgate.config.headroom import HeadroomSettings
from kvgate.harness.client import chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service, kvgate_command
from kvgate.harness.stack import agent_process, envoy_process, gate_process, started
from kvgate.harness.upstreams import Upstreams
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
ENVOY_YAML = ROOT / "envoy" / "envoy.yaml"

DASHBOARD = CHART / "dashboards" / "kvgate.json"
# Metric names in PromQL: identifiers that are not functions, keywords or label names.
METRIC = re.compile(r"\b((?:kvgate|process)_[a-z0-9_]+)\b")
# A panel shows what the issue asks for: each of these families appears in some expression.
REQUIRED_FAMILIES = (
    "kvgate_gate_decisions_total",
    "kvgate_gate_decision_duration_seconds_bucket",
    "kvgate_gate_estimated_tokens_bucket",
    "kvgate_gate_reservations_total",
    "kvgate_gate_admission_waiting",
    "kvgate_pool_water_level",
    "kvgate_pool_breaker_state",
    "kvgate_node_headroom",
    "kvgate_node_age_seconds",
    "kvgate_node_fresh",
    "kvgate_gate_route_policy_ignored_total",
    "kvgate_queue_jobs",
    "kvgate_queue_oldest_job_age_seconds",
    "kvgate_queue_tokens_waiting",
    "kvgate_queue_dispatch_wait_seconds_bucket",
    "kvgate_queue_admissions_total",
    "kvgate_queue_attempts_total",
    "kvgate_queue_running",
)
AGENT_CAPACITY_TOKENS = 100_000


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def expressions(board: dict[str, Any]) -> list[str]:
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def used_metrics(board: dict[str, Any]) -> set[str]:
    return {name for expr in expressions(board) for name in METRIC.findall(expr)}


def test_dashboard_is_a_grafana_dashboard() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert METRIC.search(target["expr"]), f"{panel['title']}: {target['expr']} names no metric"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert set(REQUIRED_FAMILIES) <= used_metrics(board)


def test_no_panel_overlaps_another() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[x, y]}"
                cells[x, y] = panel["title"]


@pytest.fixture(scope="module")
def helm() -> Helm:
    return real_helm()


def dashboard_configmaps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [doc for doc in by_kind(docs, "ConfigMap") if doc["metadata"]["name"].endswith("-dashboard")]


@pytest.mark.slow
def test_no_dashboard_configmap_by_default(helm: Helm) -> None:
    assert dashboard_configmaps(helm.render(standalone())) == []


@pytest.mark.slow
def test_dashboard_configmap_carries_the_sidecar_label_and_the_json(helm: Helm) -> None:
    values = standalone(dashboards={"enabled": True, "annotations": {"grafana_folder": "LLM"}})
    (configmap,) = dashboard_configmaps(helm.render(values))
    kubernetes_validate.validate(configmap, kubernetes_validate.latest_version(), strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert configmap["metadata"]["namespace"] == "llm"
    assert json.loads(configmap["data"]["kvgate.json"]) == dashboard()


@pytest.mark.slow
def test_dashboard_namespace_and_labels_are_configurable(helm: Helm) -> None:
    values = standalone(
        dashboards={"enabled": True, "namespace": "monitoring", "labels": {"dashboards": "kvgate"}}
    )
    (configmap,) = dashboard_configmaps(helm.render(values))
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["dashboards"] == "kvgate"


@pytest.mark.slow
def test_schema_rejects_an_unknown_dashboards_key(helm: Helm) -> None:
    with pytest.raises(Exception, match="enable"):
        helm.render(standalone(dashboards={"enable": True}))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def with_bad_route_value(envoy_yaml: Path) -> Path:
    """envoy/envoy.yaml's strict.local virtual host with one value the gate cannot read, so the gate
    counts it (kvgate_gate_route_policy_ignored_total) and keeps the model's policy for that key."""
    config = yaml.safe_load(envoy_yaml.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (strict,) = [host for host in manager["route_config"]["virtual_hosts"] if host["name"] == "strict"]
    metadata = strict["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
        "grpc_initial_metadata"
    ]
    metadata.append({"key": "x-kvgate-interactive-max-tokens", "value": "lots"})
    envoy_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
    return envoy_yaml


@pytest.fixture(scope="module")
def gate_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The /metrics text of a real gate with a real agent on both pools, after a short and a long request
    went through the real Envoy, and one to a host whose route policy holds a bad value (so every
    counter, histogram and gauge has a sample)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    ports = {name: free_port() for name in ("listener", "gate", "interactive", "long", "async", "admin")}
    upstreams = Upstreams({pool: ports[pool] for pool in ("interactive", "long", "async")})
    upstreams.start()
    agent_port = free_port()
    agent = agent_process(
        tmp,
        "agent",
        agent_port,
        f"127.0.0.1:{ports['long']}",
        ["--capacity-tokens", str(AGENT_CAPACITY_TOKENS)],
    )
    envoy = envoy_process(
        with_bad_route_value(render_envoy(ENVOY_YAML, tmp / "envoy.yaml", ports)),
        tmp,
        ports["admin"],
        ports["listener"],
    )
    agents = f"{{agents: ['127.0.0.1:{agent_port}']}}"
    # Prefix-aware placement on, and a long prompt: the placement metrics get samples too.
    # One agent stands for both pools' nodes, so long requests do not borrow (soft_pools).
    config = f"headroom: {agents}\ninteractive_headroom: {agents}\nplacement: {{prefix_affinity: true}}\n"
    config += "soft_pools: {borrow: false}\n"
    # Fair shares on: the per-tenant gauges have samples once a long request was charged.
    config += "fairness: {enabled: true}\n"
    # No waiting for room: the capacity refusal below answers at once, with its Retry-After.
    config += "admission: {max_wait_s: 0}\n"
    try:
        with gate_process(config, tmp, ports["gate"]) as gate:
            deadline = time.monotonic() + 10
            while True:
                long_reply = post(
                    ports["listener"], "/v1/chat/completions", chat("lorem ipsum " * 1000, max_tokens=8000)
                )
                if long_reply.status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)  # the gate's first headroom message is still on its way
            assert long_reply.status == 200, long_reply.body
            assert post(ports["listener"], "/v1/chat/completions", chat("hello")).status == 200
            strict = post(ports["listener"], "/v1/chat/completions", chat("hello"), {"host": "strict.local"})
            assert strict.status == 200, strict.body
            # A long request that finds no room (the rest is held by a reservation of the test's own):
            # a 429 with Retry-After, checked once the reservation is released and its tokens free.
            agent_address = f"127.0.0.1:{agent_port}"
            asyncio.run(_reserve(agent_address, "filler", 85_000))
            full = post(
                ports["listener"], "/v1/chat/completions", chat("lorem ipsum " * 1000, max_tokens=8000)
            )
            assert full.status == 429, full.body
            asyncio.run(_reserve(agent_address, "filler", 0, release=True))
            _until(
                "a checked Retry-After",
                lambda: "kvgate_gate_retry_after_error_seconds_bucket" in scrape(gate.metrics_port),
            )
            yield scrape(gate.metrics_port)
    finally:
        envoy.stop()
        agent.stop()
        upstreams.stop()


def _until(what: str, check: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.2)


async def _reserve(agent: str, reservation: str, tokens: int, release: bool = False) -> None:
    view = HeadroomView(HeadroomSettings(agents=(agent,)))
    await view.start()
    try:
        if release:
            await view.release(agent, reservation)
        else:
            assert (await view.reserve(agent, reservation, tokens, lease_s=600)).granted
    finally:
        await view.stop()


@pytest.fixture(scope="module")
def queue_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The /metrics text of a real `kvgate queue`, scraped while a deferred job waits for room (a
    reservation the test holds fills the node) and again once it ran: together every family has a sample."""
    tmp = tmp_path_factory.mktemp("dashboard-queue")
    node_port, agent_port, queue_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    upstreams = Upstreams({"long": node_port})
    upstreams.start()
    agent = agent_process(
        tmp, "agent", agent_port, f"127.0.0.1:{node_port}", ["--capacity-tokens", str(AGENT_CAPACITY_TOKENS)]
    )
    (tmp / "queue.yaml").write_text(f"headroom: {{agents: ['127.0.0.1:{agent_port}']}}\n")
    queue = started(
        Service(
            "queue",
            kvgate_command(
                "queue",
                *("--listen", f"127.0.0.1:{queue_port}", "--config", str(tmp / "queue.yaml")),
                *(
                    "--store",
                    f"sqlite:///{tmp / 'queue.db'}",
                    "--metrics-listen",
                    f"127.0.0.1:{metrics_port}",
                ),
            ),
            tmp,
            port=queue_port,
        ),
        queue_port,
    )
    agent_address = f"127.0.0.1:{agent_port}"
    try:
        # Leave the node 1,000 tokens of its 90,000 admissible: the job (about 4,000) waits.
        asyncio.run(_reserve(agent_address, "blocker", int(AGENT_CAPACITY_TOKENS * 0.9) - 1000))
        accepted = post(
            queue_port, "/v1/chat/completions", chat("hello", max_tokens=4000), {"prefer": "respond-async"}
        )
        assert accepted.status == 202, accepted.body
        job_url = accepted.headers["location"]
        _until("tokens waiting", lambda: "kvgate_queue_tokens_waiting{" in scrape(metrics_port))
        waiting = scrape(metrics_port)
        asyncio.run(_reserve(agent_address, "blocker", 0, release=True))
        _until("finished job", lambda: post(queue_port, job_url, None).json()["status"] == "succeeded")
        _until("engine call count", lambda: "kvgate_queue_attempts_total{" in scrape(metrics_port))
        _until("stats after the job", lambda: 'state="succeeded"' in scrape(metrics_port))
        yield waiting + scrape(metrics_port)
    finally:
        queue.stop()
        agent.stop()
        upstreams.stop()


def exported_series(text: str) -> set[str]:
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.slow
def test_every_dashboard_metric_is_exported_by_a_running_gate_or_queue(
    gate_metrics: str, queue_metrics: str
) -> None:
    exported = exported_series(gate_metrics) | exported_series(queue_metrics)
    missing = used_metrics(dashboard()) - exported
    assert not missing, (
        f"the dashboard queries metrics neither the gate nor the queue exports: {sorted(missing)}"
    )


def families(metrics: str) -> set[str]:
    return {line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE kvgate_")}


@pytest.mark.slow
@pytest.mark.parametrize("process", ["gate", "queue"])
def test_every_metric_family_is_on_the_dashboard(process: str, gate_metrics: str, queue_metrics: str) -> None:
    exported = families(gate_metrics if process == "gate" else queue_metrics)
    used = used_metrics(dashboard())
    unused = {f for f in exported if not any(name.startswith(f) for name in used)}
    assert not unused, f"{process} metrics no panel shows: {sorted(unused)}"


def test_queue_panels_have_their_own_job_variable() -> None:
    """The queue is scraped as its own job (its Service, its ServiceMonitor)."""
    board = dashboard()
    queue_exprs = [e for e in expressions(board) if "kvgate_queue_" in e and not e.startswith("label_values")]
    assert queue_exprs and all('job=~"$queue_job"' in e for e in queue_exprs)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["queue_job"]["definition"] == "label_values(kvgate_queue_running, job)"


def test_metric_pattern_finds_names_and_skips_labels() -> None:
    expr = 'sum by (le) (rate(kvgate_gate_decision_duration_seconds_bucket{job=~"$job"}[5m]))'
    assert METRIC.findall(expr) == ["kvgate_gate_decision_duration_seconds_bucket"]
