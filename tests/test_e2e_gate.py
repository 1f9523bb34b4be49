"""End to end through the real Envoy binary, the gate and three upstreams, once with each shipped
set-up: envoy/envoy.yaml (two round trips per request) and envoy/envoy-one-trip.yaml (one)."""

from __future__ import annotations

import base64
import gzip
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_gate_holds import envoy_stats
from texts import text_with_tokens
from waiting import until

from kvgate.harness.client import chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.processes import Service
from kvgate.harness.stack import envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


@dataclass
class Stack:
    ports: dict[str, int]
    upstreams: Upstreams
    envoy: Service
    tmp: Path
    config_text: str
    gate: Service
    envoy_source: Path

    def send(self, body: bytes, path: str = CHAT, headers: dict[str, str] | None = None, timeout: float = 30):  # type: ignore[no-untyped-def]
        return post(self.ports["listener"], path, body, headers, timeout)


@pytest.fixture(scope="module", params=["envoy.yaml", "envoy-one-trip.yaml"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, sp_model_path: Path
) -> Iterator[Stack]:
    source = ROOT / "envoy" / request.param
    tmp = tmp_path_factory.mktemp("e2e")
    ports = {name: free_port() for name in ("listener", "gate", "interactive", "long", "async", "admin")}
    upstreams = Upstreams({pool: ports[pool] for pool in ("interactive", "long", "async")})
    upstreams.start()
    config_text = f"server: {{drain_seconds: 10}}\ndefault_model: {{tokenizer: {sp_model_path}}}\n"
    envoy = _envoy_for(ports, tmp, source)
    try:
        with gate_process(config_text, tmp, ports["gate"]) as gate:
            yield Stack(ports, upstreams, envoy, tmp, config_text, gate, source)
    finally:
        envoy.stop()
        upstreams.stop()


@pytest.fixture(scope="module")
def texts(sp_model_path: Path) -> dict[str, str]:
    return {
        "short": text_with_tokens(sp_model_path, 700),
        "8k": text_with_tokens(sp_model_path, 8000),
        "20k": text_with_tokens(sp_model_path, 20000),
    }


def test_short_chat_goes_interactive(stack: Stack, texts: dict[str, str]) -> None:
    reply = stack.send(chat(texts["short"]))
    assert reply.status == 200, reply.body
    assert reply.json()["pool"] == "interactive"
    received = stack.upstreams.received[-1]
    assert received.headers["x-kvgate-pool"] == "interactive"
    assert received.headers["x-kvgate-reason"] == "short"
    exact_total = 700 + 1024 + 4  # prompt + default output budget + one message's template overhead
    assert abs(int(received.headers["x-kvgate-tokens"]) - exact_total) <= 0.1 * exact_total
    # Envoy echoes the decision to the client from the gate's metadata.
    assert reply.headers["x-kvgate-pool"] == "interactive"
    assert reply.headers["x-kvgate-reason"] == "short"
    assert reply.headers["x-kvgate-tokens"] == received.headers["x-kvgate-tokens"]


def test_8k_chat_goes_long(stack: Stack, texts: dict[str, str]) -> None:
    reply = stack.send(chat(texts["8k"]))
    assert reply.status == 200, reply.body
    assert reply.json()["pool"] == "long"
    assert stack.upstreams.received[-1].headers["x-kvgate-reason"] == "long"


def test_20k_chat_gets_413_json(stack: Stack, texts: dict[str, str]) -> None:
    before = len(stack.upstreams.received)
    reply = stack.send(chat(texts["20k"]))
    assert reply.status == 413
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "16384" in error["message"]
    assert reply.headers["x-kvgate-reason"] == "too_long"
    assert len(stack.upstreams.received) == before, "a refused request must not reach any pool"


def test_a_virtual_hosts_policy_in_the_envoy_config_sets_the_limit(stack: Stack) -> None:
    """envoy/*.yaml's strict.local caps requests at 2,000 tokens; the default host does not."""
    request = chat("word " * 2000)  # about 2,000 prompt tokens + the 1,024-token default budget
    strict = stack.send(request, headers={"host": "strict.local"})
    assert strict.status == 413, strict.body
    assert "2000" in strict.json()["error"]["message"]
    default = stack.send(request)
    assert default.status == 200, default.body
    assert default.json()["pool"] == "interactive"


def test_output_budget_counts(stack: Stack, texts: dict[str, str]) -> None:
    reply = stack.send(chat("Write a long story about a lighthouse.", max_tokens=6000))
    assert reply.json()["pool"] == "long"


def test_forged_pool_header_is_ignored(stack: Stack, texts: dict[str, str]) -> None:
    reply = stack.send(
        chat(texts["short"]), headers={"x-kvgate-pool": "long", "x-kvgate-endpoint": "127.0.0.1:1"}
    )
    assert reply.status == 200
    assert reply.json()["pool"] == "interactive"
    received = stack.upstreams.received[-1]
    assert received.headers["x-kvgate-pool"] == "interactive"
    assert "x-kvgate-endpoint" not in received.headers


def test_malformed_json_gets_400(stack: Stack) -> None:
    reply = stack.send(b'{"model": "m", "messages": [')
    assert reply.status == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in reply.json()["error"]["message"]


def test_missing_messages_gets_400_naming_the_field(stack: Stack) -> None:
    reply = stack.send(json.dumps({"model": "m"}).encode())
    assert reply.status == 400
    assert "'messages'" in reply.json()["error"]["message"]


def test_gzip_body_is_understood_and_reaches_the_engine_inflated(stack: Stack, texts: dict[str, str]) -> None:
    body = chat(texts["8k"])
    reply = stack.send(gzip.compress(body), headers={"content-encoding": "gzip"})
    assert reply.status == 200, reply.body
    assert reply.json() == {"pool": "long", "body_bytes": len(body)}
    assert "content-encoding" not in stack.upstreams.received[-1].headers


def test_json_sent_as_a_form_is_sized_like_json(stack: Stack, texts: dict[str, str]) -> None:
    """`curl -d` labels JSON as a form; engines parse it anyway, so the gate sizes it."""
    reply = stack.send(chat(texts["8k"]), headers={"content-type": "application/x-www-form-urlencoded"})
    assert reply.status == 200, reply.body
    assert reply.json()["pool"] == "long"
    assert reply.headers["x-kvgate-reason"] == "long"


def test_gzip_bomb_gets_413_and_reaches_no_engine(stack: Stack) -> None:
    """Envoy inflates request bodies; past its buffer limit it answers 413 itself (the gate's own
    inflation, the fallback without Envoy's decompressor, answers 413 body_too_large)."""
    before = len(stack.upstreams.received)
    bomb = gzip.compress(b'{"messages": "' + b"a" * (80 * 1024 * 1024) + b'"}')
    reply = stack.send(bomb, headers={"content-encoding": "gzip"})
    assert reply.status == 413
    assert len(stack.upstreams.received) == before


def test_10mb_body_reaches_the_gate_not_an_envoy_413(stack: Stack) -> None:
    image = "data:image/png;base64," + base64.b64encode(bytes(7_500_000)).decode()
    body = json.dumps(
        {
            "model": "vision",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": image}},
                    ],
                }
            ],
        }
    ).encode()
    assert len(body) > 10_000_000
    reply = stack.send(body)
    assert reply.status == 200, reply.body[:300]
    assert reply.json() == {"pool": "interactive", "body_bytes": len(body)}


