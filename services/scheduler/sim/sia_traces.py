"""The Pollux/Sia job-list format: ``name,time,application,num_replicas,batch_size``.

As in ``shared/domain/data/sia/workloads/philly/workload-*.csv`` (Sia's artifact; Pollux's
uses the same columns). A CSV whose header names exactly these five columns, in any order,
is read as this format. Each row becomes a rigid ``TraceJob``: id = ``name``, arrival =
``time`` (s), ``workers = num_replicas``, ``job_type = "<application> (batch size
<batch_size>, W=<num_replicas>)"`` (the global batch and its replicas, ``sia_table``), ``total_steps =
sia_work.total_steps(application, batch_size)`` (the work rule stated there, the same for every
policy). A bad row raises ``TraceError`` naming file, line and field.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.sim.sia_profiles import APPLICATIONS
from services.scheduler.sim.sia_table import job_type_name, parse_job_type
from services.scheduler.sim.sia_work import RESTART_S, total_steps, validated_batches
from services.scheduler.sim.traces import (
    TraceError,
    TraceJob,
    float_field,
    int_field,
    named_rows,
    sort_jobs,
    where,
)

SIA_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


def looks_like_sia(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    names = [c.strip() for c in first.split(",")]
    return sorted(names) == sorted(SIA_COLUMNS)


def parse_sia_jobs(text: str, *, job_types: Iterable[str], source: str = "<sia>",
                   calibrated: bool = True) -> tuple[TraceJob, ...]:
    """Rows of the Sia/Pollux format -> rigid TraceJobs sorted by arrival (module docstring)."""
    known = frozenset(job_types)
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for index, cell in named_rows(text, SIA_COLUMNS, source=source):
        name = cell["name"]
        if not name:
            raise TraceError(f"{where(source, index, 'name')}: empty")
        if name in seen:
            raise TraceError(f"{where(source, index, 'name')}: duplicate name {name!r}")
        seen.add(name)
        app = cell["application"]
        if app not in APPLICATIONS:
            raise TraceError(f"{where(source, index, 'application')}: {app!r} has no profile "
                             f"(known: {', '.join(APPLICATIONS)})")
        batch = int_field(cell["batch_size"], source=source, line=index, field="batch_size", minimum=1)
        replicas = int_field(cell["num_replicas"], source=source, line=index, field="num_replicas", minimum=1)
        batches = validated_batches(app)
        job_type = job_type_name(app, batch, replicas)
        if not batches[0] <= batch <= batches[-1] or job_type_name(app, batch, 1) not in known:
            raise TraceError(f"{where(source, index, 'batch_size')}: {batch} is not a batch size the throughput "
                             f"table has for {app} (validated: {', '.join(map(str, batches))}; "
                             "is the table Sia's?)")
        if job_type not in known:
            raise TraceError(f"{where(source, index, 'num_replicas')}: {replicas} replicas: more GPUs than the "
                             "throughput table has of any one type")
        jobs.append(TraceJob(
            job_id=name,
            arrival_s=float_field(cell["time"], source=source, line=index, field="time"),
            job_type=job_type,
            workers=replicas,
            total_steps=total_steps(app, batch, calibrated=calibrated),
        ))
    return sort_jobs(jobs)


def restart_s_by_job_type(jobs: Iterable[TraceJob]) -> dict[str, float]:
    """``SimOptions.restart_s_by_job_type`` charging each Sia job its application's restart time."""
    out: dict[str, float] = {}
    for job in jobs:
        parsed = parse_job_type(job.job_type)
        if parsed is not None:
            out[job.job_type] = RESTART_S[parsed.application]
    return out
