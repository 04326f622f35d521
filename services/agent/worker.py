"""The training subprocess: ``python -m services.agent.worker`` with a WorkerSpec on stdin.

One process per DDP rank of a job copy. It builds the model from the zoo, starts from
(in this order) its own checkpoint of this round if one exists (an agent that restarted
mid-round resumes where it stopped), else the ``start_from`` model (waiting for it to
appear until the deadline: the tracker may still be writing it), else the job's seed;
trains until the step budget, the deadline or SIGTERM; then rank 0 writes the
checkpoint and every rank reports. It talks to the object store itself and reports to
the daemon only through its stdout (see :mod:`services.agent.spec`); it never holds a
bus connection.

SIGTERM (or SIGINT) finishes the current step, checkpoints and exits with status
``preempted``. Any exception -- a bad checkpoint, a model the zoo lacks, out of memory,
a lost DDP peer -- is reported as ``failed`` with the reason, exit code 1.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()   # before the heavy imports: "setup_s" in reports includes them

import asyncio  # noqa: E402
import math
import os
import signal
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import structlog
import torch
from torch import nn

from services.agent.checkpoint import (
    CheckpointError, CheckpointMeta, read_checkpoint, read_total_steps, restore, save_checkpoint,
    with_optimizer_state,
)
from services.agent.spec import StoreTarget, WorkerSpec, worker_line
from services.agent.training import BatchSampler, LoopResult, StopCode, TrainingLoop
from shared import local_sgd
from shared.config import ConfigError
from shared.layout import optim_key_of
from shared.logging import capture_prints, configure_logging
from shared.store import ObjectStore
from shared.zoo import Metric, build_model, evaluate, load_dataset, make_optimizer

START_POLL_S = 0.25
STATUS = {StopCode.BUDGET: "ok", StopCode.DEADLINE: "ok", StopCode.PREEMPTED: "preempted"}


class StoreClient:
    """Blocking façade over the async store, for this synchronous process."""

    def __init__(self, target: StoreTarget) -> None:
        self._loop = asyncio.new_event_loop()
        self._store: ObjectStore = target.open()
        self._loop.run_until_complete(self._store.start())

    def exists(self, key: str) -> bool:
        return self._loop.run_until_complete(self._store.exists(key))

    def get_file(self, key: str, path: Path) -> None:
        self._loop.run_until_complete(self._store.get_file(key, path))

    def put_file(self, key: str, path: Path) -> None:
        self._loop.run_until_complete(self._store.put_file(key, path))

    def close(self) -> None:
        try:
            self._loop.run_until_complete(self._store.stop())
        finally:
            self._loop.close()


class Worker:
    def __init__(self, spec: WorkerSpec, out: TextIO, spec_wait_s: float = 0.0) -> None:
        self.spec = spec
        self.spec_wait_s = spec_wait_s   # how long this process waited as a warm spare
        self.out = out
        self.stop_requested = False
        self.loop: TrainingLoop | None = None

    def emit(self, kind: str, **fields: Any) -> None:
        self.out.write(worker_line(kind, **fields) + "\n")
        self.out.flush()

    def request_stop(self, *_: Any) -> None:
        self.stop_requested = True
        if self.loop is not None:
            self.loop.preempted = True

    def run(self) -> int:
        spec = self.spec
        store: StoreClient | None = None
        distributed = False
        try:
            torch.set_num_threads(spec.threads)
            device = self._device()
            data = load_dataset(spec.dataset)
            model = build_model(spec.model, data.info, seed=spec.seed).to(device)
            optimizer = make_optimizer(spec.optimizer, list(model.parameters()), spec.lr)
            store = StoreClient(spec.store)
            round_steps, total = self._load_start(store, model, optimizer)
            local_sgd.install(optimizer, spec.local_sgd, start_job_step=total)
            trained: nn.Module = model
            control = None
            if spec.rendezvous:   # DDP whenever there is a rendezvous, even for one rank
                distributed = True
                trained, control = self._init_distributed(model, device)
            self.emit("started", steps_round=round_steps, steps_total=total, pid=os.getpid(),
                      setup_s=round(time.time() - PROCESS_START, 3), spec_wait_s=round(self.spec_wait_s, 3))
            sampler = BatchSampler(len(data.train_x), spec.batch_size, (spec.seed, spec.copy, spec.rank), device)
            self.loop = TrainingLoop(model=trained, optimizer=optimizer, data=data, sampler=sampler,
                                     device=device, world_size=spec.world_size, slowdown=spec.slowdown,
                                     progress_s=spec.progress_s, control_group=control)
            self.loop.preempted = self.stop_requested
            report = self._progress if spec.rank == 0 else None
            result = self.loop.run(start_round_steps=round_steps, start_total=total,
                                   budget=spec.step_budget, deadline=spec.deadline, on_progress=report)
            key, metric = None, None
            if spec.rank == 0:   # DDP keeps every rank's weights equal: one checkpoint per copy
                key, metric = self._checkpoint(store, model, optimizer, data, result)
            self.emit("finished", status=STATUS[result.stop], steps_round=result.steps_round,
                      steps_total=result.steps_total, samples_per_s=result.samples_per_s,
                      loss=None if math.isnan(result.loss) else result.loss, checkpoint=key,
                      train_s=result.train_s, metric=None if metric is None else [metric.name, metric.value])
            return 0
        except BaseException as exc:  # report every failure, including KeyboardInterrupt
            reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
            self.emit("failed", reason=reason)
            return 1
        finally:
            if distributed:
                _destroy_process_group()
            if store is not None:
                store.close()

    def _device(self) -> torch.device:
        if self.spec.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("assigned a CUDA device, but CUDA is not available to the worker")
            return torch.device("cuda", 0)   # CUDA_VISIBLE_DEVICES holds exactly this worker's GPU
        return torch.device("cpu")

    def _progress(self, steps_round: int, steps_total: int, samples_per_s: float, loss: float) -> None:
        self.emit("progress", steps_round=steps_round, steps_total=steps_total,
                  samples_per_s=samples_per_s, loss=loss)

    def _load_start(self, store: StoreClient, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """Load the starting state; return (steps already done this round, total steps)."""
        spec = self.spec
        if store.exists(spec.checkpoint):
            tensors, meta = self._fetch(store, spec.checkpoint)
            own = CheckpointMeta.from_metadata(meta)
            if (own.job, own.round, own.copy) != (spec.job_id, spec.round, spec.copy):
                raise CheckpointError(f"{spec.checkpoint} belongs to {own.job}/{own.round}/{own.copy}")
            restore(model, optimizer, tensors)
            return own.steps, own.total_steps
        if spec.start_from is None:
            return 0, 0
        while not store.exists(spec.start_from):
            if self.stop_requested:
                raise RuntimeError(f"stopped while waiting for start model {spec.start_from}")
            if time.time() >= spec.deadline:
                raise RuntimeError(f"start model {spec.start_from} not found by the round deadline")
            time.sleep(START_POLL_S)
        tensors, meta = self._fetch(store, spec.start_from)
        total = read_total_steps(meta)
        optim = optim_key_of(spec.start_from)   # a round model's optimizer state lies beside it
        if optim is not None and store.exists(optim):
            tensors = with_optimizer_state(tensors, self._fetch(store, optim)[0])
        restore(model, optimizer, tensors)
        return 0, total

    @staticmethod
    def _fetch(store: StoreClient, key: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        with tempfile.TemporaryDirectory(prefix="hadar-start-") as tmp:
            path = Path(tmp) / "model.safetensors"
            store.get_file(key, path)
            try:
                return read_checkpoint(path)
            except CheckpointError as exc:
                raise CheckpointError(f"bad checkpoint {key}: {exc}") from None

    def _init_distributed(self, model: nn.Module, device: torch.device) -> tuple[nn.Module, object | None]:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        spec = self.spec
        assert spec.rendezvous is not None
        backend = "nccl" if device.type == "cuda" else "gloo"
        wait_s = max(60.0, spec.deadline - time.time() + 60.0)
        dist.init_process_group(backend, init_method=f"tcp://{spec.rendezvous}", rank=spec.rank,
                                world_size=spec.world_size, timeout=timedelta(seconds=wait_s))
        control = dist.new_group(backend="gloo") if backend == "nccl" else None
        wrapped = DistributedDataParallel(model, device_ids=[0] if device.type == "cuda" else None)
        return wrapped, control

    def _checkpoint(self, store: StoreClient, model: nn.Module, optimizer: torch.optim.Optimizer,
                    data: Any, result: LoopResult) -> tuple[str, Metric]:
        spec = self.spec
        metric = evaluate(model, data, next(model.parameters()).device)
        meta = CheckpointMeta(job=spec.job_id, round=spec.round, copy=spec.copy, steps=result.steps_round,
                              total_steps=result.steps_total, gpu_type=spec.gpu_type, model=spec.model,
                              dataset=spec.dataset, metric_name=metric.name, metric_value=metric.value)
        with tempfile.TemporaryDirectory(prefix="hadar-ckpt-") as tmp:
            path = Path(tmp) / "checkpoint.safetensors"
            save_checkpoint(path, model, optimizer, meta)
            store.put_file(spec.checkpoint, path)   # atomic: readers never see a partial object
        return spec.checkpoint, metric


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _claim_stdout() -> TextIO:
    """A private handle on the original stdout for the protocol; fd 1 then goes to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return protocol


