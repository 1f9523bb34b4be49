"""`kvgate envoy-config --queue` and `--route-policies`: the layout of per-host and per-route policies,
the errors that name the entry, and the queue's own API reaching the queue with the gate out of the way."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.config import ModelConfig, ModelPolicy
from kvgate.config.routekeys import ASYNC_MODES, MAX_TOKENS, ROUTE_POLICY_KEYS, Kind
from kvgate.envoyconfig.cli import register
from kvgate.envoyconfig.routepolicy import METADATA_FIELDS, PolicyHost, PolicyPath, RoutePolicy, layout
from kvgate.errors import ConfigError
from kvgate.harness.client import chat, post
from kvgate.harness.stack import envoy_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["envoy-config", *argv])
    code: int = args.func(args)
    return code


POOLS = ["--pool", "interactive=10.0.0.5:8000", "--pool", "long=10.0.0.6:8000"]

# --- layout -----------------------------------------------------------------------------------------------


def test_entries_for_the_same_hosts_share_a_virtual_host() -> None:
    found = layout(
        [
            RoutePolicy(name="a", hosts=("b.example.com", "a.example.com"), max_total_tokens=2000),
            RoutePolicy(name="every", path_prefix="/v1/chat", interactive_max_tokens=1024),
            RoutePolicy(
                name="a-chat",
                hosts=("a.example.com", "b.example.com"),
                path_prefix="/v1/chat",
                async_="never",
            ),
            RoutePolicy(
                name="c", hosts=("c.example.com",), path_prefix="/v1/completions/legacy", model_policy="p"
            ),
        ],
        {"p": ModelPolicy(max_total_tokens=100)},
        "test",
    )
    chat_everywhere = PolicyPath("/v1/chat", (("x-kvgate-interactive-max-tokens", "1024"),))
    assert found.paths == (chat_everywhere,)
    assert found.hosts == (
        PolicyHost(
            name="a",
            domains=("a.example.com", "b.example.com"),
            metadata=(("x-kvgate-max-total-tokens", "2000"),),
            # The host's entry and the every-host one for the same prefix: one route set, both values.
            paths=(
                PolicyPath(
                    "/v1/chat", (("x-kvgate-interactive-max-tokens", "1024"), ("x-kvgate-async", "never"))
                ),
            ),
        ),
        PolicyHost(
            name="c",
            domains=("c.example.com",),
            metadata=(),
            # Longest prefix first: Envoy takes the first route that matches.
            paths=(PolicyPath("/v1/completions/legacy", (("x-kvgate-model-policy", "p"),)), chat_everywhere),
        ),
    )


def test_a_hosts_value_wins_over_the_every_host_one_for_the_same_path() -> None:
    found = layout(
        [
            RoutePolicy(
                name="every", path_prefix="/v1/chat", max_total_tokens=8000, default_output_tokens=10
            ),
            RoutePolicy(name="a", hosts=("a.example.com",), path_prefix="/v1/chat", max_total_tokens=1000),
        ],
        {},
        "test",
    )
    (host,) = found.hosts
    assert host.paths == (
        PolicyPath(
            "/v1/chat", (("x-kvgate-max-total-tokens", "1000"), ("x-kvgate-default-output-tokens", "10"))
        ),
    )


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (
            [
                RoutePolicy(name="a", hosts=("a.example.com", "b.example.com"), async_="never"),
                RoutePolicy(name="b", hosts=("b.example.com",), async_="allow"),
            ],
            r"route_policies\[1\] \(b\): host b\.example\.com is also in route policy 'a' with other hosts",
        ),
        (
            [
                RoutePolicy(name="a", path_prefix="/v1", async_="never"),
                RoutePolicy(name="a", path_prefix="/v2", async_="never"),
            ],
            r"route_policies\[1\] \(a\): name used twice",
        ),
        (
            [
                RoutePolicy(name="a", hosts=("a.example.com",), async_="never"),
                RoutePolicy(name="b", hosts=("a.example.com",), async_="allow"),
            ],
            r"route_policies\[1\] \(b\): hosts a\.example\.com already have a policy without path_prefix",
        ),
        (
            [
                RoutePolicy(name="a", path_prefix="/v1", async_="never"),
                RoutePolicy(name="b", path_prefix="/v1", async_="allow"),
            ],
            r"route_policies\[1\] \(b\): path_prefix /v1 is given twice for every host",
        ),
        (
            [RoutePolicy(name="a", path_prefix="/v1", model_policy="gold")],
            r"route_policies\[0\] \(a\): model_policy 'gold' is not an entry of the config's policies: "
            r"\(known: silver\)",
        ),
    ],
    ids=["overlapping-hosts", "name-twice", "host-policy-twice", "path-twice", "unknown-model-policy"],
)
def test_conflicts_name_the_entry(entries: list[RoutePolicy], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        layout(entries, {"silver": ModelPolicy()}, "routes.yaml")


def test_route_policies_file_errors_name_the_line_and_key(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "route_policies:\n"
        "- {name: strict, hosts: [strict.local], max_total_tokens: 2000}\n"
        "- {name: batch, path_prefix: /v1/batch/, async: prefer}\n"
    )
    with pytest.raises(
        ConfigError, match=r"routes\.yaml:3: route_policies\[1\]: path_prefix: '/v1/batch/' must"
    ):
        run_cli([*POOLS, "--route-policies", str(routes)])
    routes.write_text("route_policies:\n- {name: strict, path_prefix: /v1, max_total_token: 5}\n")
    with pytest.raises(
        ConfigError, match=r"routes\.yaml:2: route_policies\[0\]\.max_total_token: unknown key"
    ):
        run_cli([*POOLS, "--route-policies", str(routes)])
    routes.write_text("route_policies:\n- {name: strict, path_prefix: /v1}\n")
    with pytest.raises(ConfigError, match=r"routes\.yaml:2: route_policies\[0\]: sets nothing"):
        run_cli([*POOLS, "--route-policies", str(routes)])
    routes.write_text("route_policies:\n- {name: strict, async: prefer}\n")
    with pytest.raises(ConfigError, match=r"route_policies\[0\]: needs hosts or path_prefix"):
        run_cli([*POOLS, "--route-policies", str(routes)])
    routes.write_text("route_policies:\n- {name: strict, path_prefix: /v1, async: later}\n")
    with pytest.raises(ConfigError, match=r"route_policies\[0\]\.async: must be one of prefer, allow, never"):
        run_cli([*POOLS, "--route-policies", str(routes)])


def test_a_route_policy_that_contradicts_itself_is_refused_where_it_is_written(tmp_path: Path) -> None:
    """interactive <= total, by the one rule (kvgate.config.limits_contradiction): `kvgate envoy-config`
    refuses a route policy whose own limits contradict each other, naming its line."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "route_policies:\n"
        "- {name: odd, path_prefix: /v1, interactive_max_tokens: 9000, max_total_tokens: 3000}\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"routes\.yaml:2: route_policies\[0\]: "
        r"interactive_max_tokens \(9000\) must not exceed max_total_tokens \(3000\)",
    ):
        run_cli([*POOLS, "--route-policies", str(routes)])
    assert RoutePolicy(name="one", path_prefix="/v1", interactive_max_tokens=9000).values() == {
        "x-kvgate-interactive-max-tokens": "9000"
    }, "one limit alone meets the total only per request, where the total wins"
    routes.write_text("route_policies:\n- {name: big, path_prefix: /v1, max_total_tokens: 2000000000}\n")
    with pytest.raises(ConfigError, match=r"max_total_tokens: must be <= 1000000000"):
        run_cli([*POOLS, "--route-policies", str(routes)])


