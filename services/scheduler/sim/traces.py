"""Job traces for the simulator: CSV files, Gavel's TSV traces, Sia's job lists and a seeded generator.

Five sources, all producing ``TraceJob`` records sorted by (arrival, input order):

* CSV with a header naming the columns ``job_id,arrival_time_s,job_type,scale_factor,
  total_steps`` (any order) and optionally ``priority`` (default 1), ``queue`` (default: the
  default queue), ``user`` and ``priority_class`` (default 0) for runs with team queues
  (``hadar sim --queues``). ``job_type`` must be a job type of the throughput table, e.g.
  ``ResNet-50 (batch size 64)``.
* Gavel's 10-column tab-separated trace (``scheduler/traces/*.trace`` in
  stanford-futuredata/gavel): job_type, command, working_directory, num_steps_arg,
  needs_data_dir, total_steps, scale_factor, priority_weight, SLO, arrival_time. Jobs get
  ids ``j<line number>``; command, directory, steps argument, data-dir flag and SLO are not
  used by the simulator and are not checked beyond being present. Gavel counts a step per
  worker (its scheduler sums the steps of a gang's workers), so ``total_steps`` here is
  Gavel's divided by the scale factor, rounded, at least 1.

``TraceJob.total_steps`` is in steps of the job's global batch, as a live job's
iterations (``shared.domain.progress``); a CSV's ``total_steps`` column is read as such.
* ``gen:jobs=N,rate=R,seed=S,multi_gpu=true|false,queues=A/B/...``: Gavel's job
  distribution (see ``generate_jobs``). ``rate`` is jobs per hour (default 0: every job
  arrives at t=0), ``seed`` defaults to the caller's seed, ``multi_gpu`` defaults to false
  (as Gavel's generator does without --generate-multi-gpu-jobs). ``queues`` (optional,
  '/'-separated queue names) gives every job a queue: ``assign_queues`` draws job i's
  queue as ``names[k_i]`` where ``k = numpy.random.default_rng([seed, 1]).integers(len(names),
  size=N)`` -- uniformly, from a generator of its own, so the jobs themselves are those of
  the same spec without ``queues``. A name listed k times is drawn k times as often
  (``queues=a/b/b`` puts about two thirds of the jobs in b).
* Sia's and Pollux's job lists, ``name,time,application,num_replicas,batch_size``: rigid jobs
  on Sia's measured profiles (``services/scheduler/sim/sia_traces.py``).
* Pollux's copy of Microsoft's Philly trace, ``timestamp,duration,num_gpus,gpu_time,cluster``:
  rigid jobs whose types are drawn with the caller's seed (``philly_traces.py``).

A bad line raises ``TraceError`` whose one-line message names the file, line and field.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from services.scheduler.core.throughput import ThroughputModel
from shared.errors import UsageError
from shared.wire.records import QUEUE_NAME_RE

CSV_REQUIRED = ("job_id", "arrival_time_s", "job_type", "scale_factor", "total_steps")
CSV_OPTIONAL = ("priority", "queue", "user", "priority_class")
GAVEL_COLUMNS = ("job_type", "command", "working_directory", "num_steps_arg", "needs_data_dir",
                 "total_steps", "scale_factor", "priority_weight", "SLO", "arrival_time")
REFERENCE_GPU = "v100"  # total steps of generated jobs = duration x throughput on this type


class TraceError(UsageError):
    """A trace that cannot be read; the message is one line naming where and which field."""


@dataclass(frozen=True, kw_only=True)
class TraceJob:
    job_id: str
    arrival_s: float
    job_type: str
    workers: int        # scale factor W
    total_steps: int
    priority: float = 1.0
    queue: str = ""          # "": the default queue
    user: str = ""
    priority_class: int = 0


# ---------------------------------------------------------------------------- field parsing

def where(source: str, line: int, field: str) -> str:
    return f"{source}: line {line}: field {field}"


def int_field(text: str, *, source: str, line: int, field: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(f"{where(source, line, field)}: {text.strip()!r} is not an integer") from None
    if value < minimum:
        raise TraceError(f"{where(source, line, field)}: {value} is below {minimum}")
    return value


def float_field(text: str, *, source: str, line: int, field: str, positive: bool = False) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise TraceError(f"{where(source, line, field)}: {text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "positive" if positive else "non-negative"
        raise TraceError(f"{where(source, line, field)}: {text.strip()!r} must be finite and {bound}")
    return value


def _job_type_field(text: str, job_types: frozenset[str], *, source: str, line: int) -> str:
    job_type = text.strip()
    if job_type not in job_types:
        raise TraceError(f"{where(source, line, 'job_type')}: {job_type!r} is not a job type of the "
                         "throughput table")
    return job_type


def named_rows(text: str, columns: Sequence[str], *, source: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, cells by column) of a CSV whose header names exactly ``columns`` (any
    order); blank lines skipped, cells stripped; a missing header, other columns or a row of
    the wrong width raise ``TraceError`` naming the line."""
    rows = csv.reader(text.splitlines())
    header = next(rows, None)
    if header is None:
        raise TraceError(f"{source}: line 1: empty trace (expected a header)")
    names = [h.strip() for h in header]
    if sorted(names) != sorted(columns):
        raise TraceError(f"{source}: line 1: expected the columns {','.join(columns)}")
    for index, row in enumerate(rows, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(names):
            raise TraceError(f"{source}: line {index}: {len(row)} fields, header has {len(names)}")
        yield index, dict(zip(names, (c.strip() for c in row)))


def sort_jobs(jobs: Iterable[TraceJob]) -> tuple[TraceJob, ...]:
    return tuple(sorted(jobs, key=lambda j: j.arrival_s))  # stable: input order breaks ties


# ---------------------------------------------------------------------------- CSV

def parse_csv(text: str, *, job_types: Iterable[str], source: str = "<csv>") -> tuple[TraceJob, ...]:
    known = frozenset(job_types)
    rows = csv.reader(text.splitlines())
    header = next(rows, None)
    if header is None:
        raise TraceError(f"{source}: line 1: empty trace (expected a header)")
    columns = [h.strip() for h in header]
    for name in columns:
        if name not in CSV_REQUIRED + CSV_OPTIONAL:
            raise TraceError(f"{where(source, 1, name)}: unknown column (expected "
                             f"{','.join(CSV_REQUIRED)}[,{','.join(CSV_OPTIONAL)}])")
    if len(set(columns)) != len(columns):
        raise TraceError(f"{source}: line 1: a column is named twice")
    missing = [c for c in CSV_REQUIRED if c not in columns]
    if missing:
        raise TraceError(f"{where(source, 1, missing[0])}: missing column")
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for index, row in enumerate(rows, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(columns):
            raise TraceError(f"{where(source, index, columns[len(row)])}: missing ({len(row)} fields, "
                             f"header has {len(columns)})")
        if len(row) > len(columns):
            raise TraceError(f"{source}: line {index}: {len(row)} fields, header has {len(columns)}")
        cell = dict(zip(columns, row))
        job_id = cell["job_id"].strip()
        if not job_id:
            raise TraceError(f"{where(source, index, 'job_id')}: empty")
        if job_id in seen:
            raise TraceError(f"{where(source, index, 'job_id')}: duplicate id {job_id!r}")
        seen.add(job_id)
        priority = 1.0
        if "priority" in cell and cell["priority"].strip():
            priority = float_field(cell["priority"], source=source, line=index, field="priority", positive=True)
        jobs.append(TraceJob(
            job_id=job_id,
            arrival_s=float_field(cell["arrival_time_s"], source=source, line=index, field="arrival_time_s"),
            job_type=_job_type_field(cell["job_type"], known, source=source, line=index),
            workers=int_field(cell["scale_factor"], source=source, line=index, field="scale_factor", minimum=1),
            total_steps=int_field(cell["total_steps"], source=source, line=index, field="total_steps",
                                   minimum=1),
            priority=priority,
            **_team_fields(cell, source=source, line=index),
        ))
    return sort_jobs(jobs)


def _team_fields(cell: dict[str, str], *, source: str, line: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    queue = cell.get("queue", "").strip()
    if queue:
        if not QUEUE_NAME_RE.fullmatch(queue):
            raise TraceError(f"{where(source, line, 'queue')}: {queue!r} is not a queue name "
                             "(1-32 of a-z, 0-9, '-', '_')")
        out["queue"] = queue
    if cell.get("user", "").strip():
        out["user"] = cell["user"].strip()
    if cell.get("priority_class", "").strip():
        value = int_field(cell["priority_class"], source=source, line=line, field="priority_class", minimum=0)
        if value > 100:
            raise TraceError(f"{where(source, line, 'priority_class')}: {value} is above 100")
        out["priority_class"] = value
    return out


# ---------------------------------------------------------------------------- Gavel TSV

def parse_gavel_trace(text: str, *, job_types: Iterable[str], source: str = "<trace>") -> tuple[TraceJob, ...]:
    known = frozenset(job_types)
    jobs: list[TraceJob] = []
    for index, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        fields = raw.split("\t")
        if len(fields) != len(GAVEL_COLUMNS):
            raise TraceError(f"{source}: line {index}: {len(fields)} tab-separated fields, Gavel's "
                             f"format has {len(GAVEL_COLUMNS)}")
        cell = dict(zip(GAVEL_COLUMNS, fields))
        int_field(cell["needs_data_dir"], source=source, line=index, field="needs_data_dir", minimum=0)
        workers = int_field(cell["scale_factor"], source=source, line=index, field="scale_factor", minimum=1)
        gavel_steps = int_field(cell["total_steps"], source=source, line=index, field="total_steps", minimum=1)
        jobs.append(TraceJob(
            job_id=f"j{index}",
            arrival_s=float_field(cell["arrival_time"], source=source, line=index, field="arrival_time"),
            job_type=_job_type_field(cell["job_type"], known, source=source, line=index),
            workers=workers,
            total_steps=max(1, round(gavel_steps / workers)),
            priority=float_field(cell["priority_weight"], source=source, line=index, field="priority_weight",
                                  positive=True),
        ))
    return sort_jobs(jobs)


# ---------------------------------------------------------------------------- generator

@dataclass(frozen=True, kw_only=True)
class GeneratorSpec:
    jobs: int
    rate_per_hour: float = 0.0
    seed: int = 0
    multi_gpu: bool = False
    queues: tuple[str, ...] = ()    # drawn from by assign_queues; (): every job in the default queue


GEN_FIELDS = ("jobs", "rate", "seed", "multi_gpu", "queues")


def parse_generator_spec(spec: str, *, default_seed: int = 0) -> GeneratorSpec:
    """``gen:jobs=N,rate=R,seed=S,multi_gpu=true|false,queues=A/B`` -> GeneratorSpec (jobs
    required)."""
    body = spec.removeprefix("gen:")
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in GEN_FIELDS:
            raise TraceError(f"trace {spec!r}: field {key or item!r}: expected jobs=, rate=, seed=, multi_gpu= "
                             "or queues=")
        if key in values:
            raise TraceError(f"trace {spec!r}: field {key}: given twice")
        values[key] = value.strip()
    if "jobs" not in values:
        raise TraceError(f"trace {spec!r}: field jobs: missing")
    where = f"trace {spec!r}"
    jobs = int_field(values["jobs"], source=where, line=1, field="jobs", minimum=1)
    rate = float_field(values.get("rate", "0"), source=where, line=1, field="rate")
    seed = int_field(values.get("seed", str(default_seed)), source=where, line=1, field="seed", minimum=0)
    flag = values.get("multi_gpu", "false").lower()
    if flag not in ("true", "false"):
        raise TraceError(f"{where}: field multi_gpu: {flag!r} is not true or false")
    queues: tuple[str, ...] = ()
    if "queues" in values:
        queues = tuple(name.strip() for name in values["queues"].split("/"))
        for name in queues:
            if not QUEUE_NAME_RE.fullmatch(name):
                raise TraceError(f"{where}: field queues: {name!r} is not a queue name (1-32 of a-z, 0-9, '-', '_'; "
                                 "names separated by '/')")
    return GeneratorSpec(jobs=jobs, rate_per_hour=rate, seed=seed, multi_gpu=flag == "true", queues=queues)


def assign_queues(jobs: Sequence[TraceJob], names: Sequence[str], *, seed: int) -> tuple[TraceJob, ...]:
    """``jobs`` with job i in queue ``names[k_i]``, ``k = default_rng([seed, 1]).integers(len(names),
    size=len(jobs))`` (module docstring); ``names`` empty: ``jobs`` unchanged."""
    if not names:
        return tuple(jobs)
    picks = np.random.default_rng([seed, 1]).integers(len(names), size=len(jobs))
    return tuple(replace(job, queue=names[int(k)]) for job, k in zip(jobs, picks))


def _draw_scale_factor(rng: np.random.Generator) -> int:
    r = rng.uniform(0.0, 1.0)
    if r < 0.70:
        return 1
    if r < 0.80:
        return 2
    if r < 0.95:
        return 4
    return 8


def _draw_duration_s(rng: np.random.Generator) -> float:
    if rng.uniform(0.0, 1.0) >= 0.8:
        return 60.0 * 10.0 ** rng.uniform(3.0, 4.0)
    return 60.0 * 10.0 ** rng.uniform(1.5, 3.0)


def generate_jobs(*, jobs: int, rate_per_hour: float, multi_gpu: bool, rng: np.random.Generator,
                  throughput: ThroughputModel) -> tuple[TraceJob, ...]:
    """Gavel's job distribution (docs/architecture.md "Simulator and metrics").

    Per job, in this draw order: scale factor (1 unless ``multi_gpu``; else 1/2/4/8 w.p.
    0.70/0.10/0.15/0.05); job type uniformly from the table's types that have a V100 entry,
    re-drawn while the type has no V100 entry at that scale factor (not distributed-capable);
    duration 60*10^U(1.5,3) s w.p. 0.8 else 60*10^U(3,4) s; total steps = int(duration x
    the copy's V100 step rate at the scale factor), at least 1 -- the job's duration alone on
    W V100s, as in Gavel. Arrivals: job 0 at t=0, then gaps drawn
    from an exponential with mean 3600/rate s (rate 0: everyone at t=0).
    """
    if rate_per_hour < 0:
        raise ValueError("rate_per_hour must be >= 0")
    candidates = tuple(t for t in throughput.job_types if throughput.scales(t, REFERENCE_GPU))
    if not candidates:
        raise ValueError(f"throughput table has no {REFERENCE_GPU} entries to generate jobs from")
    out: list[TraceJob] = []
    now = 0.0
    width = len(str(jobs - 1))
    for i in range(jobs):
        if i > 0 and rate_per_hour > 0:
            now += float(rng.exponential(3600.0 / rate_per_hour))
        scale = _draw_scale_factor(rng) if multi_gpu else 1
        while True:
            job_type = candidates[int(rng.integers(len(candidates)))]
            if scale in throughput.scales(job_type, REFERENCE_GPU):
                break
        duration = _draw_duration_s(rng)
        steps = max(1, int(duration * throughput.rate(job_type, REFERENCE_GPU, scale)))
        out.append(TraceJob(job_id=f"j{i:0{width}d}", arrival_s=now, job_type=job_type,
                            workers=scale, total_steps=steps))
    return tuple(out)


# ---------------------------------------------------------------------------- entry point

def _looks_like_gavel(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    return first.count("\t") == len(GAVEL_COLUMNS) - 1


def load_trace(spec: str, *, throughput: ThroughputModel, default_seed: int = 0) -> tuple[TraceJob, ...]:
    """The jobs a ``--trace`` value names: ``gen:...``, a ``.csv`` file or a Gavel trace file.

    A file whose first line has 9 tabs is read as Gavel's format; a CSV whose header is
    ``name,time,application,num_replicas,batch_size`` as Sia's (``sia_traces``; its job types
    are those of ``sia_table``, so ``throughput`` must be that table); anything else as CSV.
    """
    if spec.startswith("gen:"):
        gen = parse_generator_spec(spec, default_seed=default_seed)
        jobs = generate_jobs(jobs=gen.jobs, rate_per_hour=gen.rate_per_hour, multi_gpu=gen.multi_gpu,
                             rng=np.random.default_rng(gen.seed), throughput=throughput)
        return assign_queues(jobs, gen.queues, seed=gen.seed)
    try:
        with open(spec, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise TraceError(f"{spec}: cannot read trace ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{spec}: not a UTF-8 text file") from None
    if _looks_like_gavel(text):
        return parse_gavel_trace(text, job_types=throughput.job_types, source=spec)
    from services.scheduler.sim import sia_traces  # imports this module: not at the top

    if sia_traces.looks_like_sia(text):
        return sia_traces.parse_sia_jobs(text, job_types=throughput.job_types, source=spec)
    from services.scheduler.sim import philly_traces

    if philly_traces.looks_like_philly(text):
        return philly_traces.parse_philly_jobs(text, throughput=throughput, seed=default_seed, source=spec)
    return parse_csv(text, job_types=throughput.job_types, source=spec)
