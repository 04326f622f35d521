"""Microsoft's Philly trace as Pollux published it: ``timestamp,duration,num_gpus,gpu_time,cluster``.

The file is ``simulator/traces/philly.csv`` on the ``osdi21-artifact`` branch of
``petuum/adaptdl`` (82,248 jobs of Philly's 2017 log, Jeon et al., ATC'19;
``shared/domain/data/philly/README.md``). A CSV whose header names exactly these five
columns, in any order, is read as this format. The trace gives each job its arrival, its
GPU count and how long it ran on Philly's GPUs, not what it trained; so, for every policy
alike:

* arrival = ``timestamp`` (UTC, ``YYYY-MM-DD HH:MM:SS``) in seconds after the earliest
  row's; ``workers`` = ``num_gpus`` (rigid);
* job type: drawn per row, in file order, uniformly from the throughput table's types that
  have a ``REFERENCE_GPU`` entry (for a multi-GPU job, one at a scale above 1: a type the
  table measures only on one GPU is not distributed-capable, as Gavel's generator rules),
  with ``numpy.random.default_rng([seed, 29])`` -- a generator of the trace's own, so the
  policies' seed and the draw are separate knobs only when the caller makes them so;
* work: ``total_steps = max(1, round(duration x rate(type, REFERENCE_GPU, W)))``: the job
  needs what it did on Philly, where it ran on P100-class GPUs (Philly's 12 GB and 24 GB
  GPUs, P100 and P40; Jeon et al. section 2). ``rate`` holds a copy's step rate beyond the
  table's largest measured scale (``throughput.py``), i.e. samples/s scale linearly.
* ``gpu_time`` and ``cluster`` (Philly's virtual cluster) are read and not used.

Ids are ``philly-<row>`` with the data row's 0-based index, zero-padded. A bad row raises
``TraceError`` naming file, line and field.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import numpy as np

from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.sim.traces import (
    TraceError,
    TraceJob,
    float_field,
    int_field,
    named_rows,
    sort_jobs,
    where,
)

PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
REFERENCE_GPU = "p100"
DRAW_STREAM = 29  # default_rng([seed, DRAW_STREAM]): the job-type draw's own stream


def looks_like_philly(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    return sorted(c.strip() for c in first.split(",")) == sorted(PHILLY_COLUMNS)


def job_type_candidates(throughput: ThroughputModel) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(types a 1-GPU job may be, types a multi-GPU job may be), sorted."""
    single = tuple(t for t in throughput.job_types if throughput.scales(t, REFERENCE_GPU))
    multi = tuple(t for t in single if any(s > 1 for s in throughput.scales(t, REFERENCE_GPU)))
    if not multi:
        raise ValueError(f"throughput table has no multi-GPU {REFERENCE_GPU} entries to draw Philly job types from")
    return single, multi


def _timestamp(text: str, *, source: str, line: int) -> float:
    try:
        stamp = dt.datetime.strptime(text.strip(), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise TraceError(f"{where(source, line, 'timestamp')}: {text.strip()!r} is not YYYY-MM-DD HH:MM:SS") from None
    return stamp.replace(tzinfo=dt.UTC).timestamp()


def parse_philly_jobs(text: str, *, throughput: ThroughputModel, seed: int = 0,
                      source: str = "<philly>") -> tuple[TraceJob, ...]:
    """Rows of Pollux's Philly trace -> rigid TraceJobs sorted by arrival (module docstring)."""
    parsed: list[tuple[float, float, int]] = []
    for index, cell in named_rows(text, PHILLY_COLUMNS, source=source):
        parsed.append((
            _timestamp(cell["timestamp"], source=source, line=index),
            float_field(cell["duration"], source=source, line=index, field="duration", positive=True),
            int_field(cell["num_gpus"], source=source, line=index, field="num_gpus", minimum=1),
        ))
    return philly_jobs(parsed, throughput=throughput, seed=seed)


def philly_jobs(rows: Sequence[tuple[float, float, int]], *, throughput: ThroughputModel,
                seed: int) -> tuple[TraceJob, ...]:
    """(arrival timestamp s, duration s, GPUs) rows in file order -> TraceJobs (module docstring)."""
    if not rows:
        return ()
    single, multi = job_type_candidates(throughput)
    rng = np.random.default_rng([seed, DRAW_STREAM])
    draws = rng.random(len(rows))
    first = min(stamp for stamp, _, _ in rows)
    width = len(str(len(rows) - 1))
    jobs = []
    for i, ((stamp, duration, gpus), u) in enumerate(zip(rows, draws)):
        choices = single if gpus == 1 else multi
        job_type = choices[min(int(u * len(choices)), len(choices) - 1)]
        steps = max(1, round(duration * throughput.rate(job_type, REFERENCE_GPU, gpus)))
        jobs.append(TraceJob(job_id=f"philly-{i:0{width}d}", arrival_s=stamp - first, job_type=job_type,
                             workers=gpus, total_steps=steps))
    return sort_jobs(jobs)
