"""User commands: ``submit``, ``jobs``, ``status``, ``watch``, ``cancel``, ``model``.

For scripts: ``--json`` on ``jobs``, ``status``, ``watch`` and ``model`` prints exactly one
JSON document on stdout; diagnostics go to stderr only. Exit codes: 0 success; 2 bad
usage, an unknown job, or a ``submit --id`` that already exists; ``watch``: 1 when the job
was cancelled. ``cancel`` of a finished job publishes nothing and exits 0, saying so.
Reads never join a consumer group (:mod:`services.cli.follow`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import getpass
import json
import os
import sys
from pathlib import Path
from typing import Any

from services.cli.follow import ClusterView, read_view, submitted_ids
from services.cli.jobfile import (
    FIELDS,
    load_job_file,
    new_job_id,
    parse_job,
)
from services.cli.jobview import (
    JOB_STATES,
    job_doc,
    jobs_table,
    parse_since,
    select_jobs,
)
from services.cli.queues import check_fits, latest_queues
from services.cli.user_logins import user_bus, user_store
from services.cli.usercode import CODE_FIELDS, CodeRequest, deliver, split_code_fields
from services.cli.watch import watch_job
from shared.bus import Bus
from shared.clock import SystemClock
from shared.domain.layout import final_key, model_key
from shared.errors import UsageError
from shared.runtime.connection import add_bus_args, add_store_args
from shared.security.authorship import Sealer, sealer_from_env
from shared.store import ObjectNotFound, StoreDenied
from shared.wire.events import JobCancelled, JobSpec, JobSubmitted, UserCode

__all__ = ["register", "submit", "jobs_table", "job_fields"]

FIELD_HELP: dict[str, str] = {
    "id": "job id (default: generated, unique); an id already in the log is refused",
    "user": "owner (default: your login name)",
    "model": "model: resnet, transformer, lstm, autoencoder (knobs as resnet-w16-d2)",
    "dataset": "dataset: digits, diabetes, synthetic-text, synthetic-ratings",
    "batch_size": "per-worker batch size (default 32)",
    "workers": "data-parallel workers (GPUs) per copy",
    "iterations": "steps of the global batch to train",
    "priority": "weight in the policy's objective among jobs of its class (default 1.0)",
    "deadline_s": "deadline in seconds from submission (default: none)",
    "optimizer": "optimizer name (default: the model's)",
    "lr": "learning rate (default: the model's)",
    "seed": "random seed",
    "queue": "team queue (default: the queues' default queue; see hadar queues)",
    "priority_class": "priority class in its queue, 0-100 (default 0): a higher class runs first "
                      "and may preempt a lower one at a round boundary",
}
CODE_HELP: dict[str, str] = {
    "code": "your own training script's folder (packed and uploaded; README \"Bring your own training code\")",
    "entrypoint": "the script in --code to run (default train.py)",
    "args": "the script's arguments, one string split as a shell would",
    "config": "a JSON object the script reads as run.config",
    "data": "a dataset you uploaded with hadar data put",
    "hint": "a built-in family (resnet, transformer, lstm, autoencoder) to estimate the speed by until measured",
}


def _json_flag(p: argparse.ArgumentParser, what: str, note: str = "") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON document on stdout{note}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a training job (from a YAML/JSON file or flags)")
    p.add_argument("file", nargs="?", help="job file (YAML or JSON); flags override its fields")
    for name in FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"job_{name}", default=None, help=FIELD_HELP[name])
    for name in CODE_FIELDS:
        p.add_argument(f"--{name}", dest=f"job_{name}", default=None, help=CODE_HELP[name])
    add_bus_args(p)
    add_store_args(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="table of jobs: user, state, progress, GPUs, round, times, waiting reason")
    p.add_argument("--all", action="store_true", help="include completed and cancelled jobs")
    p.add_argument("--state", action="append", choices=JOB_STATES, default=None,
                   help="only jobs in this state (repeatable; implies --all for finished states)")
    p.add_argument("--user", default=None, help="only jobs of this user")
    p.add_argument("--since", default=None,
                   help="only jobs submitted since: a duration back from now (30m, 2h, 1d), unix seconds or ISO-8601")
    _json_flag(p, "the jobs (an array of status documents)")
    add_bus_args(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("status", help="one job in detail")
    p.add_argument("job", help="job id")
    _json_flag(p, "the status")
    add_bus_args(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("watch", help="progress bar with rate and ETA until the job finishes "
                                     "(exit 0 completed, 1 cancelled, 2 no such job)")
    p.add_argument("job", help="job id")
    p.add_argument("--wait-s", type=float, default=30.0,
                   help="how long to wait for an unknown job to appear before exit 2 (default 30)")
    p.add_argument("--poll-s", type=float, default=1.0, help="seconds between reads of the log (default 1)")
    _json_flag(p, "the final status", "; the progress bar then goes to stderr, on a terminal only")
    add_bus_args(p)
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("cancel", help="stop a job at the next round boundary (a finished job: says so, exit 0)")
    p.add_argument("job", help="job id")
    p.add_argument("--reason", default="cancelled by user", help="recorded with the cancellation")
    _json_flag(p, "the outcome ({\"job\", \"result\"})")
    add_bus_args(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("model", help="download a job's final (or --round R) model: weights only, safetensors, "
                                     "with metadata naming its zoo model (README \"Using a model\")")
    p.add_argument("job", help="job id")
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--round", type=int, default=None, metavar="R",
                   help="the consolidated model of round R instead of the final one (kept while the job runs: "
                        "the tracker keeps the latest few rounds' models)")
    _json_flag(p, "what was downloaded and the model's metadata")
    add_store_args(p)
    p.set_defaults(func=cmd_model)


# ---------------------------------------------------------------- submit / cancel


def job_fields(args: argparse.Namespace) -> tuple[dict[str, Any], CodeRequest | None]:
    """The job file's fields with the flags over them, split into the job's own and the code
    request (None: a zoo job). A file's ``code`` folder is relative to the file."""
    data: dict[str, Any] = load_job_file(args.file) if args.file else {}
    code_flag = getattr(args, "job_code", None)
    for name in (*FIELDS, *CODE_FIELDS):
        value = getattr(args, f"job_{name}", None)
        if value is not None:
            data[name] = value
    base = Path(args.file).resolve().parent if args.file and code_flag is None else Path.cwd()
    fields, request = split_code_fields(data, base=base)
    if request is not None:
        fields["dataset"] = request.data or "-"
    return fields, request


