"""``hadar serve profiler``: flags and runner (wired by services/cli/serve.py).

Settings are a :class:`~services.profiler.service.ProfilerConfig` loaded by
:func:`shared.runtime.config.load_config`: flags over ``HADAR_PROFILER_*`` variables over the
``--config`` TOML file over the defaults. A bad value exits 2 with one line naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.profiler.state import DEFAULT_ALPHA, DEFAULT_THRESHOLD
from shared.runtime.config import add_config_arg, load_config
from shared.runtime.connection import add_store_args, make_bus, make_store
from shared.runtime.logging import configure_logging
from shared.runtime.service import run_service
from shared.security.authorship import with_authorship

if TYPE_CHECKING:
    from services.profiler.service import ProfilerConfig

__all__ = ["add_profiler_parser", "run_profiler", "profiler_config", "ENV_PREFIX"]

DEFAULT_HTTP_PORT = 8084
ENV_PREFIX = "HADAR_PROFILER_"


def add_profiler_parser(services: argparse._SubParsersAction,
                        add_common: Callable[..., None]) -> argparse.ArgumentParser:
    parser = services.add_parser("profiler", help="estimate and measure jobs' throughput per GPU type")
    add_common(parser, http_port=DEFAULT_HTTP_PORT)
    add_config_arg(parser)
    # Defaults are ProfilerConfig's: None here means "not given", so env and file can set them.
    parser.add_argument("--group", default=None, help="consumer group id (default: hadar-profiler)")
    parser.add_argument("--alpha", type=float, default=None,
                        help=f"EWMA weight of a new measurement, in (0, 1] (default: {DEFAULT_ALPHA})")
    parser.add_argument("--threshold", type=float, default=None,
                        help="publish a measured rate when it moves by more than this fraction "
                             f"(default: {DEFAULT_THRESHOLD})")
    add_store_args(parser)
    parser.add_argument("--snapshot-interval-s", type=float, default=None,
                        help="with an object store (--s3-endpoint or HADAR_S3_ENDPOINT), snapshot the state at "
                             "most this often, so a restart replays only what follows (default: 600; 0: never)")
    parser.add_argument("--snapshots-kept", type=int, default=None, help="snapshots kept (default: 3)")
    parser.set_defaults(func=run_profiler)
    return parser


def profiler_config(args: argparse.Namespace) -> ProfilerConfig:
    """The ProfilerConfig of these flags, the environment and ``--config``; UsageError if invalid."""
    from services.profiler.service import (
        ProfilerConfig,  # heavy (torch, numpy): only when run
    )

    flags = {"group": args.group, "alpha": args.alpha, "threshold": args.threshold,
             "snapshot_interval_s": args.snapshot_interval_s, "snapshots_kept": args.snapshots_kept}
    return load_config(ProfilerConfig, flags=flags, env=os.environ, env_prefix=ENV_PREFIX, file=args.config)


def run_profiler(args: argparse.Namespace) -> int:
    from services.profiler.service import (
        ProfilerService,  # heavy (torch, numpy): only when run
    )

    config = profiler_config(args)
    bus = with_authorship(make_bus(args, source="profiler"), os.environ)
    # Snapshots need a store; without one a restart replays the whole topics, as before.
    store = make_store(args) if (args.s3_endpoint or os.environ.get("HADAR_S3_ENDPOINT")) else None
    configure_logging("profiler", level=args.log_level)

    async def run() -> int:
        await bus.start()
        if store is not None:
            await store.start()
        try:
            code = await run_service(ProfilerService(bus=bus, config=config, store=store), http_host=args.http_host,
                                     http_port=args.http_port, drain_timeout_s=args.drain_timeout_s, bus=bus)
        finally:
            await bus.stop()
            if store is not None:
                await store.stop()
        return code

    return asyncio.run(run())
