"""A job whose model is ruined is never stuck for good: the tracker rolls it back.

The failure (issue 26): planted weights were averaged into a job's model; every copy that
started from it diverged (``DivergedError: training diverged: loss is nan``), so every
later round was abandoned without a usable replica, the scheduler kept starting the next
round from the same ruined model, and the job stayed stuck for 19 rounds until stopped.

Choice: **roll back** to the last model that trained, rather than fail the job. A rollback
is in the tracker's own power -- the next round's ``start_from`` is the key of the latest
ModelConsolidated, so announcing a round model that *is* the last good model moves every
later copy onto it, with no change to any event, topic or other service -- and it costs
the job at most the rounds since that model, whereas failing it throws away all of its
work, and cannot be announced at all today (no event says "failed", and the tracker may
not write hadar.jobs). It is also bounded: it happens at most once per model that added
steps, so a job whose rounds keep failing for another reason (its code, its data) is rolled
back once and then left to ``hadar jobs`` / the scheduler's stuck report.

The rule, from the events alone (:class:`~services.tracker.jobs.JobRecord`, so a restarted
tracker replaying them decides the same):

* a model *trained* when copies that started from it added steps to it: the job's
  ``trained_from`` is the ``start_from`` of the latest round whose model added steps (the
  job's starting model when it was one of the job's recent round models;
  :data:`MODELS_REMEMBERED` are remembered, each with the job's exact worker-steps in it);
* a round is *barren* when it ran -- at least one copy reported or was rejected -- and left
  no usable replica (a RoundAbandoned with rejections); rounds whose copies never
  reported (a node lost) do not count either way;
* after :data:`ROLLBACK_AFTER_ROUNDS` - 1 barren rounds in a row since a model that added
  steps, the next barren round is not abandoned: its model (``models/{job}/{round}``) is
  the ``trained_from`` model's tensors, exactly, with that model's optimizer state beside
  it when it has one, and it carries the job's steps *in that model*: the steps credited
  since are taken back (``total_steps`` falls; the scheduler takes the job's steps from
  it). Three, as the scheduler's stuck report (``STUCK_AFTER_ROUNDS``): two rounds that
  fail in a row can be bad luck; three that fail from the same model are the model.

The announcement is an ordinary ModelConsolidated of the round: its one weighed copy is the
lowest of the round's failed or rejected copies, with 0 steps and weight 1 (the shape of a
round whose copies added nothing), the others stay in ``rejected``; the model file's
metadata names the source (``rollback_from``). Not rolled back: a job whose ruined model
was its first (it started from seed, which the tracker does not hold), or whose last good
model was already deleted (``keep_round_models``): those rounds are abandoned as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.tracker.averaging.consolidate import Rejected, Replica, weigh_replicas
from services.tracker.averaging.safetensors_format import RangeReader
from services.tracker.due import DueRound, RollbackTarget
from services.tracker.model_files import ModelFiles, write_model_files

__all__ = ["ROLLBACK_AFTER_ROUNDS", "MODELS_REMEMBERED", "write_rollback"]

ROLLBACK_AFTER_ROUNDS = 3   # barren rounds in a row, this one included, before a rollback
MODELS_REMEMBERED = 4       # a job's latest round models remembered as rollback sources


def write_rollback(work: DueRound, target: RollbackTarget, source: RangeReader, rejected: Sequence[Rejected],
                   tmp_dir: Path, *, chunk_bytes: int, threads: int = 1) -> ModelFiles:
    """Write round ``work.round``'s rollback model: ``source``'s tensors exactly (one replica
    of weight 1 averages to itself), the job's steps those of ``target``. ``rejected``: the
    round's rejections (at least one); the lowest is the weighed copy. Raises
    ``NoUsableReplica`` when the source is not a usable model, ``OSError`` when unreadable."""
    carrier = min(r.copy for r in rejected)
    weighing = weigh_replicas([Replica(copy=carrier, steps=0, reader=source)], mode="steps",
                              rejected=[r for r in rejected if r.copy != carrier],
                              prior_worker_steps=target.worker_steps, job_workers=work.job_workers)
    return write_model_files(weighing, tmp_dir, job_id=work.job_id, round_=work.round, missing=work.missing,
                             spec=work.spec, chunk_bytes=chunk_bytes, threads=threads,
                             extra={"rollback_from": target.key})
