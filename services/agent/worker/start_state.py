"""Where a copy's round starts: its own mid-round checkpoint, the round's start model, or the seed.

One rule for both workers (the zoo's ``worker/main.py`` and a user's code, ``worker/user_job.py``):

1. the checkpoint at the copy's own key, if this node wrote exactly it
   (:mod:`services.agent.worker.ledger`) and it names this job, round and copy: resume
   mid-round, with the steps it already did;
2. else ``start_from`` (a round model, with the optimizer state stored beside it), waited for
   until it exists, the round's deadline, or a stop;
3. else nothing: the job's first round starts from its seed.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.agent.protocol import WorkerSpec
from services.agent.worker.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    read_stored,
    read_total_steps,
    with_optimizer_state,
)
from services.agent.worker.ledger import own_checkpoint
from services.agent.worker.session import StoreClient
from shared.domain.layout import optim_key_of

__all__ = ["StartState", "load_start", "fetch", "START_POLL_S"]

START_POLL_S = 0.25

# (tensors, or None for "from the seed"; steps already done this round; total steps before it)
StartState = tuple[dict[str, torch.Tensor] | None, int, int]


def fetch(store: StoreClient, key: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with tempfile.TemporaryDirectory(prefix="hadar-start-") as tmp:
        path = Path(tmp) / "model.safetensors"
        store.get_file(key, path)
        return read_stored(key, path)


def load_start(store: StoreClient, spec: WorkerSpec, *, emit: Callable[..., None],
               stopped: Callable[[], bool]) -> StartState:
    """The round's starting state (module docstring); ``emit("not_ours", key=...)`` when an
    object this node did not write sits at the copy's own key."""
    mine = own_checkpoint(store, spec.checkpoint, spec.ledger(), lambda path: read_stored(spec.checkpoint, path),
                          lambda: emit("not_ours", key=spec.checkpoint))
    if mine is not None:
        tensors, meta = mine
        own = CheckpointMeta.from_metadata(meta)
        if (own.job, own.round, own.copy) != (spec.job_id, spec.round, spec.copy):
            raise CheckpointError(f"{spec.checkpoint} belongs to {own.job}/{own.round}/{own.copy}")
        return tensors, own.steps, own.total_steps
    if spec.start_from is None:
        return None, 0, 0
    while not store.exists(spec.start_from):
        if stopped():
            raise RuntimeError(f"stopped while waiting for start model {spec.start_from}")
        if time.time() >= spec.deadline:
            raise RuntimeError(f"start model {spec.start_from} not found by the round deadline")
        time.sleep(START_POLL_S)
    tensors, meta = fetch(store, spec.start_from)
    total = read_total_steps(meta)
    optim = optim_key_of(spec.start_from)   # a round model's optimizer state lies beside it
    if optim is not None and store.exists(optim):
        tensors = with_optimizer_state(tensors, fetch(store, optim)[0])
    return tensors, 0, total
