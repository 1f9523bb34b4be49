"""Shared fixtures: real tokenizer files, recording upstream pools, the real engines (the
engines_fixtures plugin); and the check, at the end of the run, that no process the tests started is
still alive."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import leftovers
import mistral_common
import pytest

from kvgate.estimate.features import WINDOW_RANDOM
from kvgate.harness.engines import NoEngines, locate_engines
from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

# Real vLLM and llama-server for the tests marked `engines`, started once per run.
pytest_plugins = ["engines_fixtures"]

TOKENIZER_DIR = Path(mistral_common.__file__).parent / "data"
# How long processes told to stop get to go before the ones still alive count as left behind.
LEFTOVER_GRACE_S = 10.0


# Where a long text's windows fall is drawn at random for every read: Hypothesis draws it for each
# example it tries (so a failure it finds replays), and every other test starts from its own seed.
hypothesis.register_random(WINDOW_RANDOM)


@pytest.fixture(autouse=True)
def _windows_seeded(request: pytest.FixtureRequest) -> None:
    WINDOW_RANDOM.seed(request.node.nodeid)


def pytest_configure(config: pytest.Config) -> None:
    # Every process the run starts inherits the mark, which is how it is found at the end.
    os.environ[leftovers.MARK] = uuid.uuid4().hex


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `engines` run last, together: the engines they share start once, late, and stop
    with the run instead of idling beside every other test."""
    items.sort(key=lambda item: item.get_closest_marker("engines") is not None)


# --- one line at the start and one at the end: whether the tests against real engines ran ---------

_engines_run = {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0}


def _engines_install_line() -> str:
    found = locate_engines()
    if isinstance(found, NoEngines):
        return f"engines: NOT INSTALLED, the tests marked engines are skipped ({found.reason})"
    return f"engines: the tests marked engines run against real vLLM and llama-server ({found.root.name})"


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(_engines_install_line())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each engines test's time, engines' start and stop included (its fixtures' setup and teardown)."""
    if "engines" not in report.keywords:
        return
    _engines_run["seconds"] += report.duration
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _engines_run[report.outcome] += 1
    elif report.when == "teardown" and report.failed:
        _engines_run["failed"] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    run = _engines_run
    if not run["passed"] + run["failed"] + run["skipped"]:
        return
    minutes, seconds = divmod(round(float(run["seconds"])), 60)
    terminalreporter.write_line(
        f"engines: {run['passed']} passed, {run['failed']} failed, {run['skipped']} skipped against real "
        f"engines in {minutes}m{seconds:02d}s (their start-up included)"
    )
    if run["skipped"] and not run["passed"] + run["failed"]:
        terminalreporter.write_line(_engines_install_line())


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
