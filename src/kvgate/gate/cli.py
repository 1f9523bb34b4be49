"""`kvgate gate`: the ext_proc server."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from kvgate.addresses import listen_or_off, split_host_port
from kvgate.config import Config, load_config
from kvgate.errors import ConfigError
from kvgate.listening import check_listen


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "gate",
        help="run the Envoy ext_proc server",
        description=(
            "Serve envoy.service.ext_proc.v3.ExternalProcessor: read each request's body, estimate its "
            "tokens and set x-kvgate-pool (or answer 400/413/429/503 itself). Either Envoy set-up works "
            "unchanged: two round trips (headers, then body: envoy/envoy.yaml) or one (the body with "
            "request attributes, routes on the gate's dynamic metadata: envoy/envoy-one-trip.yaml). "
            "Also serves the standard gRPC health service on the same port. SIGTERM drains in-flight "
            "requests."
        ),
    )
    parser.add_argument("--config", type=Path, help="kvgate YAML file (default: built-in defaults)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help=(
            "tokenizer for the default model entry: a sentencepiece .model, a Hugging Face "
            "tokenizer.json or a Mistral tekken .json (without one, estimates round to the safe side)"
        ),
    )
    parser.add_argument("--listen", help="HOST:PORT to serve on (overrides server.listen)")
    parser.add_argument(
        "--workers", type=int, help="worker processes sharing the port (overrides server.workers)"
    )
    parser.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9464",
        help="HOST:PORT of the Prometheus /metrics endpoint; 'off' disables it (default 127.0.0.1:9464)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        help="OTLP/gRPC collector for decision traces, e.g. http://otel-collector:4317 "
        "(default $OTEL_EXPORTER_OTLP_ENDPOINT; unset: no traces)",
    )
    parser.set_defaults(func=run)


def resolve_config(args: argparse.Namespace) -> Config:
    config = load_config(args.config) if args.config else Config()
    server = config.server
    if args.listen:
        split_host_port(args.listen, "--listen")
        server = dataclasses.replace(server, listen=args.listen)
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
        server = dataclasses.replace(server, workers=args.workers)
    config = dataclasses.replace(config, server=server)
    if args.tokenizer:
        config = with_default_tokenizer(config, str(args.tokenizer))
    return config


def with_default_tokenizer(config: Config, tokenizer: str) -> Config:
    """Point the default entry, and every entry that inherited its tokenizer, at `tokenizer`."""
    inherited = config.default_model.tokenizer
    models = tuple(
        dataclasses.replace(m, tokenizer=tokenizer) if m.tokenizer == inherited else m for m in config.models
    )
    default_model = dataclasses.replace(config.default_model, tokenizer=tokenizer)
    return dataclasses.replace(config, default_model=default_model, models=models)


def run(args: argparse.Namespace) -> int:
    from kvgate.gate.server import run_gate

    metrics_listen = listen_or_off(args.metrics_listen, "--metrics-listen")
    config = resolve_config(args)
    # Before any worker starts: workers share their port (SO_REUSEPORT), and would share it with
    # another gate's just as well.
    check_listen(
        *split_host_port(config.server.listen, "server.listen"),
        "--listen" if args.listen else "server.listen",
    )
    return run_gate(config, metrics_listen, args.otlp_endpoint)
