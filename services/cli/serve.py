"""``hadar serve SERVICE``: run one service until SIGTERM, then drain it.

Every service serves ``/healthz`` and ``/metrics`` on ``--http-host`` (default
``$HADAR_HTTP_HOST``, else 127.0.0.1: loopback in development; the stack sets 0.0.0.0)
``:--http-port`` (default ``$HADAR_HTTP_PORT``, else the service's own port; the image sets 8080,
which its HEALTHCHECK probes) and logs structlog JSON to stderr. ``/healthz`` reports state and the
kind of the last error, never an exception's text. Each service adds its own flags from its package
(`services/<name>/cli.py`).
"""

from __future__ import annotations

import argparse
import os

from shared.errors import UsageError
from shared.runtime.connection import add_bus_args

DEFAULT_HTTP_HOST = "127.0.0.1"


def _env_port(default: int) -> int:
    text = os.environ.get("HADAR_HTTP_PORT", "").strip()
    if not text:
        return default
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise UsageError(f"HADAR_HTTP_PORT: expected a port number, got {text!r}")
    return int(text)


def add_common(parser: argparse.ArgumentParser, *, http_port: int) -> None:
    add_bus_args(parser)
    parser.add_argument("--http-port", type=int, default=_env_port(http_port),
                        help=f"port of /healthz and /metrics (default: $HADAR_HTTP_PORT or {http_port})")
    parser.add_argument("--http-host", default=os.environ.get("HADAR_HTTP_HOST") or DEFAULT_HTTP_HOST,
                        help="address of /healthz and /metrics (default: $HADAR_HTTP_HOST or "
                             f"{DEFAULT_HTTP_HOST}; 0.0.0.0 for all interfaces)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0, help="SIGTERM drain deadline")
    parser.add_argument("--log-level", default="INFO")


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a service (scheduler, agent, tracker, profiler)")
    services = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")

    from services.agent.cli import add_agent_parser
    from services.profiler.cli import add_profiler_parser
    from services.scheduler.cli import add_scheduler_parser
    from services.tracker.cli import add_tracker_parser
    for add in (add_scheduler_parser, add_agent_parser, add_tracker_parser, add_profiler_parser):
        add(services, add_common)
