"""The `kvgate` command. Each subcommand lives beside the code it runs and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvgate.errors import ConfigError, ListenError

# Modules that each define `register(subparsers)`; kept as names so `kvgate --help` imports little.
SUBCOMMAND_MODULES = (
    "kvgate.gate.cli",
    "kvgate.agent.cli",
    "kvgate.envoyconfig.cli",
    "kvgate.estimate.cli",
    "kvgate.sim.cli",
    "kvgate.demo.cli",
    "kvgate.queue.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description=(
            "Admission gate for LLM inference traffic: an Envoy ext_proc server that estimates each "
            "request's tokens and routes it to the interactive pool, the long-context pool, the async "
            "cluster, or refuses it with a clear error."
        ),
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvgate: configuration error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
