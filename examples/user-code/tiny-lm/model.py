"""The byte-level language model, shared by train.py and by whoever loads the final model::

    import model, safetensors.torch
    net = model.build({})
    net.load_state_dict(safetensors.torch.load_file("final.safetensors"), strict=True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 256   # bytes
DEFAULTS: dict[str, Any] = {"lr": 0.01, "context": 64, "total_steps": 600, "embed": 64, "hidden": 128}


def settings(config: dict[str, Any]) -> dict[str, Any]:
    """The job's ``config`` over the defaults."""
    return {**DEFAULTS, **config}


class ByteGRU(nn.Module):
    """Embedding -> one GRU layer -> linear: the next byte's logits at every position."""

    def __init__(self, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [B, T] int64 -> [B, T, 256]
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


def build(config: dict[str, Any]) -> nn.Module:
    cfg = settings(config)
    return ByteGRU(int(cfg["embed"]), int(cfg["hidden"]))
