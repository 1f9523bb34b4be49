"""The demo's baseline Envoy and gate config: ports filled in, accepted by Envoy and the config loader."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.config import parse_config
from kvgate.demo.envoy_config import baseline_bootstrap, write_yaml
from kvgate.demo.scenario import parse_scenario
from kvgate.demo.stacks import gate_config
from kvgate.harness.processes import find_envoy


def ports_of(cluster: dict[str, Any]) -> list[int]:
    return [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]


def envoy_accepts(config: dict[str, Any], tmp_path: Path) -> None:
    path = write_yaml(config, tmp_path / "envoy.yaml")
    done = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_baseline_is_one_round_robin_pool() -> None:
    config = baseline_bootstrap(20000, 20001, [21000, 21001, 21002])
    (cluster,) = config["static_resources"]["clusters"]
    assert (cluster["lb_policy"], ports_of(cluster)) == ("ROUND_ROBIN", [21000, 21001, 21002])
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == 20000


def test_the_gate_config_loads() -> None:
    scenario = parse_scenario("node: {max_model_len: 40960, interactive_max_model_len: 4096}")
    config = parse_config(yaml.safe_dump(gate_config(scenario, 9100, [9200, 9201])), "demo gate")
    assert config.server.listen == "127.0.0.1:9100"
    assert config.default_model.max_total_tokens == 40960
    assert config.headroom.agents == ("127.0.0.1:9200", "127.0.0.1:9201")
    assert config.admission.max_wait_s == 3.5


@pytest.mark.slow
def test_real_envoy_accepts_the_baseline(tmp_path: Path) -> None:
    envoy_accepts(baseline_bootstrap(20000, 20001, [21000, 21001]), tmp_path)
