"""The digits classifier, shared by train.py and by whoever loads the final model::

    import model, safetensors.torch
    net = model.build({"channels": 16})
    net.load_state_dict(safetensors.torch.load_file("final.safetensors"), strict=True)
"""

from __future__ import annotations

from typing import Any

from torch import nn

DEFAULTS: dict[str, Any] = {"lr": 0.05, "total_steps": 400, "channels": 16}


def settings(config: dict[str, Any]) -> dict[str, Any]:
    """The job's ``config`` over the defaults."""
    return {**DEFAULTS, **config}


def build(config: dict[str, Any]) -> nn.Module:
    """Two 3x3 conv layers with BatchNorm, then a linear layer: 8x8 image -> 10 logits."""
    c = int(settings(config)["channels"])
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.MaxPool2d(2),                                     # 8x8 -> 4x4
        nn.Flatten(), nn.Linear(2 * c * 4 * 4, 10),
    )
