"""Weights and caps per Envoy route or virtual host (issue 30, item 2): a route names a class of
kvgate.yaml's `fairness.classes` (route key `tenant_class`), and the tenants whose requests it carries
take that class's weight, most share of KV and quota wherever their own entry sets none
(kvgate.policy.tenant_book)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_admission import MODEL, long_route, run
from test_envoyconfig_routes import run_cli
from test_fair_share_e2e import gate_figure
from texts import text_with_tokens
from waiting import until

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.config import AdmissionConfig, FairnessConfig, TokenQuotaConfig, parse_config
from kvgate.envoyconfig.routepolicy import RoutePolicy, layout
from kvgate.errors import ConfigError
from kvgate.gate.admission import Admission, Admitted
from kvgate.harness.client import chat, post
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port
from kvgate.policy import Reason, Refusal
from kvgate.policy.route import RoutePolicy as GateRoutePolicy
from kvgate.policy.route import read_route_policy
from kvgate.policy.tenant_book import TenantBook

CLASSES = (
    "classes: {partners: {weight: 3, max_kv_share: 0.5}, metered: {quota: {tokens: 20000, window_s: 20}}}"
)


def fairness(extra: str = "") -> FairnessConfig:
    return parse_config(f"fairness: {{enabled: true, default_weight: 2, {CLASSES}{extra}}}").fairness


def test_a_tenants_own_entry_wins_field_by_field_then_its_routes_class_then_the_defaults() -> None:
    config = fairness(", tenants: {acme: {weight: 5}, plain: {max_kv_share: 0.25}}")
    assert config.weight("acme", "partners") == 5.0, "its own weight"
    assert config.max_kv_share("acme", "partners") == 0.5, "the class fills what its entry leaves out"
    assert config.weight("someone", "partners") == 3.0
    assert config.weight("someone") == 2.0 and config.weight("plain") == 2.0, "the default weight"
    assert config.max_kv_share("plain", "partners") == 0.25
    assert config.quota("someone", "metered") == TokenQuotaConfig(20_000, 20.0)
    assert config.quota("someone", "partners") is None
    assert config.limits_tenants, "a class's cap is a cap"


def test_the_config_names_a_bad_class() -> None:
    with pytest.raises(ConfigError, match=r"fairness\.classes\.gold\.weight: must be >= 0\.01"):
        parse_config("fairness: {classes: {gold: {weight: 0}}}")
    with pytest.raises(ConfigError, match=r"fairness\.classes\.gold\.quota: a quota needs tokens"):
        parse_config("fairness: {classes: {gold: {quota: {window_s: 60}}}}")
    with pytest.raises(ConfigError, match=r"fairness\.classes\.gold\.share: unknown key"):
        parse_config("fairness: {classes: {gold: {share: 2}}}")


def test_the_gate_reads_a_routes_class_and_names_one_kvgate_yaml_does_not_have() -> None:
    classes = fairness().classes
    read = read_route_policy([("x-kvgate-tenant-class", "partners")], {}, ("normal",), classes)
    assert read.problems == () and read.policy == GateRoutePolicy(tenant_class="partners")
    bad = read_route_policy([("x-kvgate-tenant-class", "gold")], {}, ("normal",), classes)
    assert bad.policy == GateRoutePolicy()
    assert bad.problems == (
        "x-kvgate-tenant-class: no class 'gold' in kvgate.yaml's fairness.classes (known: metered, partners)",
    )


def test_the_book_takes_the_class_of_the_route_a_tenant_came_by_last_and_forgets_the_oldest() -> None:
    book = TenantBook(fairness(), max_tenants=2)
    book.learn("a", "partners")
    assert book.weight("a") == 3.0 and book.max_kv_share("a") == 0.5
    book.learn("a", None)
    assert book.weight("a") == 2.0 and book.max_kv_share("a") is None, "its latest route names no class"
    book.learn("a", "metered")
    assert book.quota("a") == TokenQuotaConfig(20_000, 20.0)
    book.learn("a", "gold")
    assert book.tenant_class("a") is None, "a class kvgate.yaml does not have is none"
    for tenant in ("a", "b", "c"):
        book.learn(tenant, "partners")
    assert [book.tenant_class(t) for t in ("a", "b", "c")] == [None, "partners", "partners"]


def test_envoy_config_refuses_a_class_the_config_does_not_have_and_writes_a_known_one() -> None:
    entries = [RoutePolicy(name="partners", hosts=("partners.example.com",), tenant_class="partners")]
    with pytest.raises(ConfigError, match=r"tenant_class 'partners' is not an entry of the config's fair"):
        layout(entries, {}, "routes.yaml", ("gold",))
    (host,) = layout(entries, {}, "routes.yaml", ("partners",)).hosts
    assert host.metadata == (("x-kvgate-tenant-class", "partners"),)
    with pytest.raises(ConfigError, match=r"tenant_class: 'Partners!' must be a class name"):
        RoutePolicy(name="p", hosts=("p.example.com",), tenant_class="Partners!")


# --- in the gate's admission ---------------------------------------------------------------------


def admission_with(config: FairnessConfig) -> tuple[FakeHeadroom, ManualClock, Admission]:
    clock = ManualClock()
    source = FakeHeadroom(clock, stale_after_s=5.0)
    source.add_node("a", 100_000)
    return source, clock, Admission(AdmissionConfig(max_wait_s=60.0), source, clock=clock, fairness=config)


async def ask(admission: Admission, tenant: str, rid: str, tenant_class: str | None = None) -> Admitted:
    return await admission.admit(
        long_route(10_000), MODEL, None, rid, tenant=tenant, tenant_class=tenant_class, output_tokens=1_000
    )


def test_a_routes_class_weighs_the_service_its_tenants_attain() -> None:
    """The same request costs a tenant behind the partners' route a third of its cost (weight 3), and
    one behind no class half of it (the default weight, 2)."""

    async def scenario() -> dict[str, float]:
        _, _, admission = admission_with(fairness())
        await admission.start()
        assert (await ask(admission, "p", "r0", "partners")).ticket is not None
        assert (await ask(admission, "q", "r1")).ticket is not None
        counters = {tenant: attained for tenant, attained, _ in admission.gauges().tenants}
        await admission.stop()
        return counters

    counters = run(scenario)
    cost = 9_000 + 2 * 1_000
    assert counters == pytest.approx({"p": cost / 3, "q": cost / 2})


def test_a_routes_class_sets_the_quota_of_the_tenants_it_carries() -> None:
    async def scenario() -> None:
        _, _, admission = admission_with(fairness())
        await admission.start()
        for rid in ("r0", "r1"):
            assert (await ask(admission, "m", rid, "metered")).ticket is not None
        refused = await ask(admission, "m", "r2", "metered")
        assert isinstance(refused.decision, Refusal) and refused.decision.reason is Reason.TENANT_QUOTA
        assert (await ask(admission, "m", "r3")).ticket is not None, "by a route of no class: no quota"
        await admission.stop()

    run(scenario)


def test_a_tenants_own_entry_outranks_its_routes_class_in_the_gate() -> None:
    async def scenario() -> None:
        config = fairness(", tenants: {m: {quota: {tokens: 100000, window_s: 20}}}")
        _, _, admission = admission_with(config)
        await admission.start()
        for rid in ("r0", "r1", "r2"):
            assert (await ask(admission, "m", rid, "metered")).ticket is not None
        await admission.stop()

    run(scenario)


# --- through the real Envoy: the class a virtual host names reaches the gate --------------------------


@pytest.mark.slow
def test_a_virtual_hosts_tenant_class_sets_the_quota_of_the_requests_it_carries(
    tmp_path: Path, sp_model_path: Path
) -> None:
    """`kvgate envoy-config --route-policies` gives the virtual host metered.local the class
    `metered` (a quota of 5,000 tokens per 10 minutes). Through Envoy, a second long request to that
    host is refused with the quota's 429; the same request to another host is admitted."""
    ports = {name: free_port() for name in ("listener", "ready", "admin", "gate", "interactive", "long")}
    agent_port = free_port()
    config = (
        f"default_model: {{tokenizer: {sp_model_path}, interactive_max_tokens: 1024}}\n"
        f"headroom: {{agents: ['127.0.0.1:{agent_port}'], stale_after_s: 5}}\n"
        "fairness: {classes: {metered: {quota: {tokens: 5000, window_s: 600}}}}\n"
    )
    (tmp_path / "gate.yaml").write_text(config)
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        yaml.safe_dump(
            {"route_policies": [{"name": "metered", "hosts": ["metered.local"], "tenant_class": "metered"}]}
        )
    )
    output = tmp_path / "envoy.yaml"
    argv = [
        *("--pool", f"interactive=127.0.0.1:{ports['interactive']}"),
        *("--pool", f"long=127.0.0.1:{ports['long']}"),
        *("--gate", f"127.0.0.1:{ports['gate']}", "--config", str(tmp_path / "gate.yaml")),
        *("--route-policies", str(routes)),
        *("--listen", f"127.0.0.1:{ports['listener']}", "--ready-port", str(ports["ready"])),
        *("--admin-port", str(ports["admin"]), "--output", str(output)),
    ]
    assert run_cli(argv) == 0
    prompt = text_with_tokens(sp_model_path, 2_900)
    upstreams = Upstreams({pool: ports[pool] for pool in ("interactive", "long")})
    upstreams.start()
    long = f"127.0.0.1:{ports['long']}"
    agent = agent_process(tmp_path, "agent", agent_port, long, ["--capacity-tokens", "50000"])
    try:
        with gate_process(config, tmp_path, ports["gate"]) as gate:
            envoy = envoy_process(output, tmp_path, ports["admin"], ports["listener"])
            try:
                until(lambda: gate_figure(gate, "kvgate_node_fresh") == 1, "the gate follows the agent")

                def send(host: str) -> tuple[int, str | None]:
                    body = chat(prompt, max_tokens=50)
                    reply = post(ports["listener"], "/v1/chat/completions", body, {"host": host})
                    return reply.status, reply.headers.get("x-kvgate-reason")

                first, second = send("metered.local"), send("metered.local")
                elsewhere = send("other.local")
            finally:
                envoy.stop()
    finally:
        agent.stop()
        upstreams.stop()
    assert (first[0], second, elsewhere[0]) == (200, (429, Reason.TENANT_QUOTA.value), 200)
    assert [r.pool for r in upstreams.received] == ["long", "long"]


