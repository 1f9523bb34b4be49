"""gRPC's transport: kvgate's processes turn EventEngine's TCP listener and client off before grpc is
imported, and an operator's own choice in GRPC_EXPERIMENTS stands (kvgate.grpc_transport)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvgate.grpc_transport import VARIABLE, choose_transport

OFF = "-event_engine_listener,-event_engine_client"


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, OFF),
        ("", OFF),
        ("tcp_rcv_lowat", f"tcp_rcv_lowat,{OFF}"),
        (" tcp_rcv_lowat , ", f"tcp_rcv_lowat,{OFF}"),
        ("event_engine_listener", "event_engine_listener"),
        ("-event_engine_client", "-event_engine_client"),
        ("tcp_rcv_lowat,event_engine_client", "tcp_rcv_lowat,event_engine_client"),
    ],
)
def test_the_experiments_are_turned_off_unless_the_operator_named_one(before: str | None, after: str) -> None:
    environ = {} if before is None else {VARIABLE: before}
    choose_transport(environ)
    assert environ[VARIABLE] == after


# Records GRPC_EXPERIMENTS at the moment grpc is first imported, which is when gRPC reads it.
_WATCH_GRPC_IMPORT = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get({variable!r}, ""))
sys.meta_path.insert(0, Watch())
import {module}
print(seen[0])
"""


def _experiments_seen_by(module: str, environ: dict[str, str]) -> str:
    """GRPC_EXPERIMENTS as it was when importing `module` in a fresh interpreter first imported grpc."""
    program = _WATCH_GRPC_IMPORT.format(variable=VARIABLE, module=module)
    done = subprocess.run(
        [sys.executable, "-c", program], check=False, env=environ, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", ["kvgate.gate.server", "kvgate.agent.server", "kvgate.queue.service"])
def test_a_kvgate_process_chooses_before_grpc_is_imported(module: str) -> None:
    environ = {"PATH": "/usr/bin:/bin"}
    assert _experiments_seen_by(module, environ) == OFF
    chosen = {**environ, VARIABLE: "event_engine_listener"}
    assert _experiments_seen_by(module, chosen) == "event_engine_listener"
