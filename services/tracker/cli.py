"""``hadar serve tracker``: flags and runner (wired by services/cli/serve.py)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from shared.connect import add_store_args, make_bus, make_store
from shared.errors import UsageError
from shared.logging import configure_logging
from shared.service import run_service

__all__ = ["add_tracker_parser", "run_tracker"]

DEFAULT_HTTP_PORT = 8083


def add_tracker_parser(services: argparse._SubParsersAction,
                       add_common: Callable[..., None]) -> argparse.ArgumentParser:
    parser = services.add_parser("tracker", help="aggregate progress, consolidate copies, complete jobs")
    add_common(parser, http_port=DEFAULT_HTTP_PORT)
    add_store_args(parser)
    parser.add_argument("--group", default="tracker", help="consumer group id")
    parser.add_argument("--uniform", action="store_true",
                        help="average copies uniformly instead of by the steps each did")
    parser.add_argument("--finish-timeout-s", type=float, default=120.0,
                        help="how long after a round's deadline to wait for missing copies")
    parser.add_argument("--tick-s", type=float, default=1.0, help="how often due rounds are checked")
    parser.add_argument("--temp-dir", default=None, help="where consolidated models are staged")
    parser.set_defaults(func=run_tracker)
    return parser


def run_tracker(args: argparse.Namespace) -> int:
    from services.tracker.service import TrackerConfig, TrackerService  # heavy (torch, numpy): only when run

    try:
        config = TrackerConfig(group=args.group, mode="uniform" if args.uniform else "steps",
                               finish_timeout_s=args.finish_timeout_s, tick_s=args.tick_s,
                               temp_dir=args.temp_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    bus = make_bus(args, source="tracker")
    store = make_store(args)
    configure_logging("tracker", level=args.log_level)

    async def run() -> None:
        await bus.start()
        await store.start()
        try:
            service = TrackerService(bus=bus, store=store, config=config)
            await run_service(service, http_host=args.http_host, http_port=args.http_port,
                              drain_timeout_s=args.drain_timeout_s)
        finally:
            await store.stop()
            await bus.stop()

    asyncio.run(run())
    return 0
