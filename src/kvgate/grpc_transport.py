"""Which of gRPC's TCP transports kvgate's processes use: iomgr's listener and client, not EventEngine's.

grpcio 1.85 serves and dials TCP through its EventEngine by default (the `event_engine_listener` and
`event_engine_client` experiments, "Use EventEngine listeners instead of iomgr's grpc_tcp_server" and
"... clients instead of iomgr's grpc_tcp_client": grpc/grpc src/core/lib/experiments/experiments.yaml
at 001107da, both `default: true` in rollouts.yaml at 00dd7bb). There a message into a grpc.aio
process wakes three of its threads: an EventEngine thread reads the socket, grpc.aio's poller thread
takes the completion, and the event loop runs it. With iomgr's transport the poller thread reads the
socket itself. Measured on this project's 2-core VM (docs/benchmarks.md, "gRPC's transport"): a bare
grpc.aio server's threads woke 13.7 times a unary call with EventEngine and 7.2 without (`python -m
bench floor`); Envoy's ext_proc messages cost the gate 2.40 ms of CPU a request instead of 2.74 there,
and an agent's Reserve, FirstToken and Release 0.50 ms instead of 0.71 (`python -m bench agent`).

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
