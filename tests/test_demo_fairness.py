"""The fairness scenario (issue 30): tenants in a scenario, their requests planned and signed, and the
figures of a run (kvgate.demo.fairness) on hand-made results; end to end through the real Envoy, gate,
agents and simulated nodes, each tenant's verified identity reaching the gate."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvgate.demo.capacity import node_capacity_tokens_per_s
from kvgate.demo.envoy_config import baseline_bootstrap, gate_replicas, rate_limited
from kvgate.demo.fairness import (
    backlogged_by_step,
    fairness_figures,
    jain,
    max_min_shares,
    service_by_step,
    service_gap_max,
)
from kvgate.demo.load import Result, request_body
from kvgate.demo.runner import run_demo
from kvgate.demo.runs import start_stack
from kvgate.demo.scenario import (
    Layout,
    Planned,
    TenantTraffic,
    builtin_scenario,
    load_scenario,
    long_shape,
    lower_priority,
    parse_scenario,
    plan,
)
from kvgate.demo.tenants import fair_request_rate, verifying
from kvgate.errors import ConfigError
from kvgate.harness.engines import NoEngines, locate_engines
from kvgate.harness.processes import ProcessGroup
from kvgate.names import TENANT_HEADER

REPO_ENVOY = Path(__file__).resolve().parent.parent / "envoy" / "envoy.yaml"


def served(
    tenant: str, sent: float, ttft: float, done: float, *, prompt: int = 1_000, output: int = 0
) -> Result:
    planned = Planned(sent, "long", prompt, max(output, 1), 0, tenant=tenant)
    return Result(planned, sent, "ok", 200, ttft, done, output, prompt_tokens=prompt)


def refused(tenant: str, sent: float, *, prompt: int = 1_000) -> Result:
    planned = Planned(sent, "long", prompt, 1, 0, tenant=tenant)
    return Result(planned, sent, "429", 429, None, 0.1, 0, prompt_tokens=prompt)


# --- the figures ---------------------------------------------------------------------------------


def test_jain_is_one_for_equal_service_and_one_over_n_for_one_tenant_served() -> None:
    assert jain([5.0, 5.0, 5.0]) == 1.0
    assert jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)


def test_max_min_shares_fill_by_weight_and_stop_at_each_demand() -> None:
    shares = max_min_shares({"a": 10.0, "b": 100.0, "c": 100.0}, {"a": 1.0, "b": 1.0, "c": 2.0}, 100.0)
    assert shares == pytest.approx({"a": 0.1, "b": 0.3, "c": 0.6})


def test_service_accrues_the_prompt_at_the_first_token_and_the_output_to_the_end() -> None:
    """1,000 prompt tokens at 1 s, 100 output tokens (x 2) over 1-3 s, weight 2."""
    service = service_by_step([served("a", 0.0, 1.0, 3.0, output=100)], {"a": 2.0}, step_s=1.0)
    assert service["a"][:4] == pytest.approx([0.0, 500 + 50, 50, 0.0])


def test_a_tenant_is_backlogged_in_the_steps_its_request_waits_through() -> None:
    backlog = backlogged_by_step([served("a", 1.0, 2.0, 4.0)], step_s=0.5)
    assert [i for i, waiting in enumerate(backlog["a"]) if waiting] == [2, 3, 4, 5]


def test_the_service_gap_is_how_far_two_backlogged_tenants_drift_apart() -> None:
    """Both wait from 0 to 10 s; a's three requests are served meanwhile, b's one: a drifts 2,000
    ahead, and a third tenant never backlogged with them changes nothing."""
    results = [
        served("a", 0.0, 10.0, 11.0),
        served("b", 0.0, 10.0, 11.0),
        served("a", 1.0, 2.0, 2.0),
        served("a", 1.0, 4.0, 4.0),
        served("b", 1.0, 5.0, 5.0),
        served("a", 1.0, 6.0, 6.0),
        served("c", 12.0, 1.0, 1.0, prompt=50_000),
    ]
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    service = service_by_step(results, weights, step_s=1.0)
    assert service_gap_max(service, backlogged_by_step(results, step_s=1.0)) == pytest.approx(2_000)
    figures = fairness_figures(results, {}, (), weights, step_s=1.0, window_s=5.0)
    assert figures["largest_request_cost"] == 50_000
    assert sum(t["share"] for t in figures["tenants"].values()) == pytest.approx(1.0)
    assert figures["jain_windows"] >= 1 and figures["jain_min"] < 1.0


def test_jain_compares_tenants_over_the_steps_in_which_all_of_them_are_backlogged() -> None:
    """a waits all 10 s, b the first 6 (past half the window): each is served 1,000 a second while it
    waits. Over the whole window b reads as served 60 % of a; while both wait, alike."""
    results = [served("a", 0.0, 10.0, 11.0), served("b", 0.0, 6.0, 7.0)]
    results += [served(t, 0.0, float(i), float(i), prompt=1_000) for t in ("a", "b") for i in range(1, 6)]
    results += [served("a", 0.0, float(i), float(i), prompt=1_000) for i in range(6, 10)]
    weights = {"a": 1.0, "b": 1.0}
    figures = fairness_figures(results, {}, (), weights, step_s=1.0, window_s=10.0)
    assert figures["jain_windows"] == 1 and figures["jain_min"] == pytest.approx(1.0)


# --- the scenario --------------------------------------------------------------------------------


def test_tenants_plan_over_declared_requests_on_and_off_and_everyone_chats() -> None:
    scenario = load_scenario(builtin_scenario("fairness"))
    requests = plan(scenario, 120.0, True)
    longs = [r for r in requests if r.kind == "long"]
    assert {r.tenant for r in longs} == {"A", "B", "C", "D", "E", "F"}
    assert all(r.max_tokens == 4 * r.output_tokens for r in longs)
    assert all(r.at_s % 120 < 60 for r in longs if r.tenant == "D"), "D is off every other 60 s"
    assert {r.tenant for r in requests if r.kind == "short"} == {"A", "B", "C", "D", "E", "F"}
    body = json.loads(request_body(scenario, longs[0]))
    assert (body["max_tokens"], body["kvgate_sim_eos_after"]) == (512, 128)


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ("[{name: a}, {name: a}]", "distinct names"),
        ("[{name: a, on_s: 10}]", "on_s and off_s"),
        ("[{name: a, prompt_tokens: 41000}]", "max_model_len"),
        ("[{name: a, priority: urgent}]", "priority: must be one of"),
    ],
)
def test_bad_tenants_are_refused_naming_the_problem(tenants: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_scenario(f"name: bad\nbursts: null\ntenants: {tenants}\n")


def test_a_tenant_declares_its_output_times_over_declare() -> None:
    assert TenantTraffic(output_tokens=100, over_declare=2.5).declared_tokens == 250


def test_a_lower_priority_tenant_is_owed_no_share_while_the_others_wait() -> None:
    """a and b wait all through and are served alike; c, of a lower priority, waits as long and gets
    one request through: counted among equals it would pull Jain's index down, but priority comes first, so
    it is reported beside them with a fair share of 0."""
    results = [served(t, 0.0, 10.0, 11.0) for t in ("a", "b", "c")]
    results += [served(t, 1.0, float(i), float(i)) for t in ("a", "b") for i in range(2, 10)]
    results.append(served("c", 1.0, 4.0, 4.0))
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    among_all = fairness_figures(results, {}, (), weights, step_s=1.0, window_s=5.0)
    assert among_all["jain_min"] < 0.9
    figures = fairness_figures(results, {}, (), weights, lower_priority={"c"}, step_s=1.0, window_s=5.0)
    assert figures["jain_min"] == pytest.approx(1.0)
    assert figures["tenants"]["c"]["fair_share"] == 0.0
    assert figures["tenants"]["a"]["fair_share"] == pytest.approx(0.5)
    assert 0 < figures["tenants"]["c"]["share"] < figures["tenants"]["a"]["share"]


def test_a_tenant_that_comes_and_goes_is_owed_a_share_only_of_the_windows_it_asks_in() -> None:
    """a and b wait and are served alike for 20 s; d waits and is served as they are for the first
    10 s only, then goes. Each asks three times what it gets (the rest refused). Filled over the whole
    run, d's demand would owe it a third of everything, and a and b would read as under their shares;
    filled window by window it is owed a third of the first window and nothing of the second, which is
    what it got."""
    results = [served(t, 0.0, 20.0, 20.5) for t in ("a", "b")] + [served("d", 0.0, 10.0, 10.5)]
    results += [served(t, float(i), 0.5, 0.6) for t in ("a", "b") for i in range(1, 20)]
    results += [served("d", float(i), 0.5, 0.6) for i in range(1, 10)]
    on = [(t, i) for t in ("a", "b") for i in range(1, 20)] + [("d", i) for i in range(1, 10)]
    results += [refused(t, float(i)) for t, i in on for _ in range(2)]
    weights = {"a": 1.0, "b": 1.0, "d": 1.0}
    figures = fairness_figures(results, {}, (), weights, step_s=1.0, window_s=10.0)
    for tenant, row in figures["tenants"].items():
        assert row["fair_share"] == pytest.approx(row["share"], abs=0.03), tenant
    assert figures["tenants"]["d"]["fair_share"] < 0.25
    assert figures["tenants"]["a"]["fair_share"] > 0.37


def test_lower_priority_tenants_are_those_below_the_highest_present() -> None:
    tenants = (TenantTraffic("A"), TenantTraffic("F", priority="low"), TenantTraffic("G", priority="low"))
    assert lower_priority(tenants) == {"F", "G"}
    assert lower_priority(tenants[1:]) == frozenset()


# --- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_fair_shares_through_the_real_stack_each_tenant_charged_by_its_verified_token(tmp_path: Path) -> None:
    """A few seconds of the fairness scenario with fair shares on: the report has its figures, nothing
    is lost or preempted, and the gate counted each tenant's long requests under its token's name."""
    full = load_scenario(builtin_scenario("fairness"))
    timing = dataclasses.replace(
        full.timing, burst_phase_s=8, no_burst_phase_s=2, drain_s=20, fairness_window_s=4
    )
    tenants = tuple(dataclasses.replace(t, rate_per_s=t.rate_per_s / 2) for t in full.tenants)
    scenario = dataclasses.replace(full, runs=("kvgate_fair",), timing=timing, tenants=tenants)
    report = asyncio.run(
        asyncio.wait_for(run_demo(scenario, tmp_path, REPO_ENVOY, stream=io.StringIO()), 240)
    )
    run = report["kvgate_fair"]
    assert (run["requests_lost"], run["preemptions"], run["oom_crashes"]) == (0, 0, 0)
    assert {
        "jain_mean",
        "jain_min",
        "service_gap_max",
        "largest_request_cost",
        "kv_occupancy_mean",
    } <= run.keys()
    assert set(run["tenants"]) == {"A", "B", "C", "D", "E", "F"}
    assert run["tenants"]["E"]["weight"] == 3.0
    # The gate's own count: every long request charged to the tenant its token names, none anonymous.
    counted = run["gate_tenant_requests"]
    lines = (tmp_path / "requests-kvgate_fair.jsonl").read_text().splitlines()
    longs = [row for row in map(json.loads, lines) if row["kind"] == "long"]
    assert set(counted) == {row["tenant"] for row in longs} and len(counted) >= 4, counted
    assert sum(sum(c.values()) for c in counted.values()) == len(longs)


@pytest.mark.engines
@pytest.mark.slow
def test_the_fairness_scenario_runs_on_real_vllm_engines(tmp_path: Path) -> None:
    """Twenty seconds of fairness-vllm.yaml with fair shares on: two real vLLM engines, every tenant's
    request answered or refused 429, none preempted or lost, each charged to its token's tenant. The
    figures of a full run are in docs/operations.md, "On real vLLM"."""
    if isinstance(found := locate_engines(), NoEngines):
        pytest.skip(f"real engines: {found.reason}")
    full = load_scenario(builtin_scenario("fairness-vllm"))
    timing = dataclasses.replace(
        full.timing, burst_phase_s=20, no_burst_phase_s=2, drain_s=60, fairness_window_s=10
    )
    scenario = dataclasses.replace(full, runs=("kvgate_fair",), timing=timing)
    report = asyncio.run(
        asyncio.wait_for(run_demo(scenario, tmp_path, REPO_ENVOY, stream=io.StringIO()), 1200)
    )
    run = report["kvgate_fair"]
    assert (run["requests_lost"], run["preemptions"]) == (0, 0)
    assert run["long_served"] >= 1 and run["outcomes"]["ok"] + run["outcomes"]["429"] == run["requests_total"]
    lines = (tmp_path / "requests-kvgate_fair.jsonl").read_text().splitlines()
    longs = [row for row in map(json.loads, lines) if row["kind"] == "long"]
    counted = run["gate_tenant_requests"]
    assert sum(sum(c.values()) for c in counted.values()) == len(longs)
    assert set(counted) == {row["tenant"] for row in longs}


# --- two gate replicas and two queues ----------------------------------------------------------------


def test_replicated_envoy_pins_one_tenant_to_the_first_gate_and_health_checks_the_replicas(
    tmp_path: Path,
) -> None:
    config_path = tmp_path / "envoy.yaml"
    config_path.write_text(REPO_ENVOY.read_text(encoding="utf-8"), encoding="utf-8")
    verifying(config_path, '{"keys": []}')
    shipped = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    edited = gate_replicas(shipped, "A", 4242)
    resources = edited["static_resources"]
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    shipped_routes = shipped["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["route_config"]["virtual_hosts"][0]["routes"]
    # Every route, as shipped, behind a copy of itself for A's verified tenant header alone.
    assert routes[1::2] == shipped_routes
    for pinned, route in zip(routes[::2], routes[1::2], strict=True):
        assert pinned["match"]["headers"][-1] == {"name": TENANT_HEADER, "string_match": {"exact": "A"}}
        assert pinned.get("route", pinned.get("direct_response")) == route.get(
            "route", route.get("direct_response")
        )
        ext_proc = pinned["typed_per_filter_config"]["envoy.filters.http.ext_proc"]
        if "overrides" in ext_proc:
            cluster = ext_proc["overrides"]["grpc_service"]["envoy_grpc"]["cluster_name"]
            assert cluster == "kvgate_gate_pinned"
    clusters = {c["name"]: c for c in resources["clusters"]}
    (endpoint,) = clusters["kvgate_gate_pinned"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"]["port_value"] == 4242
    assert "grpc_health_check" in clusters["kvgate_gate"]["health_checks"][0]
    assert clusters["async"]["health_checks"][0]["http_health_check"] == {"path": "/health"}
    filters = {f["name"]: f["typed_config"] for f in manager["http_filters"]}
    # The route ext_proc reads is chosen again once jwt_authn has set the tenant header.
    assert filters["envoy.filters.http.jwt_authn"]["providers"]["kvgate"]["clear_route_cache"] is True
    assert "clear_route_cache" not in str(shipped)


def _action(route: dict[str, object]) -> dict[str, object]:
    """What a route does, apart from what it matches and its per-filter settings."""
    return {key: value for key, value in route.items() if key not in ("match", "typed_per_filter_config")}


def test_the_replicated_runs_need_tenants() -> None:
    with pytest.raises(ConfigError, match="the kvgate_fair_2x_kill run needs the scenario's tenants"):
        parse_scenario("runs: [kvgate_fair_2x_kill]\n")


@pytest.mark.slow
def test_two_gates_and_two_queues_on_postgresql_through_the_real_envoy(tmp_path: Path) -> None:
    """A few seconds of kvgate_fair_2x and kvgate_fair_2x_kill: tenant A's long requests are decided
    by the first gate alone and the others' by both; the second gate orders its line by A's service
    too, which it never admitted (the agents' totals); killing the second gate and queue halfway
    loses nothing but an answer the dead queue was relaying: what they held gets an explicit,
    retryable refusal."""
    full = load_scenario(builtin_scenario("fairness"))
    timing = dataclasses.replace(
        full.timing, burst_phase_s=10, no_burst_phase_s=2, drain_s=45, fairness_window_s=5
    )
    tenants = tuple(dataclasses.replace(t, rate_per_s=t.rate_per_s / 4) for t in full.tenants)
    runs = ("kvgate_fair_2x", "kvgate_fair_2x_kill")
    gate = dataclasses.replace(full.gate, queue_max_hold_s=5)
    scenario = dataclasses.replace(full, runs=runs, timing=timing, tenants=tenants, gate=gate)
    report = asyncio.run(
        asyncio.wait_for(run_demo(scenario, tmp_path, REPO_ENVOY, stream=io.StringIO()), 420)
    )
    both = report["kvgate_fair_2x"]
    assert (both["requests_lost"], both["preemptions"], both["oom_crashes"]) == (0, 0, 0)
    replicas = both["gate_replicas"]
    assert set(replicas) == {"gate", "gate-1"}
    assert "A" in replicas["gate"]["tenant_requests"]
    assert "A" not in replicas["gate-1"]["tenant_requests"]
    assert replicas["gate-1"]["tenant_requests"], "the second gate decided no one's requests"
    assert replicas["gate-1"]["tenant_attained"]["A"] > 0

    killed = report["kvgate_fair_2x_kill"]
    assert killed["killed"]["processes"] == ["gate-1", "queue-1"]
    assert (killed["preemptions"], killed["oom_crashes"]) == (0, 0)
    assert set(killed["gate_replicas"]) == {"gate"}
    lines = (tmp_path / "requests-kvgate_fair_2x_kill.jsonl").read_text().splitlines()
    rows = list(map(json.loads, lines))
    refused = [row for row in rows if row["status"] not in (200, None)]
    assert all(row["status"] in (429, 503) for row in refused), refused
    # A request whose answer the dead queue was relaying is cut mid-body; nothing else may be lost.
    lost = [row for row in rows if row["outcome"] == "lost"]
    assert all("ClientPayloadError" in (row["detail"] or "") for row in lost), lost


# --- Envoy's per-tenant rate limit, the comparison run ----------------------------------------------


def test_the_rate_limit_run_needs_tenants() -> None:
    with pytest.raises(ConfigError, match="the ratelimit run needs the scenario's tenants"):
        parse_scenario("runs: [baseline, ratelimit]\n")


def test_each_tenant_gets_a_sixth_of_the_requests_the_nodes_serve() -> None:
    """Six tenants: one sixth of the long requests three nodes fit back to back, plus the chat."""
    scenario = load_scenario(builtin_scenario("fairness"))
    prompt, output = long_shape(scenario)
    long_per_s = 3 * node_capacity_tokens_per_s(scenario.node, prompt, output) / (prompt + output)
    assert fair_request_rate(scenario) == pytest.approx((long_per_s + scenario.short.rate_per_s) / 6)
    bucket = rate_limited(baseline_bootstrap(1, 2, [3]), {"A": 0.4, "B": 30.0})
    (limit, _router) = bucket["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["http_filters"]
    buckets = {d["entries"][0]["value"]: d["token_bucket"] for d in limit["typed_config"]["descriptors"]}
    assert buckets["A"] == {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "2.500s"}
    # Envoy refuses a refill faster than every 50 ms: a high rate refills 50 ms apart.
    assert buckets["B"]["fill_interval"] == "0.050s"


@pytest.mark.slow
def test_envoy_holds_a_tenant_to_its_rate_by_its_verified_token_not_the_others(tmp_path: Path) -> None:
    """Through the real Envoy with the run's config: tenant A's burst past its bucket gets Envoy's 429;
    B's request, sent right after, is served; a client's own tenant header does not move A onto
    another tenant's bucket."""
    full = load_scenario(builtin_scenario("fairness"))
    scenario = dataclasses.replace(full, runs=("ratelimit",), layout=Layout(baseline_nodes=1))

    async def scenario_run() -> tuple[list[int], int, int]:
        with ProcessGroup(tmp_path / "logs") as group:
            stack = await start_stack("ratelimit", group, scenario, tmp_path, REPO_ENVOY)
            body = json.dumps(
                {"model": scenario.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            )
            async with aiohttp.ClientSession() as client:

                async def send(tenant: str, headers: dict[str, str] | None = None) -> int:
                    auth = {"authorization": f"Bearer {stack.credentials[tenant]}", **(headers or {})}
                    async with client.post(stack.url, data=body, headers=auth) as answer:
                        await answer.read()
                        return answer.status

                burst = [await send("A") for _ in range(4)]
                claimed = await send("A", {"x-kvgate-tenant": "B"})
                other = await send("B")
                return burst, claimed, other

    burst, claimed, other = asyncio.run(asyncio.wait_for(scenario_run(), 120))
    # A's bucket holds ceil(rate) requests (about 1 a second at this scenario's rate): the rest are 429.
    assert burst[0] == 200 and 429 in burst, burst
    assert claimed == 429
    assert other == 200
