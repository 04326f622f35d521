"""Train the digits CNN under Hadar (see ../README.md): the SDK loop, one iteration per round.

Data: the folder written by export.py, read with ``np.load(..., mmap_mode="r")``; each step
reads only its batch (the indices :class:`hadar_sdk.BatchSampler` gives for the step).
Config (the job's ``config``): ``lr`` (peak learning rate), ``total_steps`` (the length of
the cosine schedule, normally the job's ``iterations``), ``channels`` (width of the CNN).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from model import build, settings
from torch import nn

import hadar_sdk

WARMUP_STEPS = 10
EVAL_BATCH = 512


def learning_rate(step: int, *, peak: float, total_steps: int) -> float:
    """A pure function of the job's total step: linear warm-up, then cosine decay to 0."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def batch(images: np.ndarray, labels: np.ndarray, index: np.ndarray, device: str) -> tuple[torch.Tensor, ...]:
    """Read just these rows of the memory-mapped arrays."""
    x = torch.from_numpy(np.ascontiguousarray(images[index])).to(device)
    y = torch.from_numpy(np.ascontiguousarray(labels[index])).to(device)
    return x, y


@torch.no_grad()
def accuracy(model: nn.Module, images: np.ndarray, labels: np.ndarray, device: str) -> float:
    """Held-out accuracy (BatchNorm in eval mode: its running statistics)."""
    was_training = model.training
    model.eval()
    correct = 0
    for lo in range(0, len(labels), EVAL_BATCH):
        x, y = batch(images, labels, np.arange(lo, min(lo + EVAL_BATCH, len(labels))), device)
        correct += int((model(x).argmax(dim=1) == y).sum())
    model.train(was_training)
    return correct / len(labels)


def main() -> None:
    with hadar_sdk.connect() as run:
        cfg = settings(run.config)
        if run.data_dir is None:
            raise SystemExit("this job needs its data: data: digits (see export.py)")
        device = "cuda" if run.device == "cuda" else "cpu"
        train_x = np.load(run.data_dir / "train-images.npy", mmap_mode="r")
        train_y = np.load(run.data_dir / "train-labels.npy", mmap_mode="r")
        test_x = np.load(run.data_dir / "test-images.npy", mmap_mode="r")
        test_y = np.load(run.data_dir / "test-labels.npy", mmap_mode="r")

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
            opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9, nesterov=True)
            if rnd.restore(model, opt) and run.rank == 0:
                rnd.metric("accuracy", accuracy(model, test_x, test_y, device), of="start")
            sampler = hadar_sdk.BatchSampler(len(train_y), run.batch_size, rnd.stream, torch.device("cpu"))
            net.train()
            for step in rnd.steps():
                for group in opt.param_groups:
                    group["lr"] = learning_rate(step, peak=cfg["lr"], total_steps=int(cfg["total_steps"]))
                index = sampler.indices(step).numpy()   # which rows to read (indices stay on the CPU)
                x, y = batch(train_x, train_y, index, device)
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                rnd.report(samples=len(index), loss=loss.item())
            if run.rank == 0:
                rnd.metric("accuracy", accuracy(model, test_x, test_y, device), of="final")
            rnd.save(model, opt)   # the module itself (not the DDP wrapper): its own tensor names

        if run.world_size > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