async def submit(bus: Bus, spec: JobSpec, *, source: str = "cli") -> JobSubmitted:
    """Publish a validated job; the demo and tests submit through this too."""
    now = SystemClock().time()
    event = JobSubmitted(ts=now, source=source, job=spec, submitted_at=now)
    await bus.publish(event)
    return event


def cmd_submit(args: argparse.Namespace) -> int:
    """Refuses (exit 2) an id the log already holds: the scheduler keeps an id's first
    submission, so a second one would be silently ignored. Two submits of one id racing
    each other can still both pass this check; the first in the log wins."""
    fields, request = job_fields(args)
    chosen = bool(fields.get("id"))
    sealer = sealer_from_env(os.environ)
    me = submitter(sealer, fields.get("user"))
    spec = None if request is not None else parse_job(fields, default_user=me)

    async def with_code(request: CodeRequest, bus: Bus) -> JobSpec:
        user = fields.get("user") or me

        async def accept(code: UserCode) -> JobSpec:
            job = parse_job(fields, default_user=me, code=code)
            check_fits(job, await latest_queues(bus))
            return job

        store = user_store(args)
        await store.start()
        try:
            job, uploaded = await deliver(store, request, str(user), accept)
        finally:
            await store.stop()
        assert job.code is not None
        print(f"code: sha256 {job.code.digest[:12]}, {job.code.size} bytes "
              f"({'uploaded' if uploaded else 'already stored'})", file=sys.stderr)
        return job

    async def run() -> JobSpec:
        bus = user_bus(args, source="cli")
        bus.sealer = sealer
        await bus.start()
        try:
            await bus.ensure_topics()
            if spec is None:
                assert request is not None
                final = await with_code(request, bus)
            else:
                final = spec
                check_fits(final, await latest_queues(bus))
            taken = await submitted_ids(bus)
            if final.job_id in taken:
                if chosen:
                    raise UsageError(f"id: job {final.job_id!r} already exists; choose another id")
                while final.job_id in taken:   # a 48-bit collision: draw again
                    final = dataclasses.replace(final, job_id=new_job_id(final.model))
            await submit(bus, final)
            return final
        finally:
            await bus.stop()

    print(asyncio.run(run()).job_id)
    return 0


