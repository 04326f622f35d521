"""``hadar replay``: the event log as a timeline, a determinism check, and explanations.

Reads the topics from Kafka (``--bootstrap``) or a recorded file (``--file``, written by
``hadar demo --record`` or ``hadar serve scheduler --record``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Iterable
from datetime import datetime, timezone

from services.scheduler.policies import UnknownPolicy, make_policy
from services.scheduler.rerun import LoggedEvent, rerun
from shared.connect import add_bus_args, make_bus
from shared.errors import UsageError
from shared.eventlog import EventLogError, LogRecord, read_log
from shared.events import (
    ALL_TOPICS, Assignment, CopyFinished, DeadLetter, JobCancelled, JobCompleted, JobSubmitted,
    ModelConsolidated, NodeRegistered, Progress, RoundStarted, ThroughputEstimate,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="timeline of the event log; --rerun checks determinism; --explain")
    add_bus_args(p)
    p.add_argument("--file", help="read a recorded event log instead of Kafka")
    p.add_argument("--from", dest="start", help="start: offset (integer) or time (ISO-8601 or unix seconds)")
    p.add_argument("--to", dest="end", help="end (exclusive): offset or time")
    p.add_argument("--job", help="only this job's events (and the rounds)")
    p.add_argument("--rerun", action="store_true", help="re-derive every round; exit 1 if any plan differs")
    p.add_argument("--explain", metavar="JOB", help="show how the policy saw JOB in --round")
    p.add_argument("--round", type=int, help="round for --explain")
    p.add_argument("--policy", help="policy for --rerun/--explain (default: the one recorded)")
    p.add_argument("--seed", type=int, default=0, help="seed the scheduler ran with")
    p.add_argument("--heartbeat-s", type=float, default=5.0, help="heartbeat period the scheduler ran with")
    p.add_argument("--show-progress", action="store_true", help="include every Progress event")
    p.set_defaults(func=cmd_replay)


def parse_position(text: str | None, flag: str) -> int | float | None:
    if text is None:
        return None
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is neither an offset, unix seconds nor an ISO-8601 time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _within(record: LogRecord, start: int | float | None, end: int | float | None) -> bool:
    for bound, is_start in ((start, True), (end, False)):
        if bound is None:
            continue
        value = record.offset if isinstance(bound, int) else record.ts_ms / 1000.0
        if is_start and value < bound:
            return False
        if not is_start and value >= bound:
            return False
    return True


async def _read_kafka(args: argparse.Namespace) -> list[LogRecord]:
    bus = make_bus(args, source="replay")
    await bus.start()
    try:
        records = []
        for topic in ALL_TOPICS:
            async for d in bus.read(topic):
                records.append(LogRecord(topic=d.topic, partition=d.partition, offset=d.offset,
                                         ts_ms=d.timestamp_ms, event=d.event))
        return records
    finally:
        await bus.stop()


def load_records(args: argparse.Namespace) -> list[LogRecord]:
    if args.file:
        try:
            return list(read_log(args.file))
        except EventLogError as exc:
            raise UsageError(str(exc)) from None
    return asyncio.run(_read_kafka(args))


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def describe(event, *, show_progress: bool) -> str | None:
    """One timeline line for an event (None: not shown)."""
    match event:
        case RoundStarted():
            waiting = ", ".join(f"{w.job_id} ({w.code})" for w in event.waiting) or "none"
            return (f"round {event.round} started [{event.policy}] on {len(event.nodes)} nodes: "
                    f"{event.assignments} assignments, decided in {event.decision_ms:.1f} ms; waiting: {waiting}")
        case Assignment():
            start = event.start_from or f"seed {event.job.hyper.seed}"
            span = f", rendezvous {event.rendezvous}" if event.rendezvous else ""
            return (f"  place {event.job_id} copy {event.copy} on {event.node_id} GPUs {list(event.gpus)} "
                    f"({event.gpu_type}), budget {event.step_budget} steps, from {start}{span}")
        case Progress() if show_progress:
            return (f"  progress {event.job_id} r{event.round} c{event.copy} on {event.node_id}: "
                    f"{event.steps_round} steps this round ({event.steps_total} total), "
                    f"{event.samples_per_s:.0f} samples/s, loss {event.loss:.4f}")
        case CopyFinished():
            why = f" ({event.reason})" if event.reason else ""
            return (f"  copy {event.job_id} r{event.round} c{event.copy} on {event.node_id} {event.status}: "
                    f"{event.steps_round} steps{why}")
        case ModelConsolidated():
            used = ", ".join(f"c{c.copy}:{c.steps}" for c in event.copies)
            rej = f"; rejected {[r.copy for r in event.rejected]}" if event.rejected else ""
            miss = f"; missing {list(event.missing)}" if event.missing else ""
            return (f"  model {event.job_id} r{event.round}: {event.total_steps} steps total from [{used}]{rej}{miss}"
                    f" -> {event.key}")
        case JobCompleted():
            return f"completed {event.job_id}: {event.total_steps} steps, JCT {event.jct_s:.1f} s -> {event.final_key}"
        case JobSubmitted():
            j = event.job
            return (f"submitted {j.job_id}: {j.model}/{j.dataset} batch {j.batch_size}, W={j.workers}, "
                    f"{j.iterations} iterations, priority {j.priority}")
        case JobCancelled():
            return f"cancelled {event.job_id}: {event.reason}"
        case NodeRegistered():
            gpus = ",".join(g.type for g in event.gpus)
            return f"node {event.node_id} registered: {gpus}{' (emulated)' if event.emulated else ''}"
        case ThroughputEstimate():
            rates = ", ".join(f"{t}={r:.2f}" for t, r in sorted(event.rates.items()))
            return f"throughput {event.job_id} ({event.basis}, W={event.workers}): {rates} steps/s"
        case DeadLetter():
            return f"DEAD LETTER from {event.topic}[{event.partition}]@{event.offset}: {event.reason}"
    return None


def timeline(records: Iterable[LogRecord], *, job: str | None, show_progress: bool) -> list[str]:
    lines = []
    ordered = sorted(records, key=lambda r: (r.ts_ms, not isinstance(r.event, RoundStarted), r.topic,
                                             r.partition, r.offset))
    for r in ordered:
        if job is not None and not isinstance(r.event, (RoundStarted, DeadLetter)) \
                and getattr(r.event, "job_id", None) != job:
            continue
        text = describe(r.event, show_progress=show_progress)
        if text is not None:
            lines.append(f"{_when(r.ts_ms / 1000.0)}  {text}")
    return lines


def _policy_for(args: argparse.Namespace, records: list[LogRecord]):
    name = args.policy or next((r.event.policy for r in records if isinstance(r.event, RoundStarted)), None)
    if name is None:
        raise UsageError("the log holds no RoundStarted: nothing to re-run")
    try:
        return make_policy(name)
    except UnknownPolicy as exc:
        raise UsageError(str(exc)) from None


def _logged(records: list[LogRecord]) -> list[LoggedEvent]:
    return [LoggedEvent(topic=r.topic, partition=r.partition, offset=r.offset, event=r.event) for r in records]


def cmd_replay(args: argparse.Namespace) -> int:
    if args.explain and args.round is None:
        raise UsageError("--explain needs --round R")
    if not args.file and not (args.bootstrap or os.environ.get("HADAR_BOOTSTRAP")):
        raise UsageError("no source: pass --file FILE or --bootstrap HOST:PORT (or set HADAR_BOOTSTRAP)")
    start, end = parse_position(args.start, "--from"), parse_position(args.end, "--to")
    records = load_records(args)
    if args.rerun or args.explain:
        policy = _policy_for(args, records)
        differing = 0
        for check in rerun(_logged(records), policy, seed=args.seed, heartbeat_s=args.heartbeat_s):
            if args.explain:
                if check.round == args.round:
                    print(json.dumps(explain(check, args.explain), indent=2, default=str))
                    return 0
                continue
            if not check.matches:
                differing += 1
                print(f"round {check.round}: DIFFERS\n  recorded:   {list(check.recorded)}\n"
                      f"  re-derived: {list(check.rederived)}")
            else:
                print(f"round {check.round}: same ({len(check.recorded)} placements)")
        if args.explain:
            raise UsageError(f"--round: round {args.round} is not in the log")
        print(f"{differing} round(s) differ")
        return 1 if differing else 0
    selected = [r for r in records if _within(r, start, end)]
    for line in timeline(selected, job=args.job, show_progress=args.show_progress):
        print(line)
    return 0


def explain(check, job_id: str) -> dict:
    """The job's options in that round as the policy saw them, and what it decided."""
    job = next((j for j in check.snapshot.jobs if j.job_id == job_id), None)
    if job is None:
        return {"round": check.round, "job": job_id, "active": False,
                "note": "the job was not active in this round (not yet submitted, completed or cancelled)"}
    placements = [{"copy": p.copy, "node": p.node_id, "gpus": list(p.gpus)}
                  for p in check.plan.placements if p.job_id == job_id]
    waiting = next(({"code": w.code.value, "detail": w.detail} for w in check.plan.waiting if w.job_id == job_id), None)
    return {
        "round": check.round, "job": job_id, "policy_view": dict(check.plan.explain.get(job_id, {})),
        "steps_done": job.steps_done, "total_steps": job.total_steps, "workers": job.workers,
        "attained_gpu_s": job.attained_gpu_s, "placements": placements, "waiting": waiting,
        "decision": "ran" if placements else "waited",
    }
