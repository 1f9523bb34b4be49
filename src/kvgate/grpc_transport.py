"""Which of gRPC's TCP transports kvgate's processes use: iomgr's listener and client, not EventEngine's.

grpcio 1.85 serves and dials TCP through its EventEngine by default (the `event_engine_listener` and
`event_engine_client` experiments, "Use EventEngine listeners instead of iomgr's grpc_tcp_server" and
"... clients instead of iomgr's grpc_tcp_client": grpc/grpc src/core/lib/experiments/experiments.yaml
at 001107da, both `default: true` in rollouts.yaml at 00dd7bb). There a message into a grpc.aio
process wakes three of its threads: an EventEngine thread reads the socket, grpc.aio's poller thread
takes the completion, and the event loop runs it. With iomgr's transport the poller thread reads the
socket itself. Measured on this project's 2-core VM (`python -m bench floor`, its "one unary call"
line; 19 calls a second): a bare grpc.aio server took 13.9 wake-ups and 0.88-0.91 ms of CPU a call
with EventEngine, 7.1 and 0.70-0.74 ms without; its client 9.5 and 4.0 wake-ups. On the Mooncake
replay that is the gate's and every agent's CPU (docs/benchmarks.md, "gRPC's transport").

gRPC reads GRPC_EXPERIMENTS once, when `grpc` is first imported (setting it after that import
changed nothing, measured), so `kvgate/__init__.py` calls `choose_transport` before any kvgate module
imports grpc. An operator who names either experiment in GRPC_EXPERIMENTS keeps their choice:
`GRPC_EXPERIMENTS=event_engine_listener,event_engine_client` gives gRPC's default back.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VARIABLE = "GRPC_EXPERIMENTS"
EXPERIMENTS = ("event_engine_listener", "event_engine_client")


def choose_transport(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turns EXPERIMENTS off in `environ`'s GRPC_EXPERIMENTS, unless it names either already."""
    named = [item.strip() for item in environ.get(VARIABLE, "").split(",") if item.strip()]
    if any(item.lstrip("-") in EXPERIMENTS for item in named):
        return
    environ[VARIABLE] = ",".join([*named, *(f"-{experiment}" for experiment in EXPERIMENTS)])
