"""Checkpoints as safetensors: model tensors plus optimizer state, never pickled.

Layout of a checkpoint file:

* the model's ``state_dict`` entries under their own names (``blocks.0.conv1.weight``);
* the optimizer's per-parameter state as ``optim.<i>.<name>`` (``i`` is the parameter's
  position in ``model.parameters()``, ``name`` e.g. ``momentum_buffer``, ``exp_avg``,
  ``step``), so the file is all tensors and the tracker can average it like the weights;
* string metadata (:class:`CheckpointMeta`): ``format``, ``job``, ``round``, ``copy``,
  ``steps`` (this round), ``total_steps``, ``gpu_type``, ``model``, ``dataset`` and, when
  known, ``metric_name``/``metric_value`` (held-out metric of these weights).

A consolidated model written by the tracker (``models/{job}/{round}.safetensors``, with
the metadata of :class:`shared.domain.model_meta.ModelMetadata`) is a valid starting point too:
only ``total_steps`` is required to start from a file. A model file holds weights only;
the round's averaged optimizer state is the sibling object ``shared.domain.layout.optim_key``,
which :func:`with_optimizer_state` merges back (without it the optimizer starts fresh).

Any file that does not fit the model -- unreadable, a missing or extra tensor, a wrong
shape, a bad ``total_steps`` -- raises :class:`CheckpointError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hadar_sdk.state import StateMismatch, restore_state, state_tensors
from shared.domain.model_meta import OPTIM_PREFIX
from shared.errors import HadarError

__all__ = ["CheckpointError", "CheckpointMeta", "OPTIM_PREFIX", "FORMAT", "state_tensors",
           "save_checkpoint", "read_checkpoint", "read_stored", "restore", "read_total_steps", "with_optimizer_state"]

FORMAT = "hadar-checkpoint-1"


class CheckpointError(HadarError):
    """A checkpoint that cannot be read or does not fit the model it is loaded into."""


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    job: str
    round: int
    copy: int
    steps: int          # steps of this round (the copy's, not per worker)
    total_steps: int    # steps of the starting model + steps
    gpu_type: str
    model: str
    dataset: str
    metric_name: str = ""
    metric_value: float | None = None

    def to_metadata(self) -> dict[str, str]:
        meta = {"format": FORMAT, "job": self.job, "round": str(self.round), "copy": str(self.copy),
                "steps": str(self.steps), "total_steps": str(self.total_steps),
                "gpu_type": self.gpu_type, "model": self.model, "dataset": self.dataset}
        if self.metric_name and self.metric_value is not None:
            meta["metric_name"] = self.metric_name
            meta["metric_value"] = repr(self.metric_value)
        return meta

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> CheckpointMeta:
        try:
            value = meta.get("metric_value")
            return cls(job=meta["job"], round=int(meta["round"]), copy=int(meta["copy"]),
                       steps=int(meta["steps"]), total_steps=int(meta["total_steps"]),
                       gpu_type=meta["gpu_type"], model=meta["model"], dataset=meta["dataset"],
                       metric_name=meta.get("metric_name", ""),
                       metric_value=float(value) if value is not None else None)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"checkpoint metadata: {type(exc).__name__}: {exc}") from None


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    meta: CheckpointMeta) -> None:
    """Write the checkpoint file at ``path`` (a local file; callers upload it atomically)."""
    save_file(state_tensors(model, optimizer), str(path), metadata=meta.to_metadata())


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file; CheckpointError if it is not one."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own and OS errors; all mean "unreadable"
        raise CheckpointError(f"unreadable checkpoint: {type(exc).__name__}: {exc}"[:300]) from None
    return tensors, meta


def read_stored(key: str, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """:func:`read_checkpoint` of ``path``, fetched from the store's ``key`` (named in the error)."""
    try:
        return read_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(f"bad checkpoint {key}: {exc}") from None


def read_total_steps(meta: dict[str, str]) -> int:
    try:
        steps = int(meta["total_steps"])
    except (KeyError, ValueError):
        raise CheckpointError(f"checkpoint metadata: total_steps missing or not an integer "
                              f"({meta.get('total_steps')!r})") from None
    if steps < 0:
        raise CheckpointError(f"checkpoint metadata: total_steps must be >= 0, got {steps}")
    return steps


def with_optimizer_state(weights: dict[str, torch.Tensor],
                         optim: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model file's tensors plus the optimizer state stored beside it: every tensor of
    ``optim`` must be named ``optim.*`` and none of ``weights`` may be (CheckpointError)."""
    if any(not name.startswith(OPTIM_PREFIX) for name in optim):
        bad = next(name for name in optim if not name.startswith(OPTIM_PREFIX))
        raise CheckpointError(f"optimizer state holds {bad!r}, not named {OPTIM_PREFIX}*")
    if any(name.startswith(OPTIM_PREFIX) for name in weights):
        raise CheckpointError("the model file already holds optimizer state")
    return {**weights, **optim}


def restore(model: nn.Module, optimizer: torch.optim.Optimizer | None,
            tensors: dict[str, torch.Tensor]) -> bool:
    """Load weights (strictly) and, if present, optimizer state. True if optimizer state was
    loaded (:func:`hadar_sdk.state.restore_state`, the rule user code restores by too)."""
    try:
        return restore_state(model, optimizer, tensors)
    except StateMismatch as exc:
        raise CheckpointError(str(exc)) from None
