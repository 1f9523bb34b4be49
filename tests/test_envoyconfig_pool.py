"""`kvgate envoy-config --inference-pool`: Envoy as an InferencePool's gateway with the gate as its
endpoint picker. The render says what envoy/envoy-inferencepool.yaml says, the real Envoy accepts it,
and it serves requests on the engines the picker names; bad flags and configs are named."""

from __future__ import annotations

import argparse
import subprocess
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_soft_pools import node_agent, sim_node
from texts import text_with_tokens
from waiting import until

from kvgate.envoyconfig.cli import register
from kvgate.errors import ConfigError
from kvgate.harness.client import chat, post
from kvgate.harness.processes import find_envoy
from kvgate.harness.stack import envoy_process, gate_process
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "envoy" / "envoy-inferencepool.yaml"
CHAT = "/v1/chat/completions"
PICKER_CONFIG = (
    "server: {protocol: endpoint-picker}\n"
    "headroom: {agents: ['10.0.1.5:9003']}\n"
    "interactive_headroom: {agents: ['10.0.1.6:9003']}\n"
)


def render(tmp: Path, config: str, *argv: str) -> dict[str, Any]:
    (tmp / "kvgate.yaml").write_text(config, encoding="utf-8")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp / "envoy.yaml"
    args = parser.parse_args(
        [
            "envoy-config",
            "--config",
            str(tmp / "kvgate.yaml"),
            "--inference-pool",
            "--output",
            str(out),
            *argv,
        ]
    )
    assert args.func(args) == 0
    rendered: dict[str, Any] = yaml.safe_load(out.read_text())
    return rendered


def manager(bootstrap: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return found


def ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (found,) = (f for f in manager(bootstrap)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    config: dict[str, Any] = found["typed_config"]
    return config


def pool(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (found,) = (c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "inference_pool")
    return found


def test_the_render_says_what_the_shipped_pool_gateway_says(tmp_path: Path) -> None:
    shipped = yaml.safe_load(SHIPPED.read_text())
    rendered = render(tmp_path, PICKER_CONFIG, "--endpoint", "10.0.0.5:8000", "--endpoint", "10.0.0.6:8000")

    for key in ("processing_mode", "metadata_options"):
        assert ext_proc(rendered)[key] == ext_proc(shipped)[key], key
    # The render leaves out what is false by default; the shipped file says it.
    assert (
        ext_proc(rendered).get("failure_mode_allow", False)
        is ext_proc(shipped)["failure_mode_allow"]
        is False
    )
    assert pool(rendered)["load_balancing_policy"] == pool(shipped)["load_balancing_policy"]
    (route,) = manager(rendered)["route_config"]["virtual_hosts"][0]["routes"]
    assert (
        route["route"]["retry_policy"]
        == manager(shipped)["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]["retry_policy"]
    )
    removed = {
        m["remove"]
        for m in manager(shipped)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    }
    stripped = {
        m["remove"]
        for m in manager(rendered)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    }
    assert removed <= stripped, removed - stripped
    endpoints = pool(rendered)["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["address"] for e in endpoints] == [
        "10.0.0.5",
        "10.0.0.6",
    ]
    open_render = render(tmp_path, PICKER_CONFIG, "--endpoint", "10.0.0.5:8000", "--failure-mode", "FailOpen")
    assert ext_proc(open_render)["failure_mode_allow"] is True


def test_the_real_envoy_accepts_the_render(tmp_path: Path) -> None:
    render(tmp_path, PICKER_CONFIG, "--endpoint", "10.0.0.5:8000", "--endpoint", "[fd00::6]:8000")
    result = subprocess.run(
        [
            str(find_envoy()),
            "--mode",
            "validate",
            "-c",
            str(tmp_path / "envoy.yaml"),
            "--disable-hot-restart",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        ("", ["--endpoint", "10.0.0.5:8000"], "server.protocol is 'kvgate'"),
        (PICKER_CONFIG, [], "one --endpoint HOST:PORT or more"),
        (
            PICKER_CONFIG,
            ["--endpoint", "engine-0.vllm:8000"],
            "--endpoint engine-0.vllm:8000: give the engine's IP",
        ),
        (PICKER_CONFIG, ["--endpoint", "10.0.0.5:8000", "--endpoint", "10.0.0.5:8000"], "given twice"),
        (
            PICKER_CONFIG,
            ["--endpoint", "10.0.0.5:8000", "--pool", "long=10.0.0.6:8000"],
            "--pool does not apply",
        ),
        (
            PICKER_CONFIG,
            ["--endpoint", "10.0.0.5:8000", "--round-trips", "1"],
            "--round-trips does not apply",
        ),
    ],
)
def test_what_cannot_work_is_refused_naming_the_key_or_flag(
    tmp_path: Path, config: str, argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("'", "'")):
        render(tmp_path, config, *argv)


def test_pool_flags_without_inference_pool_are_refused(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "envoy-config",
            "--pool",
            "interactive=10.0.0.5:8000",
            "--pool",
            "long=10.0.0.6:8000",
            "--endpoint",
            "10.0.0.7:8000",
        ]
    )
    with pytest.raises(ConfigError, match="--endpoint is for --inference-pool"):
        args.func(args)


@pytest.mark.slow
def test_the_rendered_gateway_sends_each_request_to_the_engine_the_picker_named(
    tmp_path: Path, sp_model_path: Path
) -> None:
    with ExitStack() as stack:
        long_node = sim_node(stack, tmp_path, "long", sp_model_path)
        chat_node = sim_node(stack, tmp_path, "interactive", sp_model_path)
        long_agent = node_agent(stack, tmp_path, long_node)
        chat_agent = node_agent(stack, tmp_path, chat_node, "--role", "interactive")
        listener, gate_port, admin = free_port(), free_port(), free_port()
        config = (
            "server: {protocol: endpoint-picker}\n"
            + "default_model: {max_total_tokens: 16384, interactive_max_tokens: 1024, "
            + f"tokenizer: {sp_model_path}}}\n"
            + f"headroom: {{agents: ['127.0.0.1:{long_agent.port}']}}\n"
            + f"interactive_headroom: {{agents: ['127.0.0.1:{chat_agent.port}']}}\n"
            + "soft_pools: {borrow: false}\n"
        )
        render(
            tmp_path,
            config,
            *("--endpoint", f"127.0.0.1:{chat_node.port}", "--endpoint", f"127.0.0.1:{long_node.port}"),
            *("--listen", f"127.0.0.1:{listener}", "--gate", f"127.0.0.1:{gate_port}"),
            *("--admin-port", str(admin), "--ready-port", str(free_port())),
        )
        envoy = envoy_process(tmp_path / "envoy.yaml", tmp_path, admin, listener)
        stack.callback(envoy.stop)
        stack.enter_context(gate_process(config, tmp_path, gate_port))
        until(lambda: post(listener, CHAT, chat("hello", max_tokens=4)).status == 200, "a chat answered")

        short = post(listener, CHAT, chat("what is the capital of France?", max_tokens=4))
        long = post(listener, CHAT, chat(text_with_tokens(sp_model_path, 6_000), max_tokens=20), timeout=60)
        too_long = post(listener, CHAT, chat(text_with_tokens(sp_model_path, 20_000), max_tokens=20))

    assert (short.status, short.headers.get("x-kvgate-sim-node")) == (200, "interactive")
    assert (long.status, long.headers.get("x-kvgate-sim-node")) == (200, "long")
    assert long.headers.get("x-kvgate-reason") == "long"
    assert too_long.status == 413 and too_long.json()["error"]["code"] == "context_length_exceeded"