@pytest.mark.slow
@pytest.mark.parametrize("round_trips", ["1", "2"])
def test_a_routes_class_reaches_the_queue_with_the_jobs_it_carries_and_a_clients_does_not(
    tmp_path: Path, sp_model_path: Path, round_trips: str
) -> None:
    """Through Envoy with `kvgate envoy-config --queue --route-policies`: the requests a classed
    virtual host or path sends to the queue, the gate's async hand-off and the queue's own API alike,
    carry the class in x-kvgate-tenant-class (a path's class over its host's), for the queue to weigh
    the jobs as the gate weighs the route's requests; a client's own copy of the header reaches it from
    no route."""
    ports = {
        name: free_port() for name in ("listener", "ready", "admin", "gate", "interactive", "long", "queue")
    }
    config = (
        f"default_model: {{tokenizer: {sp_model_path}, interactive_max_tokens: 1024, async_mode: allow}}\n"
        "fairness: {classes: {partners: {weight: 3}, trial: {weight: 0.5}}}\n"
    )
    (tmp_path / "gate.yaml").write_text(config)
    routes = tmp_path / "routes.yaml"
    policies = [
        {"name": "partners", "hosts": ["partners.local"], "tenant_class": "partners"},
        {"name": "trial", "path_prefix": "/v1/completions", "tenant_class": "trial"},
    ]
    routes.write_text(yaml.safe_dump({"route_policies": policies}))
    output = tmp_path / "envoy.yaml"
    argv = [
        *("--pool", f"interactive=127.0.0.1:{ports['interactive']}"),
        *("--pool", f"long=127.0.0.1:{ports['long']}"),
        *("--queue", f"127.0.0.1:{ports['queue']}"),
        *("--gate", f"127.0.0.1:{ports['gate']}", "--config", str(tmp_path / "gate.yaml")),
        *("--route-policies", str(routes), "--round-trips", round_trips),
        *("--listen", f"127.0.0.1:{ports['listener']}", "--ready-port", str(ports["ready"])),
        *("--admin-port", str(ports["admin"]), "--output", str(output)),
    ]
    assert run_cli(argv) == 0
    prompt = text_with_tokens(sp_model_path, 2_900)
    upstreams = Upstreams({pool: ports[pool] for pool in ("interactive", "long", "queue")})
    upstreams.start()
    forged = {"x-kvgate-tenant-class": "partners"}
    try:
        with gate_process(config, tmp_path, ports["gate"]):
            envoy = envoy_process(output, tmp_path, ports["admin"], ports["listener"])
            try:
                deferred = {"prefer": "respond-async", **forged}
                sent = [
                    ("partners.local", "/v1/chat/completions", chat(prompt), deferred),
                    (
                        "partners.local",
                        "/v1/completions",
                        json.dumps({"model": "test-model", "prompt": prompt}).encode(),
                        deferred,
                    ),
                    ("other.local", "/v1/chat/completions", chat(prompt), deferred),
                    ("partners.local", "/v1/files", b"{}", forged),
                    ("other.local", "/v1/files", b"{}", forged),
                ]
                for host, path, body, headers in sent:
                    reply = post(ports["listener"], path, body, {"host": host, **headers})
                    assert reply.status == 200, (host, path, reply.status, reply.body[:200])
            finally:
                envoy.stop()
    finally:
        upstreams.stop()
    assert [(r.pool, r.headers.get("x-kvgate-tenant-class")) for r in upstreams.received] == [
        ("queue", "partners"),
        ("queue", "trial"),
        ("queue", None),
        ("queue", "partners"),
        ("queue", None),
    ]
