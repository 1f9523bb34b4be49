"""A long request that waits for room waits in the gate, through the real Envoy: past Envoy's ext_proc
message_timeout (the gate asks Envoy for more time, override_message_timeout), admitted when room
frees, answered 200 by its node, and never handed to the async pool (`kvgate queue`'s intake: here a
recording upstream that must see nothing)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from texts import text_with_tokens
from waiting import until

from kvgate.config import parse_config
from kvgate.envoyconfig.settings import HostPort, envoy_settings
from kvgate.errors import ConfigError
from kvgate.harness.client import Reply, chat, post, post_until_admitted
from kvgate.harness.envoy import render_envoy
from kvgate.harness.stack import agent_process, envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"

# Envoy's per-message deadline in this test, shorter than the shipped 5 s so the test stays short: the
# request that waits must outlast it, and does, by the node's three requests' hold below.
MESSAGE_TIMEOUT_S = 1
# How long the upstream holds each of the three requests that fill the node: the fourth waits that
# long in the gate, more than Envoy's message_timeout.
FULL_FOR_S = 3 * MESSAGE_TIMEOUT_S


def with_message_timeout(path: Path, seconds: float) -> None:
    """Set the ext_proc filter's message_timeout in the rendered Envoy config at `path`."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "message_timeout" in node:
                node["message_timeout"] = f"{seconds}s"
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    assert len(found) == 1, "one ext_proc filter"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def envoy_stats(admin_port: int) -> dict[str, int]:
    """Envoy's ext_proc counters by their last name (message_timeouts, …)."""
    text = post(admin_port, "/stats?filter=ext_proc", None).body.decode()
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.isdigit():
            counters[name.rsplit(".", 1)[-1]] = int(value)
    return counters


def test_every_shipped_envoy_lets_the_gate_hold_as_long_as_it_holds_by_default() -> None:
    needed_s = parse_config("").admission.max_hold_s + 5
    for path in [*ROOT.glob("envoy/*.yaml"), ROOT / "envoy" / "istio" / "kvgate-istio.yaml"]:
        text = path.read_text(encoding="utf-8")
        # An endpoint picker's Envoy streams the body (FULL_DUPLEX_STREAMED): no message timeout
        # applies there, and the picker never asks for more time (docs/picker.md).
        streamed = "request_body_mode: FULL_DUPLEX_STREAMED" in text
        if "envoy.filters.http.ext_proc" in text and "message_timeout" in text and not streamed:
            (value,) = {
                line.split(":")[1].strip() for line in text.splitlines() if "max_message_timeout:" in line
            }
            assert float(value.rstrip("s")) >= needed_s, path


def test_kvgate_envoy_config_sizes_max_message_timeout_to_the_gates_hold() -> None:
    config = parse_config("admission: {max_hold_s: 100}")
    pools = {"interactive": HostPort("10.0.0.1", 8000), "long": HostPort("10.0.0.2", 8000)}
    listen = HostPort("0.0.0.0", 10000)
    assert envoy_settings(parse_config(""), pools, listen=listen).max_message_timeout_ms == 60_000
    assert envoy_settings(config, pools, listen=listen).max_message_timeout_ms == 105_000
    with pytest.raises(ConfigError, match="max_message_timeout must be at least 105000 ms"):
        envoy_settings(config, pools, listen=listen, max_message_timeout_ms=60_000)
    # No holding (max_hold_s at or below max_wait_s): any value goes.
    no_hold = parse_config("admission: {max_hold_s: 0}")
    assert envoy_settings(no_hold, pools, listen=listen, max_message_timeout_ms=1).max_message_timeout_ms == 1


