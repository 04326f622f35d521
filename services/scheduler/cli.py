"""``hadar serve scheduler``: flags and runner (wired by services/cli/serve.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable

from services.scheduler.config import SchedulerConfig
from services.scheduler.policies import POLICY_NAMES, UnknownPolicy, parse_policy_option
from shared.errors import UsageError
from shared.runtime.config import add_config_arg, load_config
from shared.runtime.connection import add_store_args, make_bus, make_store
from shared.runtime.leadership import add_standby_args
from shared.runtime.logging import configure_logging
from shared.runtime.service import run_service
from shared.security.authorship import with_authorship

__all__ = ["add_scheduler_parser", "run_scheduler", "scheduler_config", "add_policy_args", "policy_options",
           "ENV_PREFIX"]

DEFAULT_HTTP_PORT = 8081
STEPPED_DOWN_EXIT = 3   # a newer replica took the role over: restart as a standby
ENV_PREFIX = "HADAR_SCHEDULER_"


def add_policy_args(parser: argparse.ArgumentParser, *, default: str | None = "hadare") -> None:
    parser.add_argument("--policy", default=default,
                        help=f"one of: {', '.join(POLICY_NAMES)} (default: {default or 'hadare'})")
    parser.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the policy's constructor (VALUE as JSON if it parses, else a "
                             "string), e.g. horizon=32; repeatable; recorded in every RoundStarted")


def policy_options(args: argparse.Namespace) -> dict:
    try:
        return dict(parse_policy_option(text) for text in args.policy_option)
    except UnknownPolicy as exc:
        raise UsageError(f"--policy-option: {exc}") from None


def add_scheduler_parser(services: argparse._SubParsersAction,
                         add_common: Callable[..., None]) -> argparse.ArgumentParser:
    parser = services.add_parser("scheduler", help="plan rounds and publish placements")
    add_common(parser, http_port=DEFAULT_HTTP_PORT)
    add_config_arg(parser)
    # Defaults are SchedulerConfig's: None here means "not given", so env and file can set them.
    add_policy_args(parser, default=None)
    parser.add_argument("--round-s", type=float, default=None, help="round length in seconds (default: 360)")
    parser.add_argument("--heartbeat-s", type=float, default=None,
                        help="agents' heartbeat period; a node missing 3 leaves the cluster (default: 5)")
    parser.add_argument("--late-copy-s", type=float, default=None,
                        help="how long after a round's deadline its missing copies may still finish; keep it "
                             "equal to the tracker's --finish-timeout-s (default: 120)")
    parser.add_argument("--consolidation-wait-s", type=float, default=None,
                        help="how long after that a round waits for the previous round's models (default: 60)")
    parser.add_argument("--round-overhead-factor", type=float, default=None,
                        help="rounds are at least this times the measured start-up + consolidation overhead "
                             "(0: off; default: 3)")
    parser.add_argument("--seed", type=int, default=None, help="seed passed to the policy, recorded per round")
    parser.add_argument("--group", default=None, help="consumer group id (default: hadar-scheduler)")
    add_store_args(parser)
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="with an object store (--s3-endpoint or HADAR_S3_ENDPOINT), snapshot the state "
                             "every N rounds so a restart replays only what follows (default: 10; 0: never)")
    parser.add_argument("--snapshots-kept", type=int, default=None, help="snapshots kept (default: 3)")
    add_standby_args(parser)
    parser.add_argument("--record", default=None, metavar="FILE",
                        help="on shutdown, write every topic's events to FILE (for hadar replay --file)")
    parser.set_defaults(func=run_scheduler)
    return parser


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The SchedulerConfig of these flags, ``HADAR_SCHEDULER_*`` and ``--config``; UsageError if invalid."""
    options = policy_options(args) or None
    flags = {"policy": args.policy, "policy_options": options, "round_s": args.round_s,
             "heartbeat_s": args.heartbeat_s, "late_copy_s": args.late_copy_s,
             "consolidation_wait_s": args.consolidation_wait_s,
             "round_overhead_factor": args.round_overhead_factor,
             "seed": args.seed, "group": args.group, "snapshot_every": args.snapshot_every,
             "snapshots_kept": args.snapshots_kept, "standby": args.standby, "lease_ttl_s": args.lease_ttl_s}
    return load_config(SchedulerConfig, flags=flags, env=os.environ, env_prefix=ENV_PREFIX, file=args.config)


def run_scheduler(args: argparse.Namespace) -> int:
    from services.scheduler.live.service import SchedulerService

    config = scheduler_config(args)
    bus = with_authorship(make_bus(args, source=config.source), os.environ)
    # Snapshots need a store; without one a restart re-derives the whole log, as before.
    store = make_store(args) if (args.s3_endpoint or os.environ.get("HADAR_S3_ENDPOINT")) else None
    configure_logging("scheduler", level=args.log_level)

    async def run() -> int:
        await bus.start()
        if store is not None:
            await store.start()
        try:
            stop = asyncio.Event()
            service = SchedulerService(bus=bus, config=config, store=store, on_stepped_down=stop.set,
                                       holder=args.holder)
            code = await run_service(service, http_host=args.http_host, http_port=args.http_port,
                                     drain_timeout_s=args.drain_timeout_s, bus=bus, stop_event=stop)
            if service.stepped_down is not None:
                return STEPPED_DOWN_EXIT
            if args.record and code == 0:
                from shared.bus.eventlog import dump_bus

                await dump_bus(bus, args.record)
        finally:
            await bus.stop()
            if store is not None:
                await store.stop()
        return code

    return asyncio.run(run())
