"""``hadar`` entry point.

Each subcommand lives in its own module of this package exposing
``register(subparsers) -> None``; the parser it adds sets ``func`` (called with the parsed
args; its return value is the exit code). Bad usage exits with code 2 and a one-line
error, as argparse does.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shared.errors import UsageError

# Modules of this package that add subcommands, in help order.
COMMANDS: tuple[str, ...] = (
    "jobs",          # submit, jobs, status, watch, cancel, model
    "serve",
    "demo",
    "sim",
    "replay",
    "consolidate",
    "infra",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hadar", description="Heterogeneity-aware DL cluster scheduler")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"services.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except UsageError as exc:
        print(f"hadar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy, so UsageError is one class.
    from services.cli import main as cli

    sys.exit(cli.main())