def test_10mb_of_text_gets_the_gates_413(stack: Stack) -> None:
    reply = stack.send(chat("word " * 2_000_000))
    assert reply.status == 413
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_bodiless_and_unknown_paths_pass_through(stack: Stack) -> None:
    assert stack.send(None, path="/v1/models").json()["pool"] == "interactive"  # type: ignore[arg-type]
    reply = stack.send(b"plain text", path="/v1/audio/transcriptions", headers={"content-type": "text/plain"})
    assert reply.json() == {"pool": "interactive", "body_bytes": len(b"plain text")}
    assert stack.upstreams.received[-1].headers["x-kvgate-reason"] == "unparsed"


def test_gate_killed_fails_open_by_size(stack: Stack, texts: dict[str, str], tmp_path: Path) -> None:
    """Kill the gate mid-test: small requests still flow, to interactive; a long one gets Envoy's 503
    rather than the interactive engine's 400 (test_failopen); a forged header picks neither."""
    ports = dict(stack.ports, gate=free_port(), listener=free_port(), admin=free_port())
    envoy = _envoy_for(ports, tmp_path, stack.envoy_source)
    try:
        with gate_process(stack.config_text, tmp_path, ports["gate"]) as gate:
            assert post(ports["listener"], CHAT, chat(texts["8k"])).json()["pool"] == "long"
            gate.signal(signal.SIGKILL)
            gate.process.wait(10)
            for headers in ({}, {"x-kvgate-pool": "long", "x-kvgate-endpoint": f"127.0.0.1:{ports['long']}"}):
                refused = post(ports["listener"], CHAT, chat(texts["8k"]), headers)
                assert refused.status == 503, refused.body
                assert refused.headers["x-kvgate-reason"] == "gate_unavailable"
                reply = post(ports["listener"], CHAT, chat("Say hello."), headers)
                assert reply.status == 200, reply.body
                assert reply.json()["pool"] == "interactive"
                assert "x-kvgate-pool" not in stack.upstreams.received[-1].headers
    finally:
        envoy.stop()


