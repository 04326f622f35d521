"""The training loop of one worker: batches, steps, stopping, throttling, progress.

Guarantees that make a preempted copy resume exactly:

* The batch of a step depends only on (job seed, copy, rank, total step index): each
  (seed, copy, rank) stream walks its own seeded permutation of the training set epoch by
  epoch, and a step's position in that walk is its total step count. A copy that stops
  after k steps and restarts from its checkpoint (weights, optimizer state, total steps)
  therefore computes the very steps an uninterrupted run would have.
* Every rank stops after the same step: with several ranks, they agree each step (one
  tiny all-reduce of a stop code) so no rank waits forever in a collective.
* A step is never interrupted: preemption only sets a flag that is read between steps.

Throttling for emulated GPUs: after each step the loop sleeps ``(slowdown - 1)`` times the
step's own duration, so the step rate is the real rate divided by ``slowdown``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
from torch import nn

from hadar_sdk.batches import BatchSampler
from shared.errors import HadarError
from shared.zoo import Dataset, loss_function

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DivergedError", "StopCode", "BatchSampler", "LoopResult", "TrainingLoop", "ProgressFn"]

ProgressFn = Callable[[int, int, float, float], None]   # steps_round, steps_total, samples/s, loss


class DivergedError(HadarError):
    """The training loss is no longer a finite number: the weights are lost."""


def _finite(loss: float) -> float:
    if not math.isfinite(loss):
        raise DivergedError(f"training diverged: loss is {loss}")
    return loss


class StopCode(IntEnum):
    """Why the loop stopped; a larger code wins when ranks disagree."""

    RUNNING = 0
    BUDGET = 1
    DEADLINE = 2
    PREEMPTED = 3


@dataclass(frozen=True, kw_only=True)
class LoopResult:
    stop: StopCode
    steps_round: int
    steps_total: int
    samples_per_s: float
    loss: float
    train_s: float


class TrainingLoop:
    """Trains ``model`` on ``data`` from a starting step count; see the module guarantees."""

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, data: Dataset,
                 sampler: BatchSampler, device: torch.device, world_size: int = 1,
                 slowdown: float = 1.0, progress_s: float = 2.0, control_group: ProcessGroup | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.loss_fn = loss_function(data.info.task)
        self.train_x = data.train_x.to(device)
        self.train_y = data.train_y.to(device)
        self.device = device
        self.world_size = world_size
        self.slowdown = slowdown
        self.progress_s = progress_s
        self.control_group = control_group   # DDP: a gloo group for the per-step stop code
        self.clock = clock
        self.sleep = sleep
        self.preempted = False

    def _agree(self, code: StopCode) -> StopCode:
        if self.world_size == 1:
            return code
        import torch.distributed as dist

        flag = torch.tensor([int(code)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
        return StopCode(int(flag.item()))

    def run(self, *, start_round_steps: int, start_total: int, budget: int, deadline: float,
            on_progress: ProgressFn | None = None) -> LoopResult:
        steps_round, steps_total = start_round_steps, start_total
        samples_per_step = self.sampler.batch_size * self.world_size
        loss_sum = torch.zeros((), device=self.device)
        window_steps, last_loss = 0, float("nan")   # nan: no step done (reported as null)
        started = window_start = time.perf_counter()
        debt = 0.0
        self.model.train()
        while True:
            code = StopCode.RUNNING
            if steps_round >= budget:
                code = StopCode.BUDGET
            if self.clock() >= deadline:
                code = StopCode.DEADLINE
            if self.preempted:
                code = StopCode.PREEMPTED
            code = self._agree(code)
            if code != StopCode.RUNNING:
                break
            t0 = time.perf_counter()
            index = self.sampler.indices(steps_total)
            loss = self.loss_fn(self.model(self.train_x[index]), self.train_y[index])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            loss_sum += loss.detach()
            steps_round += 1
            steps_total += 1
            window_steps += 1
            now = time.perf_counter()
            if self.slowdown > 1.0:
                debt += (now - t0) * (self.slowdown - 1.0)
                if debt >= 0.001:
                    self.sleep(debt)
                    debt = 0.0
                    now = time.perf_counter()
            if on_progress is not None and now - window_start >= self.progress_s:
                last_loss = _finite(float(loss_sum) / window_steps)
                on_progress(steps_round, steps_total, window_steps * samples_per_step / (now - window_start),
                            last_loss)
                loss_sum.zero_()
                window_steps, window_start = 0, now
        train_s = time.perf_counter() - started
        if window_steps:
            last_loss = _finite(float(loss_sum) / window_steps)
        done = steps_round - start_round_steps
        return LoopResult(stop=code, steps_round=steps_round, steps_total=steps_total,
                          samples_per_s=done * samples_per_step / train_s if train_s > 0 else 0.0,
                          loss=last_loss, train_s=train_s)
