"""``hadar`` entry point.

Each subcommand lives in its own module of this package exposing
``register(subparsers) -> None``; the parser it adds sets ``func`` (called with the parsed
args; its return value is the exit code). Bad usage exits with code 2 and a one-line
error, as argparse does.

The user commands (:data:`USER_COMMANDS`) keep stdout for their output alone: whatever
the process logs (structlog's, the standard library's) goes to stderr, warnings and up
only, so ``hadar status J --json | jq`` never reads a log line. Their exit codes: 0 done,
2 bad usage (or no such job), 3 the broker or object store failed (one line on stderr,
never a traceback), and ``watch``'s 1 for a cancelled job; any other 1 is a crash.
A service (``serve``) that the broker refuses for good (a non-retriable HadarError: wrong
password, untrusted certificate, denied by an ACL) logs one ``service.failed`` line and
exits 1; a retriable error still crashes with its traceback, for swarm to restart.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import structlog

from shared.errors import HadarError, UsageError

# Modules of this package that add subcommands, in help order.
COMMANDS: tuple[str, ...] = (
    "jobs",          # submit, jobs, status, watch, cancel, model
    "logs",
    "usercode",      # data put, data ls
    "queues",        # queues, queues apply
    "serve",
    "demo",
    "sim",
    "replay",
    "consolidate",
    "infra",
    "identity",      # enrol, revoke nodes (admin)
    "completion",
)
USER_COMMANDS = frozenset({"submit", "jobs", "status", "watch", "cancel", "model", "logs", "queues", "data",
                           "completion"})
EXIT_UNAVAILABLE = 3   # a user command could not reach or read the broker / object store


def package_version() -> str:
    try:
        return version("hadar")
    except PackageNotFoundError:   # run from a checkout that was never installed
        return "unknown"


def _stderr_logger(*_: Any) -> structlog.PrintLogger:
    # sys.stderr looked up per logger, not bound once: it may be swapped (tests, redirection).
    return structlog.PrintLogger(sys.stderr)


def diagnostics_to_stderr() -> None:
    """structlog prints to stdout unless configured; send it, and stdlib logging, to stderr."""
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=_stderr_logger, cache_logger_on_first_use=False)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hadar", description="Heterogeneity-aware DL cluster scheduler")
    parser.add_argument("--version", action="version", version=f"hadar {package_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"services.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in USER_COMMANDS:
        diagnostics_to_stderr()
    try:
        code = args.func(args)
    except UsageError as exc:
        print(f"hadar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except HadarError as exc:   # BusError, StoreError...: services let these crash, for swarm to restart
        if args.command not in USER_COMMANDS:
            if exc.retriable:
                raise
            # Refused for good (a wrong password, an untrusted CA, an ACL): one log line naming
            # the cause, no traceback; exit 1 all the same, so swarm still sees a failure.
            structlog.get_logger("hadar").critical("service.failed", error=str(exc).splitlines()[0][:500])
            return 1
        print(f"hadar {args.command}: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy, so UsageError is one class.
    from services.cli import main as cli

    sys.exit(cli.main())
