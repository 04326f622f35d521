"""``hadar serve tracker``: flags and runner (wired by services/cli/serve.py).

Settings are a :class:`~services.tracker.service.TrackerConfig` loaded by
:func:`shared.runtime.config.load_config`: flags over ``HADAR_TRACKER_*`` variables over the
``--config`` TOML file over the defaults. A bad value exits 2 with one line naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.runtime.config import add_config_arg, load_config
from shared.runtime.connection import add_store_args, make_bus, make_store
from shared.runtime.leadership import add_standby_args
from shared.runtime.logging import configure_logging
from shared.runtime.service import run_service
from shared.security.authorship import with_authorship

if TYPE_CHECKING:
    from services.tracker.config import TrackerConfig

__all__ = ["add_tracker_parser", "run_tracker", "tracker_config", "ENV_PREFIX", "STEPPED_DOWN_EXIT"]

DEFAULT_HTTP_PORT = 8083
STEPPED_DOWN_EXIT = 3   # a newer replica took the role over: restart as a standby (as the scheduler does)
ENV_PREFIX = "HADAR_TRACKER_"


def add_tracker_parser(services: argparse._SubParsersAction,
                       add_common: Callable[..., None]) -> argparse.ArgumentParser:
    parser = services.add_parser("tracker", help="aggregate progress, consolidate copies, complete jobs")
    add_common(parser, http_port=DEFAULT_HTTP_PORT)
    add_store_args(parser)
    add_config_arg(parser)
    # Defaults are TrackerConfig's: None here means "not given", so env and file can set them.
    parser.add_argument("--group", default=None, help="consumer group id (default: hadar-tracker)")
    parser.add_argument("--uniform", dest="mode", action="store_const", const="uniform", default=None,
                        help="average copies uniformly instead of by the steps each did")
    parser.add_argument("--finish-timeout-s", type=float, default=None,
                        help="how long after a round's deadline to wait for missing copies (default: 120)")
    parser.add_argument("--tick-s", type=float, default=None, help="how often due rounds are checked (default: 1)")
    parser.add_argument("--max-attempts", type=int, default=None,
                        help="attempts at consolidating a round or completing a job before giving it up (default: 6)")
    parser.add_argument("--temp-dir", default=None, help="where consolidated models are staged")
    parser.add_argument("--consolidation-threads", type=int, default=None,
                        help="threads that average a round's replicas "
                             "(default: 1; more only help with spare memory bandwidth)")
    parser.add_argument("--consolidation-jobs", type=int, default=None,
                        help="jobs whose rounds are consolidated at once, each job's in order (default: 4)")
    parser.add_argument("--keep-round-models", type=int, default=None,
                        help="round models kept per running job, the latest ones (default: 2, at least 1)")
    parser.add_argument("--keep-checkpoints", dest="delete_checkpoints", action="store_const", const=False,
                        default=None, help="never delete checkpoints (default: those of decided rounds are)")
    parser.add_argument("--keep-round-models-after-completion", dest="delete_completed_models",
                        action="store_const", const=False, default=None,
                        help="keep a completed job's last round models (default: only its final model is kept)")
    parser.add_argument("--straggler-sweep-s", type=float, default=None,
                        help="sweep a completed job's objects again this long after, for late uploads "
                             "(default: 600; 0: never)")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="write a state snapshot after every N rounds decided (default: 10; 0: never)")
    parser.add_argument("--snapshots-kept", type=int, default=None,
                        help="state snapshots kept, the newest (default: 3)")
    add_standby_args(parser)
    parser.set_defaults(func=run_tracker)
    return parser


def tracker_config(args: argparse.Namespace) -> TrackerConfig:
    """The TrackerConfig of these flags, the environment and ``--config``; UsageError if invalid."""
    from services.tracker.config import TrackerConfig

    flags = {"group": args.group, "mode": args.mode, "finish_timeout_s": args.finish_timeout_s,
             "tick_s": args.tick_s, "max_attempts": args.max_attempts, "temp_dir": args.temp_dir,
             "consolidation_threads": args.consolidation_threads, "consolidation_jobs": args.consolidation_jobs,
             "keep_round_models": args.keep_round_models, "delete_checkpoints": args.delete_checkpoints,
             "delete_completed_models": args.delete_completed_models,
             "straggler_sweep_s": args.straggler_sweep_s, "snapshot_every": args.snapshot_every,
             "snapshots_kept": args.snapshots_kept, "standby": args.standby, "lease_ttl_s": args.lease_ttl_s}
    return load_config(TrackerConfig, flags=flags, env=os.environ, env_prefix=ENV_PREFIX, file=args.config)


def run_tracker(args: argparse.Namespace) -> int:
    from services.tracker.service import (
        TrackerService,  # heavy (torch, numpy): only when run
    )
    from services.tracker.standby import StandbyTracker

    config = tracker_config(args)
    bus = with_authorship(make_bus(args, source="tracker"), os.environ)
    store = make_store(args)
    configure_logging("tracker", level=args.log_level)

    async def run() -> int:
        await bus.start()
        await store.start()
        try:
            stop = asyncio.Event()
            service = (StandbyTracker(bus=bus, store=store, config=config, holder=args.holder,
                                      on_stepped_down=stop.set)
                       if config.standby else TrackerService(bus=bus, store=store, config=config))
            code = await run_service(service, http_host=args.http_host, http_port=args.http_port,
                                     drain_timeout_s=args.drain_timeout_s, bus=bus, stop_event=stop)
            if isinstance(service, StandbyTracker) and service.stepped_down is not None:
                code = STEPPED_DOWN_EXIT
        finally:
            await store.stop()
            await bus.stop()
        return code

    return asyncio.run(run())
