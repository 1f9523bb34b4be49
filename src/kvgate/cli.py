"""The `kvgate` command. Each subcommand lives beside the code it runs and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
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
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="what to log"
    )
    version = importlib.metadata.version("kvgate")
    parser.add_argument("--version", action="version", version=f"kvgate {version}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    for command in (parser, *subparsers.choices.values()):
        command.formatter_class = _with_defaults(command.formatter_class)
    return parser


class _DefaultsShown(argparse.HelpFormatter):
    """Appends each option's default to its help where the help does not give it already: an operator
    reading `--help` should not have to read the code to learn what a flag left out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        default = action.default
        if (
            not text
            or "default" in text
            or not action.option_strings
            or action.nargs == 0  # a switch (store_true, version): its default says nothing
            or default is None
            or default is argparse.SUPPRESS
            or default in ("", [], ())
        ):
            return text
        return f"{text} (default %(default)s)"


def _with_defaults(formatter: object) -> type[argparse.HelpFormatter]:
    """A command's formatter class (each keeps its own wrapping of descriptions) that also shows
    defaults."""
    if not isinstance(formatter, type) or issubclass(formatter, _DefaultsShown):
        return _DefaultsShown
    return type(f"DefaultsShown{formatter.__name__}", (_DefaultsShown, formatter), {})


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