def submitter(sealer: Sealer | None, named: object) -> str:
    """Who a job is submitted as: the user of the credential ``HADAR_IDENTITY_FILE`` names
    (a job file naming another user is refused: the services would refuse its submission),
    else the job file's ``user``, else the login name."""
    if sealer is None or not sealer.identity.startswith("user/"):
        return getpass.getuser()
    me = sealer.identity.removeprefix("user/")
    if named not in (None, "", me):
        raise UsageError(f"user: the job names user {named!r}, but you are {me!r} (HADAR_IDENTITY_FILE)")
    return me


def cmd_cancel(args: argparse.Namespace) -> int:
    sealer = sealer_from_env(os.environ)

    async def run() -> str:
        bus = user_bus(args, source="cli")
        bus.sealer = sealer
        await bus.start()
        try:
            view = await read_view(bus)
            job = view.state.jobs.get(args.job)
            if job is None:
                raise UsageError(f"job: no job {args.job!r}")
            if not job.active:
                return f"already_{job.state}"
            me = sealer.identity.removeprefix("user/") if sealer is not None else ""
            await bus.publish(JobCancelled(ts=SystemClock().time(), source="cli", job_id=args.job, reason=args.reason,
                                           user=me))
            return "cancel_requested"
        finally:
            await bus.stop()

    result = asyncio.run(run())
    if args.json:
        print(json.dumps({"job": args.job, "result": result}))
    elif result == "cancel_requested":
        print(f"{args.job}: cancel requested (takes effect at the next round boundary)")
    else:
        print(f"{args.job}: {result.replace('_', ' ')}; nothing to cancel")
    return 0


# ---------------------------------------------------------------- views


def cmd_jobs(args: argparse.Namespace) -> int:
    view = _read(args)
    now = SystemClock().time()
    since = None if args.since is None else parse_since(args.since, now)
    picked = select_jobs(view.state, include_done=args.all, states=args.state or (), user=args.user, since=since)
    if args.json:
        print(json.dumps([job_doc(view.state, j.spec.job_id, now=now, cancelled_at=view.cancelled_at,
                                  training=view.training)
                          for j in picked], indent=2))
    else:
        print(jobs_table(view.state, include_done=args.all, now=now, cancelled_at=view.cancelled_at, jobs=picked))
    return 0


def _read(args: argparse.Namespace) -> ClusterView:
    async def run() -> ClusterView:
        bus = user_bus(args, source="cli")
        await bus.start()
        try:
            return await read_view(bus)
        finally:
            await bus.stop()
    return asyncio.run(run())


def cmd_status(args: argparse.Namespace) -> int:
    """Prints the job's JSON document (with or without ``--json``: status was always JSON)."""
    view = _read(args)
    print(json.dumps(job_doc(view.state, args.job, now=SystemClock().time(), cancelled_at=view.cancelled_at,
                             training=view.training), indent=2))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    if not args.wait_s >= 0 or not args.poll_s > 0:
        raise UsageError("--wait-s must be >= 0 and --poll-s > 0")

    async def run() -> int:
        bus = user_bus(args, source="cli")
        await bus.start()
        try:
            return await watch_job(bus, args.job, wait_s=args.wait_s, poll_s=args.poll_s, as_json=args.json)
        finally:
            await bus.stop()

    return asyncio.run(run())


def cmd_model(args: argparse.Namespace) -> int:
    try:
        key = final_key(args.job) if args.round is None else model_key(args.job, args.round)
    except ValueError as exc:
        raise UsageError(f"job/--round: {exc}") from None
    what = "final model" if args.round is None else f"model of round {args.round}"

    async def run() -> None:
        store = user_store(args)
        await store.start()
        try:
            await store.get_file(key, Path(args.out))
        except StoreDenied as exc:
            raise UsageError(f"job: the {what} of {args.job!r} is not yours to read ({exc.code}: the store lets "
                             "a user read only the models of their own jobs)") from None
        except ObjectNotFound:
            raise UsageError(f"job: no {what} for {args.job!r} (" + (
                "not completed yet, or unknown job" if args.round is None else
                "not consolidated yet, deleted by the tracker's lifecycle, or unknown job") + ")") from None
        finally:
            await store.stop()

    asyncio.run(run())
    if args.json:
        out = Path(args.out)
        print(json.dumps({"job": args.job, "key": key, "out": str(out), "bytes": out.stat().st_size,
                          "metadata": safetensors_metadata(out)}, indent=2))
    else:
        print(args.out)
    return 0


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (empty if it has none), read from its
    header alone: an 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= 100 * 1024 * 1024:
            print(f"hadar model: warning: {path} has no readable safetensors header", file=sys.stderr)
            return {}
        header = json.loads(f.read(size))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
