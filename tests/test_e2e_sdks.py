"""The official OpenAI and Anthropic SDKs against the real Envoy and gate: each raises its own typed
exception for the gate's refusals, with the gate's message, and retries only what it may."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from kvgate.harness.envoy import render_envoy
from kvgate.harness.stack import envoy_process, gate_process
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

pytestmark = pytest.mark.slow

ENVOY_YAML = Path(__file__).resolve().parent.parent / "envoy" / "envoy.yaml"
LONG_PROMPT = "word " * 6000  # about 7,500 tokens: long, below the 16,384 limit


@pytest.fixture
def listener(tmp_path: Path, pools: tuple[dict[str, int], Upstreams]) -> Iterator[int]:
    """Envoy and a gate whose only long-pool agent is unreachable: long requests get 503."""
    pool_ports, _ = pools
    ports = {**pool_ports, "listener": free_port(), "gate": free_port(), "admin": free_port()}
    envoy = envoy_process(
        render_envoy(ENVOY_YAML, tmp_path / "envoy.yaml", ports), tmp_path, ports["admin"], ports["listener"]
    )
    config = f"headroom: {{agents: ['127.0.0.1:{free_port()}']}}\n"
    try:
        with gate_process(config, tmp_path, ports["gate"]):
            yield ports["listener"]
    finally:
        envoy.stop()


def test_openai_sdk(listener: int) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{listener}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as too_long:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20000
        )
    assert too_long.value.status_code == 413
    assert too_long.value.code == "context_length_exceeded"
    assert "20000" in str(too_long.value.message)
    with pytest.raises(openai.InternalServerError) as no_node:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": LONG_PROMPT}])
    assert no_node.value.status_code == 503
    assert no_node.value.code == "no_healthy_node"
    assert no_node.value.response.headers["retry-after"] == "2"


def test_anthropic_sdk(listener: int) -> None:
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{listener}", api_key="unused", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as too_long:
        client.messages.create(model="m", max_tokens=20000, messages=[{"role": "user", "content": "hi"}])
    assert too_long.value.status_code == 413
    assert isinstance(too_long.value.body, dict)
    assert too_long.value.body["error"]["type"] == "request_too_large"
    assert "20000" in too_long.value.body["error"]["message"]
    with pytest.raises(anthropic.ServiceUnavailableError) as no_node:
        client.messages.create(model="m", max_tokens=100, messages=[{"role": "user", "content": LONG_PROMPT}])
    assert isinstance(no_node.value.body, dict)
    assert no_node.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": no_node.value.body["error"]["message"]},
    }
    assert "No long-context node" in no_node.value.body["error"]["message"]
