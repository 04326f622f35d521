"""The optimizers a job spec may name (``Hyperparameters.optimizer``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "OPTIMIZER_SLOTS", "SGD_MOMENTUM", "make_optimizer"]

SGD_MOMENTUM = 0.9
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd")
OPTIMIZER_SLOTS = {"sgd": 1, "adam": 2, "adamw": 2}   # state tensors per parameter


def make_optimizer(name: str, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The job's optimizer; ``sgd`` is SGD with momentum 0.9 (state that checkpoints carry)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"optimizer: unknown {name!r}; valid: {', '.join(OPTIMIZERS)}")