def _prewarm() -> None:
    """Import what a spec will need, while this process may still be a waiting spare."""
    import sklearn.datasets  # noqa: F401  (the digits and diabetes loaders)
    import torch.distributed  # noqa: F401


def main() -> int:
    out = _claim_stdout()
    pending: list[Worker] = []
    stop_signalled = False

    def on_signal(*_: Any) -> None:  # installed first: a SIGTERM before the spec is not lost
        nonlocal stop_signalled
        stop_signalled = True
        for worker in pending:
            worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    configure_logging("worker")   # stderr, which the agent's log shares
    capture_prints()
    _prewarm()
    ready = time.time()
    text = sys.stdin.read()
    if not text.strip():   # a spare the daemon no longer needs
        return 0
    try:
        spec = WorkerSpec.from_json(text)
        if torch.cuda.is_initialized():   # too late for CUDA_VISIBLE_DEVICES to take effect
            raise ValueError("CUDA was initialised before the spec's environment could be applied")
        os.environ.update(spec.env)
        structlog.contextvars.bind_contextvars(node=spec.node_id, job=spec.job_id, round=spec.round,
                                               copy=spec.copy, rank=spec.rank)
    except (ValueError, KeyError, TypeError, ConfigError) as exc:  # ConfigError: bad S3 settings
        out.write(worker_line("failed", reason=f"bad worker spec: {exc}"[:500]) + "\n")
        out.flush()
        return 1
    worker = Worker(spec, out, spec_wait_s=time.time() - ready)
    pending.append(worker)
    if stop_signalled:
        worker.request_stop()
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
