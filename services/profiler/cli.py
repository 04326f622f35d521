"""``hadar serve profiler``: flags and runner (wired by services/cli/serve.py)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from services.profiler.state import DEFAULT_ALPHA, DEFAULT_THRESHOLD
from shared.connect import make_bus
from shared.errors import UsageError
from shared.logging import configure_logging
from shared.service import run_service

__all__ = ["add_profiler_parser", "run_profiler"]

DEFAULT_HTTP_PORT = 8084


def add_profiler_parser(services: argparse._SubParsersAction,
                        add_common: Callable[..., None]) -> argparse.ArgumentParser:
    parser = services.add_parser("profiler", help="estimate and measure jobs' throughput per GPU type")
    add_common(parser, http_port=DEFAULT_HTTP_PORT)
    parser.add_argument("--group", default="profiler", help="consumer group id")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help="EWMA weight of a new measurement, in (0, 1]")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="publish a measured rate when it moves by more than this fraction")
    parser.set_defaults(func=run_profiler)
    return parser


def run_profiler(args: argparse.Namespace) -> int:
    from services.profiler.service import ProfilerConfig, ProfilerService  # heavy (torch, numpy): only when run

    if not 0 < args.alpha <= 1:
        raise UsageError(f"--alpha: must be in (0, 1], got {args.alpha}")
    if args.threshold < 0:
        raise UsageError(f"--threshold: must be >= 0, got {args.threshold}")
    config = ProfilerConfig(group=args.group, alpha=args.alpha, threshold=args.threshold)
    bus = make_bus(args, source="profiler")
    configure_logging("profiler", level=args.log_level)

    async def run() -> None:
        await bus.start()
        try:
            await run_service(ProfilerService(bus=bus, config=config), http_host=args.http_host,
                              http_port=args.http_port, drain_timeout_s=args.drain_timeout_s)
        finally:
            await bus.stop()

    asyncio.run(run())
    return 0
