"""`kvgate agent` as a process: flags, SIGTERM, and a gate's view across a kill -9 and a restart."""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys

import pytest
from waiting import PATIENCE_S, until_async

from kvgate.agent.cli import register, settings_from_args
from kvgate.config.headroom import HeadroomSettings
from kvgate.errors import ConfigError
from kvgate.headroom.snapshot import CapacitySource
from kvgate.headroom.view import HeadroomView
from kvgate.localports import free_port

# The agent subcommand through its own parser, as kvgate.cli will call it once registered.
LAUNCH = (
    "import argparse, logging, sys; from kvgate.agent.cli import register; "
    "logging.basicConfig(level='INFO'); p = argparse.ArgumentParser(); register(p.add_subparsers()); "
    "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["agent", "--listen", "127.0.0.1:0", "--endpoint", "127.0.0.1:8000", *argv])


def test_flags_build_node_settings() -> None:
    settings = settings_from_args(
        parse("--capacity-tokens", "40000", "--period-ms", "50", "--node-name", "gpu-7")
    )
    assert settings.unreserved_request_tokens == 4096
    assert (settings.node, settings.capacity_tokens, settings.period_s, settings.safety_ratio) == (
        "gpu-7",
        40_000,
        0.05,
        0.9,
    )
    shaped = settings_from_args(
        parse(
            "--nvml",
            "fake",
            "--kv-layers",
            "61",
            "--kv-lora-rank",
            "512",
            "--qk-rope-head-dim",
            "64",
            "--kv-dtype",
            "fp8",
        )
    )
    assert shaped.model_shape is not None and shaped.model_shape.dtype_bytes == 1.0


METRICS = ("--engine-metrics", "http://127.0.0.1:8000/metrics")
EVENTS = ("--engine-kv-events", "tcp://127.0.0.1:5557")


def test_kv_event_flags_name_where_the_agent_listens() -> None:
    bound = settings_from_args(parse(*METRICS, *EVENTS, "--engine-kv-events-replay", "tcp://127.0.0.1:5558"))
    assert (bound.kv_events, bound.kv_events_max_blocks) == ("tcp://127.0.0.1:5557", 262_144)
    connected = settings_from_args(parse(*METRICS, "--engine-kv-events-connect", "tcp://10.0.0.7:5557"))
    assert connected.kv_events == "tcp://10.0.0.7:5557"
    assert settings_from_args(parse(*METRICS)).kv_events == ""
    with pytest.raises(SystemExit):  # one or the other
        parse(*METRICS, *EVENTS, "--engine-kv-events-connect", "tcp://10.0.0.7:5557")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "needs a capacity"),
        (("--capacity-tokens", "0"), "must be > 0"),
        (("--capacity-tokens", "5", "--safety-ratio", "1.5"), "safety-ratio"),
        (("--capacity-tokens", "5", "--period-ms", "1"), "period-ms"),
        (
            ("--nvml", "off", "--kv-layers", "32", "--kv-heads", "8", "--head-dim", "128"),
            "needs --nvml on or fake",
        ),
        (("--nvml", "fake", "--kv-layers", "32"), "model shape"),
        (("--capacity-tokens", "5", "--default-lease-s", "600", "--max-lease-s", "60"), "leases"),
        (("--capacity-tokens", "5", "--gpu-memory-utilization", "0"), "gpu-memory-utilization"),
        (("--engine-metrics", "https://127.0.0.1:8000/metrics"), "--engine-metrics must be an http://"),
        (("--capacity-tokens", "5", "--unreserved-request-tokens", "-1"), "--unreserved-request-tokens"),
        (("--capacity-tokens", "5", "--engine-kv-events", "tcp://127.0.0.1:5557"), "needs --engine-metrics"),
        ((*METRICS, "--engine-kv-events", "127.0.0.1:5557"), "must be a ZeroMQ endpoint"),
        ((*METRICS, "--engine-kv-events", "tcp://*:5557"), "not a wildcard"),
        ((*METRICS, "--engine-kv-events-replay", "tcp://127.0.0.1:5558"), "needs --engine-kv-events"),
        ((*METRICS, *EVENTS, "--engine-kv-events-max-blocks", "0"), "max-blocks must be >= 1"),
    ],
)
def test_bad_flags_are_config_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings_from_args(parse(*argv))


def start_agent(port: int, *extra: str) -> subprocess.Popen[str]:
    argv = [
        "agent",
        "--listen",
        f"127.0.0.1:{port}",
        "--endpoint",
        "127.0.0.1:8000",
        "--metrics-listen",
        "off",
        "--period-ms",
        "50",
        *extra,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == f"kvgate agent listening on 127.0.0.1:{port}", (
        proc.stderr.read() if proc.stderr else ""
    )
    return proc


def stop(proc: subprocess.Popen[str], sig: int) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=10)
    finally:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.slow
def test_sigterm_stops_the_agent_cleanly() -> None:
    proc = start_agent(free_port(), "--nvml", "fake", "--fake-gpus", "2", "--capacity-tokens", "1000")
    assert stop(proc, signal.SIGTERM) == 0


@pytest.mark.slow
def test_view_survives_agent_kill_and_restart() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    fast = HeadroomSettings(
        agents=(address,),
        stale_after_s=0.2,
        idle_timeout_s=0.5,
        reconnect_initial_s=0.05,
        reconnect_max_s=0.2,
    )

    async def wait_for(view: HeadroomView, connected: bool) -> None:
        async with asyncio.timeout(PATIENCE_S):
            while view.snapshot()[0].connected != connected or (connected and not view.snapshot()[0].fresh):
                await asyncio.sleep(0.02)

    async def scenario() -> None:
        proc = start_agent(
            port, "--nvml", "fake", "--kv-layers", "32", "--kv-heads", "8", "--head-dim", "128"
        )
        view = HeadroomView(fast)
        await view.start()
        try:
            await wait_for(view, connected=True)
            node = view.snapshot()[0].headroom
            assert node is not None and node.capacity_source is CapacitySource.STATIC and len(node.gpus) == 8
            assert (await view.reserve(address, "burst-1", 12_000)).granted
            stop(proc, signal.SIGKILL)
            await wait_for(view, connected=False)
            # Silent past stale_after_s: no longer fresh.
            await until_async(lambda: not view.snapshot()[0].fresh, "the killed agent's node to go stale")
            proc = start_agent(port, "--nvml", "fake", "--capacity-tokens", "40000")
            await wait_for(view, connected=True)
            restarted = view.snapshot()[0].headroom
            assert (
                restarted is not None
                and restarted.capacity_tokens == 40_000
                and restarted.reserved_tokens == 0
            )
        finally:
            await view.stop()
            if proc.poll() is None:
                assert stop(proc, signal.SIGTERM) == 0

    asyncio.run(scenario())
