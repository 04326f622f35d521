"""How a copy's training counts toward its job: progress in samples, one rule everywhere.

A job asks for ``W`` workers, each with per-worker batch ``b``; its work is
``total_steps`` steps of its global batch ``W * b``, i.e. ``total_steps * W * b`` samples.
A copy of the job (HadarE forks several) runs on ``k <= W`` workers and keeps ``b``, so one
of its own steps trains ``k * b`` samples:

* in worker-steps (samples / ``b``, an integer count): ``k`` per copy step
  (:func:`worker_steps`); the job is done when its copies' worker-steps reach
  ``total_steps * W``;
* in job steps: ``k / W`` per copy step (:func:`credited_steps`).

A rate is a copy's own steps per second, so a copy at rate ``s`` on ``k`` workers advances
its job by ``s * k / W`` job steps per second. Gavel's throughput table and the roofline
estimator count a step per *worker* (``k`` per copy step); ``ThroughputModel`` and the
profiler convert. The live tracker keeps exact integer worker-steps and reports job steps
as ``worker_steps // W``.
"""

from __future__ import annotations

__all__ = ["credited_steps", "worker_steps"]


def _check(copy_workers: int, job_workers: int | None = None) -> None:
    if copy_workers < 1:
        raise ValueError(f"copy_workers must be >= 1, got {copy_workers}")
    if job_workers is not None and copy_workers > job_workers:
        raise ValueError(f"a copy has at most W={job_workers} workers, got {copy_workers}")


def worker_steps(copy_steps: float, *, copy_workers: int) -> float:
    """Per-worker batches (samples / per-worker batch) that ``copy_steps`` of a copy trained."""
    _check(copy_workers)
    return copy_steps * copy_workers


def credited_steps(copy_steps: float, *, copy_workers: int, job_workers: int) -> float:
    """Job steps (of the job's global batch) that ``copy_steps`` of a copy on ``copy_workers``
    of the job's ``job_workers`` workers are worth: ``copy_steps * k / W``."""
    _check(copy_workers, job_workers)
    return copy_steps * copy_workers / job_workers
