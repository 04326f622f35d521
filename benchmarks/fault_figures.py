"""The fault benchmark's figures, from what a run left: the event log and the stored objects.

Used by :mod:`benchmarks.fault_harness` (which re-exports them), ``benchmarks/faults.py``
and the tests. Per scenario:

* ``jobs_completed``/``jobs_total``: jobs with a JobCompleted the harness did not forge.
* ``models_verified``/``models_total``: ModelConsolidated events whose stored model equals
  the samples-weighted average (steps x the copy's workers; uniform if no copy trained a
  step) recomputed from the stored replicas (integer tensors: the copy with the most
  steps), as ``services/tracker/averaging/consolidate.py`` and ``average.py`` define it.
* ``events_lost``: results produced but never consumed, followed along their chain: a
  JobSubmitted never placed nor listed waiting; a CopyFinished (not failed) of a round
  the tracker decided whose copy is in neither the model, its rejections nor a
  RoundAbandoned; a CopyFinished of a completed job's round that was never decided.
* ``acked_records_lost``: records a producer got an acknowledgement for (journaled at ack
  time, :mod:`benchmarks.fault_acks`) that are not in the topics read back afterwards.
* ``rounds_lost_max``: per job, rounds it ran in whose model did not add steps (abandoned,
  undecided, or a model without progress); the maximum over jobs.
* ``recovery_s``: from the end of the fault (restart, SIGCONT; the kill when left dead) to
  the next model that added steps or job completed (None if none came after it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from shared.domain.layout import checkpoint_key
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    JobCompleted,
    JobSubmitted,
    LeaderRenewed,
    ModelConsolidated,
    RoundAbandoned,
    RoundStarted,
)

__all__ = ["leader_terms", "round_numbering_faults", "progress_times", "rounds_lost", "events_lost",
           "verify_models"]



def leader_terms(records: list[tuple[str, Event]]) -> list[tuple[int, str, float]]:
    """``(term, holder, first renewal's time)`` of every scheduler term, in term order."""
    first: dict[int, tuple[str, float]] = {}
    for _, e in records:
        if isinstance(e, LeaderRenewed) and e.role == "scheduler" and e.term not in first:
            first[e.term] = (e.holder, e.ts)
    return [(term, holder, ts) for term, (holder, ts) in sorted(first.items())]


def round_numbering_faults(records: list[tuple[str, Event]]) -> int:
    """Round numbers published more than once (distinct RoundStarted ids) plus numbers skipped
    between the first and the last: 0 when every round has its own number, in order."""
    ids: dict[int, set[str]] = {}
    for _, e in records:
        if isinstance(e, RoundStarted) and e.source != "forger":
            ids.setdefault(e.round, set()).add(e.id)
    if not ids:
        return 0
    twice = sum(len(v) - 1 for v in ids.values())
    skipped = (max(ids) - min(ids) + 1) - len(ids)
    return twice + skipped


def progress_times(models: list[ModelConsolidated]) -> list[float]:
    """Times of models that added steps to their job, in order."""
    best: dict[str, int] = {}
    times = []
    for m in sorted(models, key=lambda m: (m.ts, m.round)):
        if m.total_steps > best.get(m.job_id, 0):
            best[m.job_id] = m.total_steps
            times.append(m.ts)
    return times


def rounds_lost(records: list[tuple[str, Event]], job_ids: list[str], forged: set[str]) -> dict[str, int]:
    """Per job: rounds it ran in whose model did not add steps."""
    ran: dict[str, set[int]] = {j: set() for j in job_ids}
    productive: dict[str, set[int]] = {j: set() for j in job_ids}
    best: dict[str, int] = {}
    for _, e in records:
        if e.id in forged:
            continue
        if isinstance(e, Assignment) and e.job_id in ran:
            ran[e.job_id].add(e.round)
    for m in sorted((e for _, e in records if isinstance(e, ModelConsolidated) and e.id not in forged),
                    key=lambda m: m.round):
        if m.job_id in productive and m.total_steps > best.get(m.job_id, 0):
            best[m.job_id] = m.total_steps
            productive[m.job_id].add(m.round)
    return {j: len(ran[j] - productive[j]) for j in job_ids}


def events_lost(records: list[tuple[str, Event]], job_ids: list[str], forged: set[str]) -> int:
    """Results produced but never consumed (module docstring)."""
    real = [(t, e) for t, e in records if e.id not in forged]
    placed = {e.job_id for _, e in real if isinstance(e, Assignment)}
    listed = {w.job_id for _, e in real if isinstance(e, RoundStarted) for w in e.waiting}
    lost = sum(1 for _, e in real if isinstance(e, JobSubmitted) and e.job_id in job_ids
               and e.job_id not in placed | listed)
    decided: dict[tuple[str, int], set[int] | None] = {}
    for _, e in real:
        if isinstance(e, ModelConsolidated):
            used = {c.copy for c in e.copies} | {r.copy for r in e.rejected} | set(e.missing)
            decided[(e.job_id, e.round)] = used
        elif isinstance(e, RoundAbandoned):
            decided[(e.job_id, e.round)] = None
    completed = {e.job_id for _, e in real if isinstance(e, JobCompleted)}
    seen: set[tuple[str, int, int]] = set()
    for _, e in real:
        if not isinstance(e, CopyFinished) or e.job_id not in job_ids or e.status == "failed":
            continue
        key = (e.job_id, e.round, e.copy)
        if key in seen:
            continue
        seen.add(key)
        if (e.job_id, e.round) in decided:
            taken = decided[(e.job_id, e.round)]
            lost += taken is not None and e.copy not in taken
        elif e.job_id in completed:
            lost += 1
    return lost


async def verify_models(s3: S3Settings, models: list[ModelConsolidated], records: list[tuple[str, Event]],
                        scratch: Path) -> int:
    """How many of ``models`` equal the samples-weighted average of their stored replicas."""
    workers = {(e.job_id, e.round, e.copy): e.world_size for _, e in records if isinstance(e, Assignment)}
    # A copy's checkpoint is under the node that ran its rank 0: the only node the tracker
    # takes a checkpoint from (services/tracker/acceptance.py) and the one that wrote it.
    writers = {(e.job_id, e.round, e.copy): e.node_id for _, e in records if isinstance(e, Assignment) and 0 in e.ranks}
    store = MinioStore(s3)
    await store.start()
    scratch.mkdir(parents=True, exist_ok=True)
    ok = 0
    for m in models:
        try:
            ok += await _verify_one(store, m, workers, scratch, writers=writers)
        except Exception:
            pass
    return ok


async def _verify_one(store: MinioStore, m: ModelConsolidated, workers: dict, scratch: Path, *,
                      writers: dict[tuple[str, int, int], str]) -> bool:
    """``workers``: each copy's world size; ``writers``: the node that ran each copy's rank 0
    (a copy without one is not verified)."""
    scratch.mkdir(parents=True, exist_ok=True)
    await store.get_file(m.key, scratch / "model.safetensors")
    model = load_file(str(scratch / "model.safetensors"))
    replicas = []
    for c in m.copies:
        path = scratch / f"{c.copy}.safetensors"
        writer = writers[(m.job_id, m.round, c.copy)]
        await store.get_file(checkpoint_key(m.job_id, m.round, c.copy, node=writer), path)
        k = workers.get((m.job_id, m.round, c.copy), 1)
        replicas.append((c.copy, c.steps, c.steps * k, load_file(str(path))))
    if not replicas:
        return False
    total = sum(r[2] for r in replicas)
    # The tracker's weights (services/tracker/averaging/consolidate.py): samples over their total, or
    # uniform when no copy trained a step (copies that started too late to train).
    weights = [r[2] / total if total else 1 / len(replicas) for r in replicas]
    most = min(replicas, key=lambda r: (-r[1], r[0]))[3]
    for name, value in model.items():
        if np.issubdtype(value.dtype, np.integer):
            if not np.array_equal(value, most[name]):
                return False
            continue
        expected = sum(r[3][name].astype(np.float64) * w for r, w in zip(replicas, weights))
        if not np.allclose(value.astype(np.float64), expected, rtol=1e-5, atol=1e-6):
            return False
    return True
