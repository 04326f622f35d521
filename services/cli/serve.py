"""``hadar serve SERVICE``: run one service until SIGTERM, then drain it.

Every service serves ``/healthz`` and ``/metrics`` on ``--http-port`` and logs structlog
JSON to stderr. The agent, tracker and profiler add their own flags from their packages.
"""

from __future__ import annotations

import argparse
import asyncio

from services.scheduler.policies import POLICY_NAMES, UnknownPolicy
from shared.connect import add_bus_args, make_bus
from shared.errors import UsageError
from shared.logging import configure_logging
from shared.service import run_service


def add_common(parser: argparse.ArgumentParser, *, http_port: int) -> None:
    add_bus_args(parser)
    parser.add_argument("--http-port", type=int, default=http_port, help="port of /healthz and /metrics")
    parser.add_argument("--http-host", default="0.0.0.0")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0, help="SIGTERM drain deadline")
    parser.add_argument("--log-level", default="INFO")


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a service (scheduler, agent, tracker, profiler)")
    services = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")

    p = services.add_parser("scheduler", help="plan rounds and publish placements")
    add_common(p, http_port=8081)
    p.add_argument("--policy", default="hadare", help=f"one of: {', '.join(POLICY_NAMES)}")
    p.add_argument("--round-s", type=float, default=360.0, help="round length in seconds")
    p.add_argument("--heartbeat-s", type=float, default=5.0, help="agents' heartbeat period")
    p.add_argument("--consolidation-wait-s", type=float, default=60.0,
                   help="how long a round waits for the previous round's models")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", default=None, metavar="FILE",
                   help="on shutdown, write every topic's events to FILE (for hadar replay --file)")
    p.set_defaults(func=run_scheduler)

    from services.agent.cli import add_agent_parser
    from services.profiler.cli import add_profiler_parser
    from services.tracker.cli import add_tracker_parser
    for add in (add_agent_parser, add_tracker_parser, add_profiler_parser):
        add(services, add_common)


def run_scheduler(args: argparse.Namespace) -> int:
    from services.scheduler.service import SchedulerService

    if args.round_s <= 0:
        raise UsageError("--round-s: must be > 0")
    configure_logging("scheduler", level=args.log_level)

    async def run() -> None:
        bus = make_bus(args, source="scheduler")
        try:
            service = SchedulerService(bus=bus, policy=args.policy, round_s=args.round_s,
                                       heartbeat_s=args.heartbeat_s, seed=args.seed,
                                       consolidation_wait_s=args.consolidation_wait_s)
        except UnknownPolicy as exc:
            raise UsageError(str(exc)) from None
        await bus.start()
        try:
            await run_service(service, http_host=args.http_host, http_port=args.http_port,
                              drain_timeout_s=args.drain_timeout_s)
            if args.record:
                from shared.eventlog import dump_bus

                await dump_bus(bus, args.record)
        finally:
            await bus.stop()

    asyncio.run(run())
    return 0
