"""``hadar replay``: the event log as a timeline, a determinism check, and explanations.

Reads the topics from Kafka (``--bootstrap``) or a recorded file (``--file``, written by
``hadar demo --record`` or ``hadar serve scheduler --record``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from services.cli.jobview import parse_instant
from services.cli.user_logins import user_bus
from services.scheduler.cli import policy_options
from services.scheduler.live.rerun import LoggedEvent, rerun
from services.scheduler.policies import PolicyChoice, UnknownPolicy
from shared.bus.eventlog import EventLogError, LogRecord, fetch_log, read_log
from shared.errors import UsageError
from shared.runtime.connection import add_bus_args
from shared.security.authorship import verifier_from_env
from shared.wire.dispatch import HandlerTable
from shared.wire.events import (
    Assignment,
    CopyFinished,
    DeadLetter,
    Event,
    JobCancelled,
    JobCompleted,
    JobSubmitted,
    LeaderRenewed,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    QueuesApplied,
    QueueSpec,
    RoundAbandoned,
    RoundStarted,
    ThroughputEstimate,
)
from shared.wire.topics import ALL_TOPICS


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
    p.add_argument("--policy", default=None,
                   help="what-if: re-derive with this policy instead of the one each round recorded")
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="what-if: an option for --policy (repeatable)")
    p.add_argument("--show-progress", action="store_true", help="include every Progress event")
    p.set_defaults(func=cmd_replay)


def parse_position(text: str | None, flag: str) -> int | float | None:
    """``--from``/``--to``: an offset (integer) or a time (unix seconds or ISO-8601)."""
    if text is None:
        return None
    if text.lstrip("-").isdigit():
        return int(text)
    when = parse_instant(text)
    if when is None:
        raise UsageError(f"{flag}: {text!r} is neither an offset, unix seconds nor an ISO-8601 time")
    return when


def _within(record: LogRecord, start: float | None, end: float | None) -> bool:
    for bound, is_start in ((start, True), (end, False)):
        if bound is None:
            continue
        value = record.offset if isinstance(bound, int) else record.ts_ms / 1000.0
        if is_start and value < bound:
            return False
        if not is_start and value >= bound:
            return False
    return True


def load_records(args: argparse.Namespace) -> list[LogRecord]:
    if args.file:
        try:
            return list(read_log(args.file))
        except EventLogError as exc:
            raise UsageError(str(exc)) from None
    bus = user_bus(args, source="replay")
    # With HADAR_AUTHORSHIP_* (an admin's settings) the log is read as the services read it:
    # a record they refused for its author is left out here too, so a rerun folds what they folded.
    bus.verifier = verifier_from_env(os.environ)
    return asyncio.run(fetch_log(bus))


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


def _round_started(e: RoundStarted) -> str:
    waiting = ", ".join(f"{w.job_id} ({w.code})" for w in e.waiting) or "none"
    options = "" if e.policy_options == "{}" else f" {e.policy_options}"
    seed = f" seed {e.seed}" if e.seed else ""
    return (f"round {e.round} started [{e.policy}{options}{seed}] on {len(e.nodes)} nodes: "
            f"{e.assignments} assignments, decided in {e.decision_ms:.1f} ms; waiting: {waiting}")


def _assignment(e: Assignment) -> str:
    if e.evaluation:
        return f"  evaluate {e.job_id}'s final model on {e.node_id} GPU {list(e.gpus)} ({e.gpu_type})"
    start = e.start_from or f"seed {e.job.hyper.seed}"
    span = f", rendezvous {e.rendezvous}" if e.rendezvous else ""
    return (f"  place {e.job_id} copy {e.copy} on {e.node_id} GPUs {list(e.gpus)} "
            f"({e.gpu_type}), budget {e.step_budget} steps, from {start}{span}")


def _progress(e: Progress) -> str:
    loss = "no loss reported" if e.loss is None else f"loss {e.loss:.4f}"
    return (f"  progress {e.job_id} r{e.round} c{e.copy} on {e.node_id}: "
            f"{e.steps_round} steps this round ({e.steps_total} total), "
            f"{e.samples_per_s:.0f} samples/s, {loss}")


def _copy_finished(e: CopyFinished) -> str:
    why = f" ({e.reason})" if e.reason else ""
    return (f"  copy {e.job_id} r{e.round} c{e.copy} on {e.node_id} {e.status}: "
            f"{e.steps_round} steps{why}")


def _model_consolidated(e: ModelConsolidated) -> str:
    used = ", ".join(f"c{c.copy}:{c.steps}" for c in e.copies)
    rej = f"; rejected {[r.copy for r in e.rejected]}" if e.rejected else ""
    miss = f"; missing {list(e.missing)}" if e.missing else ""
    return f"  model {e.job_id} r{e.round}: {e.total_steps} steps total from [{used}]{rej}{miss} -> {e.key}"


def _round_abandoned(e: RoundAbandoned) -> str:
    rej = f"; rejected {[r.copy for r in e.rejected]}" if e.rejected else ""
    miss = f"; missing {list(e.missing)}" if e.missing else ""
    return f"  NO MODEL {e.job_id} r{e.round}: {e.reason}{rej}{miss} (continues from its previous model)"


def _job_completed(e: JobCompleted) -> str:
    return f"completed {e.job_id}: {e.total_steps} steps, JCT {e.jct_s:.1f} s -> {e.final_key}"


def _job_submitted(e: JobSubmitted) -> str:
    j = e.job
    return (f"submitted {j.job_id}: {j.model}/{j.dataset} batch {j.batch_size}, W={j.workers}, "
            f"{j.iterations} iterations, priority {j.priority}")


def _job_cancelled(e: JobCancelled) -> str:
    return f"cancelled {e.job_id}: {e.reason}"


def _node_registered(e: NodeRegistered) -> str:
    gpus = ",".join(g.type for g in e.gpus)
    return f"node {e.node_id} registered: {gpus}{' (emulated)' if e.emulated else ''}"


def _throughput(e: ThroughputEstimate) -> str:
    rates = ", ".join(f"{t}={r:.2f}" for t, r in sorted(e.rates.items()))
    return f"throughput {e.job_id} ({e.basis}, W={e.workers}): {rates} steps/s"


def _queues_applied(e: QueuesApplied) -> str:
    def one(q: QueueSpec) -> str:
        quota = ",".join(f"{t}:{n}" for t, n in sorted(q.quota.items())) or "no quota"
        return f"{q.name} (weight {q.weight:g}, {quota})"
    return f"queues applied: {'; '.join(one(q) for q in e.config.queues)}; default {e.config.default_queue}"


def _dead_letter(e: DeadLetter) -> str:
    # raw is bytes: shown as base64 with its length (docs/events.md "Dead letters"), never a repr
    import base64

    raw = base64.b64encode(e.raw).decode("ascii")
    return f"DEAD LETTER from {e.topic}[{e.partition}]@{e.offset}: {e.reason} (raw {len(e.raw)} bytes base64:{raw})"


# The timeline reads every topic; heartbeats and leader renewals would drown it.
_FORMATTERS: HandlerTable[Callable[[Any], str]] = HandlerTable({
    RoundStarted: _round_started, Assignment: _assignment, Progress: _progress,
    CopyFinished: _copy_finished, ModelConsolidated: _model_consolidated, RoundAbandoned: _round_abandoned,
    JobCompleted: _job_completed,
    JobSubmitted: _job_submitted, JobCancelled: _job_cancelled, NodeRegistered: _node_registered,
    ThroughputEstimate: _throughput, QueuesApplied: _queues_applied, DeadLetter: _dead_letter,
}, topics=ALL_TOPICS, ignore=(NodeHeartbeat, LeaderRenewed))
_VERBOSE: frozenset[type[Event]] = frozenset({Progress})  # shown only with --show-progress


def describe(event: Event, *, show_progress: bool) -> str | None:
    """One timeline line for an event (None: not shown: a heartbeat, or Progress unless ``show_progress``)."""
    formatter = _FORMATTERS.handler_for(event)
    if formatter is None or (type(event) in _VERBOSE and not show_progress):
        return None
    return formatter(event)


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


def _override(args: argparse.Namespace, records: list[LogRecord]) -> PolicyChoice | None:
    """None: every round is re-derived with the policy, options and seed it recorded."""
    if not any(isinstance(r.event, RoundStarted) for r in records):
        raise UsageError("the log holds no RoundStarted: nothing to re-run")
    if args.policy is None:
        if args.policy_option:
            raise UsageError("--policy-option needs --policy (the recorded options are used otherwise)")
        return None
    try:
        return PolicyChoice(name=args.policy, options=policy_options(args))
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
        override = _override(args, records)
        differing = 0
        for check in rerun(_logged(records), override=override):
            if args.explain:
                if check.round == args.round:
                    print(json.dumps(explain(check, args.explain), indent=2, default=str))
                    return 0
                continue
            if check.error is not None:
                differing += 1
                print(f"round {check.round}: CANNOT RE-DERIVE ({check.error})")
            elif not check.matches:
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
    if check.error is not None or check.request is None or check.plan is None:
        raise UsageError(f"--round: round {check.round} cannot be re-derived: {check.error}")
    job = next((j for j in check.request.jobs if j.job_id == job_id), None)
    if job is None:
        return {"round": check.round, "job": job_id, "active": False,
                "note": "the job was not active in this round (not yet submitted, completed or cancelled)"}
    placements = [{"copy": p.copy, "node": p.node_id, "gpus": list(p.gpus)}
                  for p in check.plan.placements if p.job_id == job_id]
    waiting = next(({"code": w.code.value, "detail": w.detail} for w in check.plan.waiting if w.job_id == job_id), None)
    return {
        "round": check.round, "job": job_id, "policy": check.settings.choice.describe() if check.settings else None,
        "seed": check.request.seed, "nodes": [n.node_id for n in check.request.cluster.nodes],
        "policy_view": dict(check.plan.explain.get(job_id, {})),
        "steps_done": job.steps_done, "total_steps": job.total_steps, "workers": job.workers,
        "attained_gpu_s": job.attained_gpu_s, "placements": placements, "waiting": waiting,
        "decision": "ran" if placements else "waited",
    }