# --- the route-policy table feeds every place that names the keys -------------------------------------------

CHART = Path(__file__).resolve().parent.parent / "charts" / "kvgate"


def test_envoy_config_writes_the_tables_keys_in_its_order_with_its_bounds() -> None:
    assert [key for key, _ in METADATA_FIELDS] == [key.metadata for key in ROUTE_POLICY_KEYS]
    fields = {field.name: field for field in dataclasses.fields(RoutePolicy)}
    for key, attribute in METADATA_FIELDS:
        assert attribute in fields, key
    for row in ROUTE_POLICY_KEYS:
        if row.kind is Kind.TOKENS:
            bounds = {"min": row.minimum, "max": MAX_TOKENS}
            assert fields[row.name].metadata == bounds, row.name
            for owner in (ModelPolicy, ModelConfig):
                found = {field.name: field for field in dataclasses.fields(owner)}
                assert found[str(row.policy_field)].metadata == bounds, (owner, row.name)
        if row.policy_field is not None:
            assert row.policy_field in {field.name for field in dataclasses.fields(ModelPolicy)}


def test_the_charts_template_and_schema_agree_with_the_table() -> None:
    """The chart cannot import Python: its key list and its schema are read here and held to the table."""
    template = (CHART / "templates" / "_routepolicies.tpl").read_text()
    keys = re.search(r'define "kvgate\.routePolicies\.keys" -}}\n(.*?)\n{{- end', template, re.S)
    assert keys is not None
    assert [pair.split(":") for pair in keys.group(1).split(",")] == [
        [row.chart, row.metadata] for row in ROUTE_POLICY_KEYS
    ], "_routepolicies.tpl's kvgate.routePolicies.keys: chartKey:metadataKey, in the table's order"
    schema = json.loads((CHART / "values.schema.json").read_text())
    entry = schema["properties"]["envoy"]["properties"]["routePolicies"]["items"]
    for row in ROUTE_POLICY_KEYS:
        expected: dict[str, Any] = {
            Kind.TOKENS: {"type": "integer", "minimum": row.minimum, "maximum": row.maximum},
            Kind.POLICY: {"type": "string", "minLength": 1},
            Kind.PRIORITY: {"type": "string", "minLength": 1},
            Kind.ASYNC: {"enum": list(ASYNC_MODES)},
            Kind.TENANT_CLASS: {"type": "string", "minLength": 1},
        }[row.kind]
        assert entry["properties"][row.chart] == expected, row.chart
    (sets_something,) = entry["allOf"]
    assert [required for option in sets_something["anyOf"] for required in option["required"]] == [
        row.chart for row in ROUTE_POLICY_KEYS
    ], "an entry must set at least one of the table's keys"
    others = set(entry["properties"]) - {row.chart for row in ROUTE_POLICY_KEYS}
    assert others == {"name", "hosts", "pathPrefix"}


