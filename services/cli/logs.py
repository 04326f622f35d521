"""``hadar logs JOB [--follow] [--round R] [--json]``: a job's training, from the log.

One line per event of the job, in event time: each copy's assignment (node, GPU type,
workers, step budget), its progress reports (loss, samples/s, steps), how it finished
(ok, preempted or failed, with the reason), and each round's model (job steps, held-out
metric, copies averaged, replicas rejected and why, copies missing) or why the round was
abandoned (:mod:`services.cli.joblog`). ``--round R`` keeps round R only.

``--json`` prints one JSON document (:meth:`TrainingLog.doc`: per round, per copy, and the
latest loss and metric); with ``--follow``, one JSON object per event instead (JSON lines:
``{"type", "ts", "round", "line", "event"}``), so scripts can stream it.

``--follow`` keeps printing new events until the job completes (exit 0) or is cancelled
(exit 1), like ``watch``; an unknown job is exit 2 after ``--wait-s``. Nothing is left on
the broker: reads join no consumer group (:mod:`services.cli.follow`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from typing import Any

from services.cli.follow import LogFollower
from services.cli.joblog import FoldedEvent, log_line
from services.cli.user_logins import user_bus
from shared.bus import Bus
from shared.clock import SystemClock
from shared.errors import UsageError
from shared.runtime.connection import add_bus_args

__all__ = ["register", "show_logs"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="a job's training per round and copy: loss, samples/s, held-out metric, "
                                    "failures (--follow until it finishes)")
    p.add_argument("job", help="job id")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new events until the job completes (exit 0) or is cancelled (exit 1)")
    p.add_argument("--round", type=int, default=None, metavar="R", help="only round R")
    p.add_argument("--json", action="store_true",
                   help="one JSON document on stdout (with --follow: one JSON object per event, per line)")
    p.add_argument("--wait-s", type=float, default=30.0,
                   help="with --follow: how long to wait for an unknown job to appear before exit 2 (default 30)")
    p.add_argument("--poll-s", type=float, default=1.0, help="with --follow: seconds between reads (default 1)")
    add_bus_args(p)
    p.set_defaults(func=cmd_logs)


def cmd_logs(args: argparse.Namespace) -> int:
    if args.round is not None and args.round < 0:
        raise UsageError("--round must be >= 0")
    if not args.wait_s >= 0 or not args.poll_s > 0:
        raise UsageError("--wait-s must be >= 0 and --poll-s > 0")

    async def run() -> int:
        bus = user_bus(args, source="cli")
        await bus.start()
        try:
            return await show_logs(bus, args.job, round_=args.round, follow=args.follow, as_json=args.json,
                                   wait_s=args.wait_s if args.follow else 0.0, poll_s=args.poll_s)
        finally:
            await bus.stop()

    return asyncio.run(run())


def _event_doc(event: FoldedEvent) -> dict[str, Any]:
    body = {k: v for k, v in asdict(event).items() if k not in ("id", "ts", "source")}
    body.pop("job", None)   # an Assignment's whole job spec: the job is known
    return {"type": event.TYPE, "ts": event.ts, "round": event.round, "line": log_line(event), "event": body}


def _emit(events: list[FoldedEvent], round_: int | None, as_json: bool) -> None:
    for event in events:
        if round_ is not None and event.round != round_:
            continue
        print(json.dumps(_event_doc(event), default=str) if as_json else log_line(event), flush=True)


async def show_logs(bus: Bus, job_id: str, *, round_: int | None, follow: bool, as_json: bool,
                    wait_s: float, poll_s: float) -> int:
    """Print ``job_id``'s training (see the module docstring); the exit code."""
    clock = SystemClock()
    follower = LogFollower(bus)
    deadline = clock.time() + wait_s
    shown = False
    cancel_seen = False
    while True:
        view = await follower.poll()
        job = view.state.jobs.get(job_id)
        if job is None:
            if clock.time() >= deadline:
                waited = f" (waited {wait_s:g} s; --wait-s to wait longer)" if follow else ""
                raise UsageError(f"job: no job {job_id!r}{waited}")
            await asyncio.sleep(poll_s)
            continue
        if not follow:
            if as_json:
                print(json.dumps(view.training.doc(job_id, round_), indent=2))
            else:
                _emit(view.training.events(job_id), round_, as_json=False)
            return 0
        fresh = view.training.events(job_id) if not shown else [
            e for e in view.new_training if getattr(e, "job_id", None) == job_id
            or getattr(getattr(e, "job", None), "job_id", None) == job_id]
        shown = True
        _emit(fresh, round_, as_json)
        if job.state == "completed" or (job.state == "cancelled" and cancel_seen):
            return 0 if job.state == "completed" else 1
        cancel_seen = job.state == "cancelled"
        await asyncio.sleep(0.0 if cancel_seen else poll_s)
