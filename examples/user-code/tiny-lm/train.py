"""Train a byte-level language model under Hadar (see ../README.md), streaming its text.

The corpus (export.py: ``train/*.txt``, ``test/*.txt``) is never held in memory: an index of
windows of ``context + 1`` bytes -- (file, offset) pairs, computed once from the files'
sizes (``os.stat``) -- and each step reads just its batch's windows with open/seek/read
(the window indices :class:`hadar_sdk.BatchSampler` gives for the step).
Config: ``lr`` (peak Adam learning rate), ``context`` (bytes a window predicts),
``total_steps`` (the length of the schedule, normally the job's ``iterations``), and the
model's ``embed`` / ``hidden`` sizes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from model import VOCAB, build, settings
from torch import nn

import hadar_sdk

WARMUP_STEPS = 20
FINAL_LR_FRACTION = 0.1
EVAL_WINDOWS = 256       # fixed held-out windows, evenly spread over the test files
EVAL_BATCH = 128
CLIP_NORM = 1.0


def learning_rate(step: int, *, peak: float, total_steps: int) -> float:
    """A pure function of the job's total step: linear warm-up, cosine down to 10%."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
    return peak * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class Windows:
    """Windows of ``length`` bytes, ``stride`` apart, over the ``*.txt`` files of a folder."""

    def __init__(self, folder: Path, length: int, stride: int) -> None:
        self.files = sorted(folder.glob("*.txt"))
        self.length = length
        sizes = np.array([os.stat(f).st_size for f in self.files], dtype=np.int64)
        counts = np.where(sizes >= length, (sizes - length) // stride + 1, 0)
        self.first = np.concatenate([[0], np.cumsum(counts)])   # window number of each file's first
        self.stride = stride
        if len(self) == 0:
            raise SystemExit(f"no file in {folder} holds {length} bytes")

    def __len__(self) -> int:
        return int(self.first[-1])

    def read(self, index: np.ndarray) -> torch.Tensor:
        """The windows ``index`` as a [len(index), length] int64 tensor, read from the files."""
        out = np.empty((len(index), self.length), dtype=np.uint8)
        file_of = np.searchsorted(self.first, index, side="right") - 1
        for row, (i, f) in enumerate(zip(index.tolist(), file_of.tolist(), strict=True)):
            with open(self.files[f], "rb") as handle:
                handle.seek((i - int(self.first[f])) * self.stride)
                out[row] = np.frombuffer(handle.read(self.length), dtype=np.uint8)
        return torch.from_numpy(out).long()


def loss_of(net: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats per byte) of the windows."""
    logits = net(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1))


@torch.no_grad()
def bits_per_byte(model: nn.Module, test: Windows, device: str) -> float:
    """Held-out bits per byte on the fixed evaluation windows."""
    index = np.unique(np.linspace(0, len(test) - 1, min(EVAL_WINDOWS, len(test))).round().astype(np.int64))
    total, count = 0.0, 0
    for lo in range(0, len(index), EVAL_BATCH):
        part = index[lo:lo + EVAL_BATCH]
        total += float(loss_of(model, test.read(part).to(device))) * len(part)
        count += len(part)
    return total / count / math.log(2)


def main() -> None:
    with hadar_sdk.connect() as run:
        cfg = settings(run.config)
        if run.data_dir is None:
            raise SystemExit("this job needs its data: data: stdlib-text (see export.py)")
        device = "cuda" if run.device == "cuda" else "cpu"
        context = int(cfg["context"])
        train = Windows(run.data_dir / "train", context + 1, context)   # targets cover every byte once
        test = Windows(run.data_dir / "test", context + 1, context)

        if run.world_size > 1:   # several ranks of one copy: torchrun's variables are set
            torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")

        torch.manual_seed(run.seed)   # every copy of the job builds the same initial model
        model = build(cfg).to(device)
        net: nn.Module = model
        if run.world_size > 1:
            net = nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)

        for rnd in run.rounds():
            # A fresh optimizer each round: its state is the start state's (or none), never
            # what this warm process happened to hold from an earlier round.
            opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
            if rnd.restore(model, opt) and run.rank == 0:
                rnd.metric("bits_per_byte", bits_per_byte(model, test, device), of="start")
            sampler = hadar_sdk.BatchSampler(len(train), run.batch_size, rnd.stream, torch.device("cpu"))
            for step in rnd.steps():
                for group in opt.param_groups:
                    group["lr"] = learning_rate(step, peak=cfg["lr"], total_steps=int(cfg["total_steps"]))
                index = sampler.indices(step).numpy()   # which windows to read (indices stay on the CPU)
                loss = loss_of(net, train.read(index).to(device))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
                opt.step()
                rnd.report(samples=len(index), loss=loss.item())
            if run.rank == 0:
                rnd.metric("bits_per_byte", bits_per_byte(model, test, device), of="final")
            rnd.save(model, opt)   # the module itself (not the DDP wrapper): its own tensor names

        if run.world_size > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