def test_kvgate_envoy_config_refuses_a_message_timeout_the_gates_first_answer_would_miss() -> None:
    """Past message_timeout Envoy fails open: a wait of 10 s behind a 5 s timeout was 29 answers of
    503 `gate_unavailable` in a real-vLLM fairness trial (2026-12-04)."""
    pools = {"interactive": HostPort("10.0.0.1", 8000), "long": HostPort("10.0.0.2", 8000)}
    listen = HostPort("0.0.0.0", 10000)
    no_hold = parse_config("admission: {max_wait_s: 6, max_hold_s: 6}")
    missed = r"within admission.max_wait_s \(6 s\).*at least 6500 ms \(got 5000\)"
    with pytest.raises(ConfigError, match=missed):
        envoy_settings(no_hold, pools, listen=listen, message_timeout_ms=5000)
    assert envoy_settings(no_hold, pools, listen=listen, message_timeout_ms=6500).message_timeout_ms == 6500
    # Holding, the gate asks for more time at half the wait: 10 s needs 5.5 s.
    holds = parse_config("admission: {max_wait_s: 10}")
    with pytest.raises(ConfigError, match=r"more time at half of admission.max_wait_s.*at least 5500 ms"):
        envoy_settings(holds, pools, listen=listen, message_timeout_ms=5000)
    assert envoy_settings(holds, pools, listen=listen, message_timeout_ms=5500).message_timeout_ms == 5500
    assert envoy_settings(parse_config(""), pools, listen=listen).message_timeout_ms == 5000


@pytest.mark.slow
@pytest.mark.parametrize("envoy_file", ["envoy.yaml", "envoy-one-trip.yaml"])
def test_a_request_that_waits_past_envoys_deadline_is_held_in_the_gate_not_queued(
    tmp_path: Path, sp_model_path: Path, pools: tuple[dict[str, int], Upstreams], envoy_file: str
) -> None:
    pool_ports, upstreams = pools
    # 11,000 prompt tokens + 1,000 output: three fill the node's 40,000 tokens, a fourth must wait.
    body = chat(text_with_tokens(sp_model_path, 10_996), max_tokens=1000)
    with ExitStack() as stack:
        agent_port = free_port()
        agent = agent_process(
            tmp_path,
            "node-a",
            agent_port,
            f"127.0.0.1:{pool_ports['long']}",
            ["--capacity-tokens", "40000", "--safety-ratio", "1.0"],
        )
        stack.callback(agent.stop)
        ports = dict(pool_ports, listener=free_port(), gate=free_port(), admin=free_port())
        envoy_config = render_envoy(ROOT / "envoy" / envoy_file, tmp_path / "envoy.yaml", ports)
        with_message_timeout(envoy_config, MESSAGE_TIMEOUT_S)
        envoy = envoy_process(envoy_config, tmp_path, ports["admin"], ports["listener"])
        stack.callback(envoy.stop)
        # Without holding, this gate would hand a request still waiting after 0.4 s to the async pool.
        gate_config = (
            f"default_model: {{tokenizer: {sp_model_path}}}\n"
            f"headroom: {{agents: [127.0.0.1:{agent_port}]}}\n"
            "admission: {max_wait_s: 0.4, async_fallback: true, max_hold_s: 30}\n"
        )
        stack.enter_context(gate_process(gate_config, tmp_path, ports["gate"]))
        listener = ports["listener"]
        assert post_until_admitted(listener, body).status == 200, "the gate sees the node"

        replies: list[Reply] = []
        took: list[float] = []

        def send(delay_s: float) -> None:
            started = time.monotonic()
            reply = post(listener, CHAT, body, {"x-test-delay": str(delay_s)}, timeout=60)
            replies.append(reply)
            if not delay_s:
                took.append(time.monotonic() - started)

        fill = [threading.Thread(target=send, args=(FULL_FOR_S,)) for _ in range(3)]
        for thread in fill:
            thread.start()
        until(lambda: upstreams.in_flight.get("long") == 3, "three requests filling the node")
        waiting = threading.Thread(target=send, args=(0,))
        waiting.start()
        for thread in (*fill, waiting):
            thread.join(60)
        stats = envoy_stats(ports["admin"])

    assert [r.status for r in replies] == [200] * 4, [r.body[:200] for r in replies]
    assert [r.json()["pool"] for r in replies] == ["long"] * 4
    assert not [r for r in upstreams.received if r.pool in ("async", "interactive")], "nothing queued"
    # The fourth outlasted Envoy's message_timeout in the gate: held, never timed out (failing open).
    assert took[0] > MESSAGE_TIMEOUT_S
    assert stats["override_message_timeout_received"] >= 1, stats
    assert stats["message_timeouts"] == 0 and stats["failure_mode_allowed"] == 0, stats
