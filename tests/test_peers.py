"""The peer routers as they ship (`make peers`) in front of two simulated vLLM nodes: each answers a chat
and sees the nodes as vLLM; their prefix-aware policies route a repeated prompt by what a node holds.

Evidence comes from the routers themselves: smg's /workers and its own /metrics, vllm-router's log.
Without .venv-peers every test skips, saying why.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.harness.client import Reply, post
from kvgate.harness.peers import PeerRouter, connectable_endpoint, find_peer, kv_event_flags, peer_router
from kvgate.harness.processes import ProcessGroup, Service, sim_command
from kvgate.localports import free_ports
from kvgate.sim.server import NODE_HEADER

pytestmark = pytest.mark.slow

WAIT_S = 60.0


def prompt(word: str) -> str:
    """300 simulated tokens (18 full blocks of 16) that no other test sends: the nodes outlive a test,
    and a prefix they already hold is published to nobody new (a router that subscribes late misses
    the BlockStored events of blocks cached before it came, as with vLLM)."""
    return f" {word[:3]:>3}" * 300


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    missing = [lookup.reason for lookup in map(find_peer, ("smg", "vllm-router")) if lookup.path is None]
    if missing:
        pytest.skip("; ".join(dict.fromkeys(missing)))
    ports = free_ports(2)
    with ProcessGroup(tmp_path_factory.mktemp("sims")) as group:
        for index, port in enumerate(ports):
            argv = sim_command(
                *("--listen", f"127.0.0.1:{port}", "--node-name", f"sim{index}"),
                *("--kv-capacity-tokens", "65536", "--decode-tokens-per-s", "1000"),
                *("--kv-events-endpoint", "tcp://127.0.0.1:0"),
            )
            group.start(f"sim{index}", argv, port=port).wait_listening(port)
        yield [f"http://127.0.0.1:{port}" for port in ports]


def chat(router: PeerRouter, text: str, max_tokens: int = 4) -> Reply:
    body = {
        "model": "kvgate-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }
    reply = post(router.port, "/v1/chat/completions", json.dumps(body).encode())
    assert reply.status == 200, reply.body[:300]
    assert reply.json()["usage"]["completion_tokens"] == max_tokens
    return reply


def wait_for_log(service: Service, pattern: str) -> re.Match[str]:
    """The first line of the router's log matching `pattern`, once it is written."""
    deadline = time.monotonic() + WAIT_S
    while True:
        service.check_alive()
        found = re.search(pattern, re.sub(r"\x1b\[[0-9;]*m", "", service.log()))
        if found:
            return found
        assert time.monotonic() < deadline, f"no {pattern!r} in {service.name}'s log:\n{service.log_tail()}"
        time.sleep(0.1)


def smg_polls(router: PeerRouter) -> dict[str, float]:
    text = post(router.metrics_port, "/metrics", None).body.decode()
    found = re.findall(r'^smg_engine_load_polls_total\{worker="([^"]+)",mode="poll"\} (\S+)$', text, re.M)
    return {worker: float(count) for worker, count in found}


def test_smg_takes_the_nodes_for_vllm_polls_their_metrics_and_keeps_a_prefix_on_its_node(
    nodes: list[str], tmp_path: Path
) -> None:
    with peer_router("smg", "cache_aware", nodes, tmp_path) as router:
        first, again = chat(router, prompt("smg")), chat(router, prompt("smg"))
        assert first.headers[NODE_HEADER] == again.headers[NODE_HEADER]
        workers = json.loads(post(router.port, "/workers", None).body)["workers"]
        assert {(w["url"], w["runtime_type"]) for w in workers} == {(url, "vllm") for url in nodes}
        assert {w["labels"]["max_model_len"] for w in workers} == {"32768"}
        deadline = time.monotonic() + WAIT_S
        while min(smg_polls(router).get(url, 0.0) for url in nodes) < 2:
            assert time.monotonic() < deadline, f"smg polled {smg_polls(router)}"
            time.sleep(0.2)


def test_vllm_router_cache_aware_routes_on_the_nodes_rendered_tokens(
    nodes: list[str], tmp_path: Path
) -> None:
    with peer_router("vllm-router", "cache_aware", nodes, tmp_path, extra=["--log-level", "debug"]) as router:
        first, again = chat(router, prompt("tree")), chat(router, prompt("tree"))
        assert first.headers[NODE_HEADER] == again.headers[NODE_HEADER]
        wait_for_log(router.service, r"Cache prefix decision .*match_rate=1\.0")
        assert "render_unavailable" not in router.service.log()


def test_vllm_router_kv_aware_credits_the_prefix_a_node_published(nodes: list[str], tmp_path: Path) -> None:
    extra = [*kv_event_flags(nodes), "--log-level", "debug"]
    with peer_router("vllm-router", "kv_aware", nodes, tmp_path, extra=extra) as router:
        for url in nodes:
            wait_for_log(router.service, rf"kv_index subscriber for {re.escape(url)} rank0")
        node = chat(router, prompt("kv")).headers[NODE_HEADER]
        wait_for_log(router.service, r"kv_index live sequence advanced")
        assert chat(router, prompt("kv")).headers[NODE_HEADER] == node
        wait_for_log(router.service, r"KV prefix decision .*credited_prefix_tokens=288\b")


def test_a_wildcard_kv_endpoint_is_given_to_vllm_router_as_the_worker_s_host() -> None:
    assert connectable_endpoint("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert connectable_endpoint("tcp://0.0.0.0:5558", "10.0.0.5") == "tcp://10.0.0.5:5558"
    assert connectable_endpoint("tcp://127.0.0.1:41000", "10.0.0.5") == "tcp://127.0.0.1:41000"
