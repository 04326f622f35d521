"""Training loss and held-out metric of each task.

* classification -- cross-entropy; metric ``accuracy`` on the held-out split.
* regression -- mean squared error; metric ``mse`` (standardised target).
* language-model -- next-token cross-entropy; metric next-token ``accuracy``.
* ratings -- mean squared error over observed entries only; metric ``mse`` over the
  held-out entries.

``evaluate`` runs in eval mode without gradients, in fixed-size chunks, and restores the
model's previous mode; its result depends only on the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from shared.zoo.datasets import Dataset

__all__ = ["Metric", "loss_function", "evaluate", "METRIC_NAMES"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
EVAL_CHUNK = 512
METRIC_NAMES = {"classification": "accuracy", "regression": "mse",
                "language-model": "accuracy", "ratings": "mse"}


@dataclass(frozen=True, kw_only=True)
class Metric:
    name: str            # "accuracy" (higher is better) or "mse" (lower is better)
    value: float


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _masked_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ratings, mask = y[:, 0], y[:, 1]
    return ((out - ratings) ** 2 * mask).sum() / mask.sum().clamp(min=1.0)


_LOSSES: dict[str, LossFn] = {
    "classification": _cross_entropy, "regression": _mse,
    "language-model": _cross_entropy, "ratings": _masked_mse,
}


def loss_function(task: str) -> LossFn:
    return _LOSSES[task]


def evaluate(model: nn.Module, data: Dataset, device: torch.device | str = "cpu") -> Metric:
    """The held-out metric of ``model`` on ``data`` (see module docstring)."""
    task = data.info.task
    was_training = model.training
    model.eval()
    hits = total = 0.0
    squared = weight = 0.0
    try:
        with torch.no_grad():
            for start in range(0, len(data.test_x), EVAL_CHUNK):
                x = data.test_x[start:start + EVAL_CHUNK].to(device)
                y = data.test_y[start:start + EVAL_CHUNK].to(device)
                out = model(x)
                if task in ("classification", "language-model"):
                    hits += float((out.argmax(dim=-1) == y).sum())
                    total += y.numel()
                elif task == "regression":
                    squared += float(((out - y) ** 2).sum())
                    weight += y.numel()
                else:
                    ratings, mask = y[:, 0], y[:, 1]
                    squared += float(((out - ratings) ** 2 * mask).sum())
                    weight += float(mask.sum())
    finally:
        model.train(was_training)
    if METRIC_NAMES[task] == "accuracy":
        return Metric(name="accuracy", value=hits / max(total, 1.0))
    return Metric(name="mse", value=squared / max(weight, 1.0))
