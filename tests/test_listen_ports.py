"""Listen addresses that mean what they say: a port that is no port is a config error naming its flag
or key."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvgate.agent.cli import register as register_agent
from kvgate.agent.cli import settings_from_args
from kvgate.cli import main
from kvgate.config import parse_config
from kvgate.errors import ConfigError

NOT_PORTS = ("127.0.0.1:99999", "127.0.0.1", "127.0.0.1:abc")


def agent_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_agent(parser.add_subparsers())
    return parser.parse_args(["agent", "--endpoint", "127.0.0.1:8000", "--capacity-tokens", "1000", *argv])


@pytest.mark.parametrize("address", NOT_PORTS)
def test_a_port_that_is_no_port_is_a_config_error_naming_its_flag_or_key(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    in_range = r"\(a port from 1 to 65535\)"
    with pytest.raises(ConfigError, match=r"^--listen: .*\(a port from 0 to 65535\)"):
        settings_from_args(agent_args("--listen", address))
    with pytest.raises(ConfigError, match=rf"^--metrics-listen: .*{in_range}"):
        settings_from_args(agent_args("--listen", "127.0.0.1:0", "--metrics-listen", address))
    with pytest.raises(ConfigError, match=rf"server.listen: .*{in_range}"):
        parse_config(f"server: {{listen: '{address}'}}\n")
    for flag in ("--listen", "--metrics-listen"):
        assert main(["gate", flag, address]) == 2
        assert re.match(rf"kvgate: configuration error: {flag}: .*{in_range}", capsys.readouterr().err)


def test_the_agent_alone_may_listen_on_port_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tests and the demo start agents on port 0 and read the port they got; the gate and the queue
    have no such reader: Envoy and the gate's own workers find them where their config says."""
    assert settings_from_args(agent_args("--listen", "127.0.0.1:0")).node
    with pytest.raises(ConfigError, match=r"server.listen: .*\(a port from 1 to 65535\)"):
        parse_config("server: {listen: '127.0.0.1:0'}\n")
    config = tmp_path / "kvgate.yaml"
    config.write_text("headroom: {agents: ['127.0.0.1:9100']}\n")
    store = f"sqlite:///{tmp_path / 'queue.db'}"
    assert main(["gate", "--listen", "127.0.0.1:0"]) == 2
    assert main(["queue", "--listen", "127.0.0.1:0", "--config", str(config), "--store", store]) == 2
    refused = "kvgate: configuration error: --listen: expected host:port, got '127.0.0.1:0' (a port from 1"
    assert [line[: len(refused)] for line in capsys.readouterr().err.splitlines()] == [refused, refused]
