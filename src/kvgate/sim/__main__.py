"""`python -m kvgate.sim ARGS`: the same as `kvgate sim ARGS`, without the rest of the CLI."""

from __future__ import annotations

import argparse
import logging
import sys

from kvgate.errors import ConfigError, ListenError
from kvgate.sim.cli import register


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.sim")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", *sys.argv[1:]])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvgate sim: configuration error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