def test_cli_renders_route_policies_and_checks_model_policies_against_the_config(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("policies:\n  batch: {async_mode: prefer}\n")
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "route_policies:\n"
        "- {name: strict, hosts: [strict.local], max_total_tokens: 2000}\n"
        "- {name: batch, path_prefix: /v1/batch, model_policy: batch}\n"
    )
    output = tmp_path / "envoy.yaml"
    assert (
        run_cli([*POOLS, "--config", str(config), "--route-policies", str(routes), "--output", str(output)])
        == 0
    )
    bootstrap = yaml.safe_load(output.read_text())
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hosts = manager["route_config"]["virtual_hosts"]
    assert [h["name"] for h in hosts] == ["pools", "policy-strict"]
    overrides = hosts[1]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
    assert overrides["grpc_initial_metadata"] == [{"key": "x-kvgate-max-total-tokens", "value": "2000"}]
    config.write_text("policies:\n  gold: {async_mode: prefer}\n")
    with pytest.raises(ConfigError, match=r"model_policy 'batch' is not an entry of the config's policies"):
        run_cli([*POOLS, "--config", str(config), "--route-policies", str(routes)])


def test_queue_and_an_async_pool_address_are_one_too_many() -> None:
    with pytest.raises(ConfigError, match=r"--pool async and --queue both give the async pool 'async'"):
        run_cli([*POOLS, "--pool", "async=10.0.0.7:8080", "--queue", "10.0.0.7:8003"])


def test_queue_serves_the_pool_the_config_names_async(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("default_model: {pools: {async: deferred}}\nqueue: {max_hold_s: 60}\n")
    output = tmp_path / "envoy.yaml"
    assert (
        run_cli([*POOLS, "--config", str(config), "--queue", "10.0.0.7:8003", "--output", str(output)]) == 0
    )
    bootstrap = yaml.safe_load(output.read_text())
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert {r["route"]["cluster"] for r in routes[:3]} == {"pool_deferred"}
    # Routes without an upstream answer themselves (the gate did not answer: kvgate.envoyconfig.unanswered).
    held = [r for r in routes[3:] if r.get("route", {}).get("cluster") == "pool_deferred"]
    assert [r["route"]["idle_timeout"] for r in held] == ["90s"]


# --- end to end: the queue's API reaches the queue without the gate ---------------------------------------


@pytest.fixture(scope="module")
def gateless_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """envoy-config's bootstrap with --queue and --fail-closed, and no gate running: a request that
    reaches ext_proc gets Envoy's 500, one that does not reaches its upstream."""
    tmp = tmp_path_factory.mktemp("envoyconfig-queue")
    ports = {
        name: free_port() for name in ("listener", "ready", "admin", "gate", "interactive", "long", "queue")
    }
    output = tmp / "envoy.yaml"
    argv = [
        *(
            "--pool",
            f"interactive=127.0.0.1:{ports['interactive']}",
            "--pool",
            f"long=127.0.0.1:{ports['long']}",
        ),
        *("--queue", f"127.0.0.1:{ports['queue']}", "--gate", f"127.0.0.1:{ports['gate']}", "--fail-closed"),
        *("--listen", f"127.0.0.1:{ports['listener']}", "--ready-port", str(ports["ready"])),
        *("--admin-port", str(ports["admin"]), "--output", str(output)),
    ]
    assert run_cli(argv) == 0
    upstreams = Upstreams({pool: ports[pool] for pool in ("interactive", "long", "queue")})
    upstreams.start()
    envoy = envoy_process(output, tmp, ports["admin"], ports["listener"])
    try:
        yield {"ports": ports, "upstreams": upstreams}
    finally:
        envoy.stop()
        upstreams.stop()


@pytest.mark.slow
def test_queue_api_reaches_the_queue_with_ext_proc_off(gateless_envoy: dict[str, Any]) -> None:
    listener = gateless_envoy["ports"]["listener"]
    upstreams: Upstreams = gateless_envoy["upstreams"]
    for path in ("/v1/files", "/v1/batches/batch_1/cancel", "/v1/kvgate/jobs/job-1"):
        reply = post(listener, path, b'{"purpose": "batch"}')
        assert reply.status == 200, (path, reply.body)
        assert reply.json()["pool"] == "queue"
    assert [r.path for r in upstreams.received] == [
        "/v1/files",
        "/v1/batches/batch_1/cancel",
        "/v1/kvgate/jobs/job-1",
    ]
    # Whole path segments only, and everything else still asks the (absent) gate first.
    for path in ("/v1/filesystem", "/v1/chat/completions"):
        assert post(listener, path, chat("hello")).status == 500, path
    assert len(upstreams.received) == 3