def _envoy_for(ports: dict[str, int], tmp: Path, source: Path) -> Service:
    config = render_envoy(source, tmp / "envoy.yaml", ports)
    return envoy_process(config, tmp, ports["admin"], ports["listener"])


def test_a_request_that_holds_nothing_is_let_go_by_the_gate_once_routed(
    stack: Stack, texts: dict[str, str]
) -> None:
    """The gate ends a stream whose request holds no reservation as soon as it has answered, and Envoy
    carries the request on: the gate's stream is closed while the engine still holds the request."""
    admin = stack.ports["admin"]
    before = envoy_stats(admin)
    replies = []
    worker = threading.Thread(
        target=lambda: replies.append(stack.send(chat(texts["short"]), headers={"x-test-delay": "5"}))
    )
    worker.start()
    until(lambda: stack.upstreams.in_flight.get("interactive", 0) > 0, "the request at the engine")
    until(
        lambda: envoy_stats(admin).get("streams_closed", 0) > before.get("streams_closed", 0),
        "the gate's close of its stream, seen by Envoy",
    )
    assert stack.upstreams.in_flight["interactive"] == 1, "closed while the engine still answers"
    worker.join(30)
    assert [r.status for r in replies] == [200] and replies[0].json()["pool"] == "interactive"
    assert envoy_stats(admin).get("streams_failed", 0) == before.get("streams_failed", 0)


def test_sigterm_drains_in_flight_requests(stack: Stack, texts: dict[str, str], tmp_path: Path) -> None:
    """A stopping gate loses no request in flight. (This one holds no reservation, so the gate let its
    stream go once it had answered; test_e2e_headroom drains one that holds a reservation.)"""
    ports = dict(stack.ports, gate=free_port(), listener=free_port(), admin=free_port())
    envoy = _envoy_for(ports, tmp_path, stack.envoy_source)
    results: list[int | str] = []
    try:
        with gate_process(stack.config_text, tmp_path, ports["gate"]) as gate:

            def slow_request() -> None:
                reply = post(ports["listener"], CHAT, chat(texts["8k"]), {"x-test-delay": "2"})
                results.append(reply.json()["pool"] if reply.status == 200 else reply.status)

            worker = threading.Thread(target=slow_request)
            worker.start()
            # In flight: at the long pool, which answers after 2 s.
            until(lambda: stack.upstreams.in_flight.get("long", 0) > 0, "the request at the long pool")
            started = time.monotonic()
            gate.signal(signal.SIGTERM)
            worker.join(15)
            code = gate.process.wait(15)
            waited = time.monotonic() - started
            assert results == ["long"], gate.log()
            assert code == 0
            assert waited < 10, "the drain should end when the last stream ends, not at drain_seconds"
            assert "draining" in gate.log()
    finally:
        envoy.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels` (label order does not matter)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} sample with {labels}")


def test_metrics_show_decisions(stack: Stack, texts: dict[str, str]) -> None:
    stack.send(chat(texts["short"]))
    stack.send(chat(texts["20k"]))
    reply = post(stack.gate.metrics_port, "/metrics", None)  # type: ignore[arg-type]
    text = reply.body.decode()
    assert reply.status == 200
    decisions = "kvgate_gate_decisions_total"
    assert metric_value(text, decisions, method="fast", reason="short", target="interactive") >= 1
    assert metric_value(text, decisions, reason="too_long", target="413") >= 1
    assert metric_value(text, "kvgate_gate_decision_duration_seconds_count", method="fast") >= 1
    assert metric_value(text, "kvgate_gate_envoy_messages_total", kind="request_body") >= 2
    assert metric_value(text, "kvgate_gate_exact_counts_pending") == 0
    # Too few exact counts yet to correct the fast estimate by.
    assert metric_value(text, "kvgate_gate_estimate_correction", model="*") == 1.0
