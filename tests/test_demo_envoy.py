"""The demo's Envoy bootstraps: ports filled in, and accepted by the real Envoy binary."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.config import parse_config
from kvgate.demo.envoy_config import baseline_bootstrap, kvgate_bootstrap, write_yaml
from kvgate.demo.processes import find_envoy
from kvgate.demo.scenario import parse_scenario
from kvgate.demo.stacks import gate_config
from kvgate.errors import ConfigError

REPO_ENVOY = Path(__file__).resolve().parent.parent / "envoy" / "envoy.yaml"


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


def test_kvgate_run_keeps_the_repo_config_and_moves_its_ports() -> None:
    pools = {"interactive": [21000], "long_context": [21001, 21002], "async": []}
    config = kvgate_bootstrap(REPO_ENVOY, 20000, 20001, 20002, pools)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert ports_of(clusters["kvgate_gate"]) == [20002]
    assert ports_of(clusters["interactive"]) == [21000]
    assert ports_of(clusters["long_context"]) == [21001, 21002]
    assert ports_of(clusters["async"]) == []
    assert config["admin"]["address"]["socket_address"]["port_value"] == 20001
    # Everything else is the repository's: the ext_proc filter and the routes on x-kvgate-pool.
    original = kvgate_bootstrap(REPO_ENVOY, 10000, 9901, 9002, {})
    listener = config["static_resources"]["listeners"][0]
    assert listener["filter_chains"] == original["static_resources"]["listeners"][0]["filter_chains"]


def test_a_config_without_the_expected_clusters_is_a_config_error(tmp_path: Path) -> None:
    path = write_yaml(baseline_bootstrap(1, 2, [3]), tmp_path / "other.yaml")
    with pytest.raises(ConfigError, match="kvgate_gate"):
        kvgate_bootstrap(path, 20000, 20001, 20002, {"interactive": [1]})


def test_the_gate_config_loads() -> None:
    scenario = parse_scenario("node: {max_model_len: 40960, interactive_max_model_len: 4096}")
    config = parse_config(yaml.safe_dump(gate_config(scenario, 9100, [9200, 9201])), "demo gate")
    assert config.server.listen == "127.0.0.1:9100"
    assert config.default_model.max_total_tokens == 40960
    assert config.headroom.agents == ("127.0.0.1:9200", "127.0.0.1:9201")
    assert config.admission.max_wait_s == 3.5


@pytest.mark.slow
def test_real_envoy_accepts_both_bootstraps(tmp_path: Path) -> None:
    envoy_accepts(baseline_bootstrap(20000, 20001, [21000, 21001]), tmp_path)
    pools = {"interactive": [21000], "long_context": [21001], "async": []}
    envoy_accepts(kvgate_bootstrap(REPO_ENVOY, 20000, 20001, 20002, pools), tmp_path)
