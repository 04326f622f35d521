"""User commands: ``submit``, ``jobs``, ``status``, ``watch``, ``cancel``, ``model``."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
import uuid
from pathlib import Path

from services.cli.connect import fold_all
from services.scheduler.state import JobRecord, SchedulerState
from shared.bus import Bus
from shared.clock import SystemClock
from shared.connect import add_bus_args, add_store_args, make_bus, make_store
from shared.errors import UsageError
from shared.rejection import Rejected
from shared.events import JobCancelled, JobSpec, JobSubmitted, RoundStarted
from shared.jobfile import FIELDS, JobFileError, load_job_file, parse_job
from shared.layout import final_key
from shared.store import ObjectNotFound
from shared.topics import JOBS, MODELS, PLACEMENTS, PROGRESS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a training job (from a YAML/JSON file or flags)")
    p.add_argument("file", nargs="?", help="job file (YAML or JSON); flags override its fields")
    for name in FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"job_{name}", default=None)
    add_bus_args(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="table of jobs: state, progress, GPUs, round, waiting reason")
    p.add_argument("--all", action="store_true", help="include completed and cancelled jobs")
    add_bus_args(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("status", help="one job in detail")
    p.add_argument("job")
    add_bus_args(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("watch", help="progress bar with rate and ETA until the job completes")
    p.add_argument("job")
    add_bus_args(p)
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("cancel", help="stop a job at the next round boundary")
    p.add_argument("job")
    p.add_argument("--reason", default="cancelled by user")
    add_bus_args(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("model", help="download a job's final model (safetensors)")
    p.add_argument("job")
    p.add_argument("--out", required=True, help="output file")
    add_store_args(p)
    p.set_defaults(func=cmd_model)


# ---------------------------------------------------------------- submit / cancel


def spec_from_args(args: argparse.Namespace) -> JobSpec:
    data: dict = load_job_file(args.file) if args.file else {}
    for name in FIELDS:
        value = getattr(args, f"job_{name}")
        if value is not None:
            data[name] = value
    return parse_job(data, default_user=getpass.getuser())


async def submit(bus: Bus, spec: JobSpec, *, source: str = "cli") -> JobSubmitted:
    """Publish a validated job; the demo and tests submit through this too."""
    now = SystemClock().time()
    event = JobSubmitted(ts=now, source=source, job=spec, submitted_at=now)
    await bus.emit(event)
    return event


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
    except JobFileError as exc:
        raise UsageError(str(exc)) from None

    async def run() -> None:
        bus = make_bus(args, source="cli")
        await bus.start()
        try:
            await bus.ensure_topics()
            await submit(bus, spec)
        finally:
            await bus.stop()

    asyncio.run(run())
    print(spec.job_id)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    async def run() -> None:
        bus = make_bus(args, source="cli")
        await bus.start()
        try:
            state = await fold_all(bus)
            if args.job not in state.jobs:
                raise UsageError(f"job: no job {args.job!r}")
            await bus.emit(JobCancelled(ts=SystemClock().time(), source="cli", job_id=args.job, reason=args.reason))
        finally:
            await bus.stop()

    asyncio.run(run())
    print(f"{args.job}: cancel requested (takes effect at the next round boundary)")
    return 0


# ---------------------------------------------------------------- views


def last_round_view(state: SchedulerState, job: JobRecord) -> tuple[dict[str, int], int | None, str]:
    """(GPUs by type in the job's last round, that round, waiting reason in the latest round)."""
    gpus: dict[str, int] = {}
    if job.last_round is not None and job.last_round in state.rounds:
        for a in state.rounds[job.last_round].assignments:
            if a.job_id == job.spec.job_id:
                gpus[a.gpu_type] = gpus.get(a.gpu_type, 0) + len(a.gpus)
    reason = ""
    if state.last_round >= 0 and job.active:
        latest: RoundStarted = state.rounds[state.last_round].started
        for w in latest.waiting:
            if w.job_id == job.spec.job_id:
                reason = f"{w.code}: {w.detail}" if w.detail else w.code
        if job.last_round != state.last_round:
            gpus = {}
    return gpus, job.last_round, reason


def jobs_table(state: SchedulerState, *, include_done: bool) -> str:
    rows = [("JOB", "STATE", "PROGRESS", "GPUS", "ROUND", "WAITING")]
    for job in sorted(state.jobs.values(), key=lambda j: (j.submitted_at, j.spec.job_id)):
        if not include_done and not job.active:
            continue
        gpus, round_, reason = last_round_view(state, job)
        pct = 100.0 * job.progress_steps() / job.spec.iterations
        rows.append((job.spec.job_id, job.state, f"{pct:5.1f}%",
                     ",".join(f"{t}x{n}" for t, n in sorted(gpus.items())) or "-",
                     "-" if round_ is None else str(round_), reason or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_jobs(args: argparse.Namespace) -> int:
    print(jobs_table(asyncio.run(_folded(args)), include_done=args.all))
    return 0


async def _folded(args: argparse.Namespace) -> SchedulerState:
    bus = make_bus(args, source="cli")
    await bus.start()
    try:
        return await fold_all(bus)
    finally:
        await bus.stop()


def job_status(state: SchedulerState, job_id: str) -> dict:
    job = state.jobs.get(job_id)
    if job is None:
        raise UsageError(f"job: no job {job_id!r}")
    gpus, round_, reason = last_round_view(state, job)
    return {
        "job": job.spec.job_id, "state": job.state, "model": job.spec.model, "dataset": job.spec.dataset,
        "workers": job.spec.workers, "iterations": job.spec.iterations, "steps": job.progress_steps(),
        "consolidated_steps": job.steps_done, "last_round": round_, "gpus": gpus, "waiting": reason or None,
        "rounds_run": job.rounds_run, "attained_gpu_s": round(job.attained_gpu_s, 1),
        "latest_model": job.model_key, "final_model": job.final_key,
        "jct_s": None if job.completed_at is None else round(job.completed_at - job.submitted_at, 3),
    }


def cmd_status(args: argparse.Namespace) -> int:
    print(json.dumps(job_status(asyncio.run(_folded(args)), args.job), indent=2))
    return 0


def progress_line(job: JobRecord, rate: float, width: int = 30) -> str:
    done = job.progress_steps()
    frac = done / job.spec.iterations
    bar = "#" * int(frac * width)
    eta = (job.spec.iterations - done) / rate if rate > 0 else float("inf")
    eta_text = "--" if eta == float("inf") else f"{eta:5.0f}s"
    return f"{job.spec.job_id} [{bar:<{width}}] {100 * frac:5.1f}% {done}/{job.spec.iterations} steps {rate:7.1f} steps/s ETA {eta_text} ({job.state})"


def cmd_watch(args: argparse.Namespace) -> int:
    async def run() -> int:
        bus = make_bus(args, source="cli")
        await bus.start()
        state = SchedulerState(rounds_in_order=False)   # topics arrive interleaved in any order
        clock = SystemClock()
        samples: list[tuple[float, int]] = []
        try:
            async with bus.subscribe([JOBS, PLACEMENTS, PROGRESS, MODELS],
                                     f"hadar-watch-{uuid.uuid4().hex[:12]}") as sub:
                async for delivery in sub:
                    try:
                        state.apply(delivery.event)
                    except Rejected:
                        pass   # what the scheduler refused does not count here either
                    await delivery.ack()
                    job = state.jobs.get(args.job)
                    if job is None:
                        continue
                    samples.append((clock.time(), job.progress_steps()))
                    samples[:] = [s for s in samples if s[0] >= samples[-1][0] - 30]
                    dt = samples[-1][0] - samples[0][0]
                    rate = (samples[-1][1] - samples[0][1]) / dt if dt > 0 else 0.0
                    sys.stdout.write("\r" + progress_line(job, rate))
                    sys.stdout.flush()
                    if not job.active:
                        sys.stdout.write("\n")
                        return 0 if job.state == "completed" else 1
        finally:
            await bus.stop()
        return 1

    return asyncio.run(run())


def cmd_model(args: argparse.Namespace) -> int:
    try:
        key = final_key(args.job)
    except ValueError as exc:
        raise UsageError(f"job: {exc}") from None

    async def run() -> int:
        store = make_store(args)
        await store.start()
        try:
            await store.get_file(key, Path(args.out))
        except ObjectNotFound:
            raise UsageError(f"job: no final model for {args.job!r} (not completed yet, or unknown job)") from None
        finally:
            await store.stop()
        return 0

    code = asyncio.run(run())
    print(args.out)
    return code
