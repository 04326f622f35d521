"""The deterministic batch stream: which samples a step trains on.

The batch of a step depends only on (stream, total step index), where the stream is
(job seed, copy, rank): each stream walks its own seeded permutation of the ``n`` samples
epoch by epoch, and a step's position in that walk is its total step count. A copy that
stops after k steps and resumes from its checkpoint therefore trains on exactly the batches
an uninterrupted run would have. The zoo's training loop and user scripts use this same
rule (:attr:`hadar_sdk.Round.stream`). Only indices are produced, so the data may live in
files read per batch rather than in memory.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BatchSampler"]


class BatchSampler:
    """Indices of the batch of any total step, for one (seed, copy, rank) stream, as a tensor
    on ``device`` (a ``torch.device`` or its name, such as ``run.device``)."""

    def __init__(self, n: int, batch_size: int, stream: tuple[int, ...],
                 device: str | torch.device = "cpu") -> None:
        self.n, self.batch_size, self.stream, self.device = n, batch_size, stream, torch.device(device)
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            seed = int(np.random.SeedSequence([*self.stream, epoch]).generate_state(1, dtype=np.uint64)[0])
            gen = torch.Generator().manual_seed(seed)
            perm = self._perms[epoch] = torch.randperm(self.n, generator=gen).to(self.device)
        return perm

    def indices(self, step: int) -> torch.Tensor:
        start = step * self.batch_size
        first, last = start // self.n, (start + self.batch_size - 1) // self.n
        if first == last:
            offset = start - first * self.n
            return self._perm(first)[offset:offset + self.batch_size]
        parts, position = [], start
        for epoch in range(first, last + 1):
            lo = position - epoch * self.n
            hi = min(self.n, start + self.batch_size - epoch * self.n)
            parts.append(self._perm(epoch)[lo:hi])
            position = epoch * self.n + hi
        return torch.cat(parts)
