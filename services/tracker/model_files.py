"""What the tracker stores for a round: a weights-only model that says what it is, the
averaged optimizer state beside it, and the model's held-out metric.

:func:`write_model_files` writes, from one :class:`Weighing`:

* ``model.safetensors``: the averaged tensors *not* named ``optim.*`` -- exactly the
  model's ``state_dict``, so ``load_state_dict(strict=True)`` takes it -- with the weighing's
  metadata plus the job's :class:`~shared.domain.model_meta.ModelDescription` (model, dataset,
  width/depth, zoo view, library version, samples), when the zoo knows the job, or, for user
  code, what rebuilds it (:func:`~shared.domain.model_meta.code_metadata`: the bundle's
  digest, entrypoint, args and config);
* ``optim.safetensors``, only if the replicas hold optimizer state: the averaged
  ``optim.*`` tensors under their own names, for copies that resume from the model.

Both are averages of the *same* copies with the same weights: if writing the optimizer
state rejects a replica (non-finite values), the model is rewritten without it, so the
pair is always consistent, and the returned weighing and metadata are the ones written.

:func:`held_out_metric` evaluates the written model on its dataset's test split with
``shared.zoo.evaluate``; never for user code, which the tracker does not import (its own
script evaluates it on the agents). It is bounded: a model file over :data:`EVAL_MAX_BYTES` is not
evaluated, and any failure (a job the zoo cannot rebuild, tensors that do not fit) gives
``None`` with the reason -- the round is consolidated either way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from services.tracker.averaging.consolidate import (
    Weighing,
    WriteStats,
    write_consolidated,
)
from shared.domain.model_meta import OPTIM_PREFIX, ModelDescription, ModelMetadata, code_metadata
from shared.wire.records import JobSpec

__all__ = ["ModelFiles", "write_model_files", "held_out_metric", "EVAL_MAX_BYTES", "OPTIM_FORMAT"]

EVAL_MAX_BYTES = 256 << 20   # zoo models are a few MB; a bigger file is not evaluated in the tracker
OPTIM_FORMAT = "hadar-optim-1"


@dataclass(frozen=True, kw_only=True)
class ModelFiles:
    weighing: Weighing       # the weighing actually written (both files)
    meta: ModelMetadata           # what the model file says about itself
    stats: WriteStats             # of the model file
    model_path: Path
    optim_path: Path | None       # None: the replicas held no optimizer state


def _describe(spec: JobSpec | None, weighing: Weighing) -> ModelDescription | None:
    if spec is None or spec.code is not None:
        return None
    from shared.zoo import describe  # torch: imported only when a model is written

    try:
        return describe(spec, worker_steps=weighing.total_worker_steps)
    except ValueError:
        return None   # a job the zoo does not know (refused at submission; only forged ones get here)


def write_model_files(weighing: Weighing, tmp_dir: Path, *, job_id: str, round_: int,
                        missing: tuple[int, ...], spec: JobSpec | None, chunk_bytes: int,
                        threads: int = 1, extra: Mapping[str, str] | None = None) -> ModelFiles:
    """Write the round's model (weights only) and its optimizer state into ``tmp_dir``,
    averaging on ``threads`` threads; ``extra`` metadata entries go into the model file."""
    weights = tuple(t for t in weighing.layout if not t.name.startswith(OPTIM_PREFIX))
    optim = tuple(t for t in weighing.layout if t.name.startswith(OPTIM_PREFIX))
    if not weights:   # not a model's checkpoint at all: keep every tensor in the model file
        weights, optim = weighing.layout, ()
    static = {"job": job_id, "round": str(round_), "missing": json.dumps(list(missing)),
              **(code_metadata(spec) if spec is not None else {})}
    model_path, optim_path = tmp_dir / "model.safetensors", tmp_dir / "optim.safetensors"
    while True:
        description = _describe(spec, weighing)
        entries = {**static, **(description.to_metadata() if description else {}), **(extra or {})}
        with open(model_path, "wb") as out:
            stats = write_consolidated(replace(weighing, layout=weights), out, metadata=entries,
                                       chunk_bytes=chunk_bytes, threads=threads)
        weighing = replace(stats.weighing, layout=weighing.layout)
        if not optim:
            break
        with open(optim_path, "wb") as out:
            written = write_consolidated(replace(weighing, layout=optim), out, chunk_bytes=chunk_bytes, threads=threads,
                                         metadata={**static, "format": OPTIM_FORMAT})
        if len(written.weighing.accepted) == len(weighing.accepted):
            break
        weighing = replace(written.weighing, layout=weighing.layout)   # a replica's optimizer state was not finite
    meta = weighing.model_metadata(job=job_id, round_=round_, missing=missing, description=description)
    return ModelFiles(weighing=weighing, meta=meta, stats=stats, model_path=model_path,
                        optim_path=optim_path if optim else None)


def held_out_metric(model_path: Path, spec: JobSpec | None) -> tuple[tuple[str, float] | None, str]:
    """``((name, value), "")`` of the model at ``model_path`` on ``spec``'s dataset, or
    ``(None, why not)``."""
    if spec is None:
        return None, "job spec unknown"
    if spec.code is not None:   # never imported here: the agents evaluate user code (CopyFinished.metric_*)
        return None, "user code: evaluated by its own script on the agents"
    size = model_path.stat().st_size
    if size > EVAL_MAX_BYTES:
        return None, f"model is {size} bytes, more than {EVAL_MAX_BYTES}"
    try:
        import torch
        from safetensors.torch import load_file

        from shared.zoo import build_model, evaluate, load_dataset

        data = load_dataset(spec.dataset)
        model = build_model(spec.model, data.info, seed=spec.hyper.seed)
        model.load_state_dict(load_file(str(model_path)), strict=True)
        with torch.inference_mode():
            metric = evaluate(model, data)
    except Exception as exc:   # anything: the metric is a courtesy, the round is consolidated anyway
        return None, f"{type(exc).__name__}: {exc}"[:300]
    return (metric.name, float(metric.value)), ""
