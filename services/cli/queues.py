"""``hadar queues``: the teams' queues, their quotas and how each stands; ``queues apply``.

``hadar queues apply FILE`` validates a queue file (:mod:`services.cli.queuefile`) and
publishes it as one QueuesApplied on ``hadar.queues``; the scheduler uses it from its next
round on, and replay and the simulator see the same history. In a secured deployment only
the admin principal may publish there (``HADAR_KAFKA_*`` of the admin). ``hadar queues``
lists each queue's quota, what the latest round gave it (entitled, used, borrowed, lent),
its running and pending jobs and its fair-share standing; ``--json`` for scripts.

:func:`check_fits` is what ``hadar submit`` refuses a job with: a queue that does not
exist, or a job asking more GPUs than its queue may ever hold (quota plus borrowing limit)
or than one user may ask there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json

from services.cli.follow import read_view
from services.cli.queuefile import load_queue_file
from services.cli.queueview import queues_doc, queues_table
from services.cli.user_logins import user_bus
from shared.bus import Bus
from shared.clock import SystemClock
from shared.errors import UsageError
from shared.runtime.connection import add_bus_args
from shared.wire.events import JobSpec, QueuesApplied
from shared.wire.queues import QueueConfig
from shared.wire.topics import QUEUES

__all__ = ["register", "latest_queues", "check_fits", "apply_queues"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("queues", help="team queues: quotas, usage, fair share; 'queues apply FILE' sets them")
    add_bus_args(p)
    p.add_argument("--json", action="store_true", help="print the queues as one JSON document on stdout")
    p.set_defaults(func=cmd_queues)
    actions = p.add_subparsers(dest="action")
    apply = actions.add_parser("apply", help="apply a queue file (YAML or JSON): in force from the next round")
    apply.add_argument("file", help="queue file (see examples/queues/teams.yaml)")
    add_bus_args(apply)
    apply.add_argument("--json", action="store_true", help="print the applied queues as JSON")
    apply.set_defaults(func=cmd_apply)


async def latest_queues(bus: Bus) -> QueueConfig | None:
    """The queues in force: the latest QueuesApplied on ``hadar.queues`` (None: none applied)."""
    found: QueueConfig | None = None
    async with contextlib.aclosing(bus.read(QUEUES)) as records:
        async for delivery in records:
            if isinstance(delivery.event, QueuesApplied):
                found = delivery.event.config
    return found


def check_fits(spec: JobSpec, config: QueueConfig | None) -> None:
    """Raise a one-line :class:`UsageError` when ``spec`` can never run in its queue."""
    if config is None:
        if spec.queue:
            raise UsageError(f"queue: no queues are applied, so {spec.queue!r} does not exist "
                             "(omit --queue, or apply queues with hadar queues apply)")
        return
    name = config.queue_of(spec.queue)
    queue = config.queue(name)
    if queue is None:
        raise UsageError(f"queue: unknown {name!r}; queues: {', '.join(q.name for q in config.queues)}")
    if queue.borrowing_limit is not None and spec.workers > queue.nominal + queue.borrowing_limit:
        raise UsageError(f"workers: queue {name} may hold at most {queue.nominal + queue.borrowing_limit} GPUs "
                         f"(quota {queue.nominal} + borrowing {queue.borrowing_limit}); the job asks {spec.workers}")
    if queue.user_max_gpus is not None and spec.workers > queue.user_max_gpus:
        raise UsageError(f"workers: queue {name} lets one user ask {queue.user_max_gpus} GPUs at once; "
                         f"the job asks {spec.workers}")


async def apply_queues(bus: Bus, config: QueueConfig, *, source: str = "cli/admin") -> QueuesApplied:
    event = QueuesApplied(ts=SystemClock().time(), source=source, config=config)
    await bus.publish(event)
    return event


def cmd_apply(args: argparse.Namespace) -> int:
    config = load_queue_file(args.file)

    async def run() -> None:
        bus = user_bus(args, source="cli/admin")
        await bus.start()
        try:
            await bus.ensure_topics((QUEUES,))
            await apply_queues(bus, config)
        finally:
            await bus.stop()

    asyncio.run(run())
    if args.json:
        print(json.dumps({"applied": [q.name for q in config.queues], "default_queue": config.default_queue}))
    else:
        print(f"applied {len(config.queues)} queues ({', '.join(q.name for q in config.queues)}); "
              f"default {config.default_queue}; in force from the next round")
    return 0


def cmd_queues(args: argparse.Namespace) -> int:
    async def run() -> str:
        bus = user_bus(args, source="cli")
        await bus.start()
        try:
            view = await read_view(bus)
        finally:
            await bus.stop()
        return json.dumps(queues_doc(view.state), indent=2) if args.json else queues_table(view.state)

    print(asyncio.run(run()))
    return 0
