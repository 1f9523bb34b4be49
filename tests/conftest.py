"""Shared fixtures: real tokenizer files, recording upstream pools, the real engines (the
engines_fixtures plugin); and the check, at the end of the run, that no process the tests started is
still alive."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import leftovers
import mistral_common
import pytest

from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

# Real vLLM and llama-server for the tests marked `engines`, started once per run.
pytest_plugins = ["engines_fixtures"]

TOKENIZER_DIR = Path(mistral_common.__file__).parent / "data"
# How long processes told to stop get to go before the ones still alive count as left behind.
LEFTOVER_GRACE_S = 10.0


def pytest_configure(config: pytest.Config) -> None:
    # Every process the run starts inherits the mark, which is how it is found at the end.
    os.environ[leftovers.MARK] = uuid.uuid4().hex


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `engines` run last, together: the engines they share start once, late, and stop
    with the run instead of idling beside every other test."""
    items.sort(key=lambda item: item.get_closest_marker("engines") is not None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a process it started outlived it (a gate, a sim, an estimator's worker, …),
    naming each one; then kill them, so that one leaky run does not leave them to the next."""
    found = leftovers.settle(os.environ[leftovers.MARK], LEFTOVER_GRACE_S)
    if not found:
        return
    lines = [f"{len(found)} process(es) started by this test run are still alive:"]
    lines += [f"  {leftover.describe()}" for leftover in found]
    lines.append("Each test must stop what it starts (close pools, stop services); killed them now.")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.line("")
        reporter.write_sep("!", "processes left behind", red=True, bold=True)
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join(lines))
    leftovers.kill(found)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def sp_model_path() -> Path:
    return TOKENIZER_DIR / "mistral_instruct_tokenizer_240323.model.v3"


@pytest.fixture
def pools() -> Iterator[tuple[dict[str, int], Upstreams]]:
    """Recording upstreams for the interactive, long-context and async pools, on free ports."""
    ports = {name: free_port() for name in ("interactive", "long", "async")}
    upstreams = Upstreams(dict(ports))
    upstreams.start()
    try:
        yield ports, upstreams
    finally:
        upstreams.stop()
