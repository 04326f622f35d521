"""The training subprocess: ``python -m services.agent.worker.main``, WorkerSpecs on stdin.

One process per DDP rank of a job copy. For each spec it starts from (in this order) its
own checkpoint of this round if one exists (an agent that restarted mid-round resumes
where it stopped), else the ``start_from`` model (waiting for it to appear until the
deadline: the tracker may still be writing it), else the job's seed; trains until the
step budget, the deadline or a stop; then rank 0 writes the checkpoint and every rank
reports. It talks to the object store itself and reports to the daemon only through its
stdout (see :mod:`services.agent.protocol`); it never holds a bus connection.

**Warm.** A worker outlives its spec when the spec has a warm key
(:mod:`services.agent.slots`): it keeps the interpreter, torch, the device, the data set on
it, the built model, the store client and -- for a DDP rank -- its process group
(:class:`services.agent.worker.session.Session`), and takes the next spec of the same job and
rank set from stdin. The start state of a spec never depends on what the process did
before: the weights are loaded strictly from the start file (every tensor of the model),
the optimizer is made afresh and loaded from the file's state when it has one, and a spec
with nothing to start from rebuilds the model from the seed -- so a warm worker computes
exactly what a fresh one would. Every rank of a DDP copy loads the start file itself
(in place, under the kept DDP wrapper), and all ranks check together that they run the
same spec from the same weights before the first step
(:func:`services.agent.worker.session.agree_start`). A spec for another job, model, device or
rank set is refused (the daemon never sends one).

A stop line for the running copy finishes the current step, checkpoints and reports
``preempted`` (a warm worker then waits for its next spec); SIGTERM (or SIGINT) does the
same and exits. A deadline reached mid-interval still checkpoints the steps done. Any
exception -- a bad checkpoint, a model the zoo lacks, out of memory, a lost DDP peer --
is reported as ``failed`` with the reason and the process exits with code 1.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()   # before the heavy imports: "setup_s" in reports includes them

import math
import os
import queue
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import structlog
import torch
from torch import nn

from services.agent.protocol import WorkerSpec, parse_stop_line, worker_line
from services.agent.slots import warm_key
from services.agent.worker.checkpoint import (
    CheckpointMeta,
    restore,
    save_checkpoint,
)
from services.agent.worker.session import (
    Session,
    StoreClient,
    agree_start,
    close_group,
    on_device,
    open_group,
    state_digest,
)
from services.agent.worker.start_state import load_start
from services.agent.worker.training import (
    BatchSampler,
    LoopResult,
    StopCode,
    TrainingLoop,
)
from services.agent.worker.user_job import UserCodeWorker, UserSession
from shared.domain import local_sgd
from shared.errors import ConfigError
from shared.runtime.logging import capture_prints, configure_logging
from shared.zoo import Metric, build_model, evaluate, load_dataset, make_optimizer

STATUS = {StopCode.BUDGET: "ok", StopCode.DEADLINE: "ok", StopCode.PREEMPTED: "preempted"}


class Worker:
    """Runs one spec, in a fresh or a warm :class:`Session` (module rules)."""

    def __init__(self, spec: WorkerSpec, out: TextIO, spec_wait_s: float = 0.0,
                 session: Session | None = None) -> None:
        self.spec = spec
        self.spec_wait_s = spec_wait_s   # how long this process waited for the spec (spare or warm)
        self.out = out
        self.session = session
        self.stop_requested = False
        self.loop: TrainingLoop | None = None

    def emit(self, kind: str, **fields: Any) -> None:
        self.out.write(worker_line(kind, **fields) + "\n")
        self.out.flush()

    def request_stop(self, *_: Any) -> None:
        self.stop_requested = True
        if self.loop is not None:
            self.loop.preempted = True

    def _session(self) -> tuple[Session, bool]:
        """The session to run in (a new one unless the warm one fits) and whether it is warm."""
        spec, old = self.spec, self.session
        key, target = warm_key(spec), spec.store.to_json().__repr__()
        if old is not None:
            if old.key is None or old.key != key:
                raise ValueError("this worker holds another job's or rank set's state; a spec for "
                                 f"{spec.job_id}/{spec.model} needs a fresh worker")
            if old.store_target != target:
                old.store.close()
                old.store, old.store_target = StoreClient(spec.store), target
            return old, True
        torch.set_num_threads(spec.threads)
        device = self._device()
        data = on_device(load_dataset(spec.dataset), device)
        model = build_model(spec.model, data.info, seed=spec.seed).to(device)
        session = Session(key=key, device=device, data=data, model=model, store=StoreClient(spec.store),
                          store_target=target)
        self.session = session
        return session, False

    def run(self) -> int:
        spec = self.spec
        received = time.time()
        try:
            session, warm = self._session()
            model, device, data, store = session.model, session.device, session.data, session.store
            optimizer = make_optimizer(spec.optimizer, list(model.parameters()), spec.lr)   # never carried over
            round_steps, total = self._load_start(store, model, optimizer)
            local_sgd.install(optimizer, spec.local_sgd, start_job_step=total)
            trained: nn.Module = model
            control, digest = None, None
            if spec.rendezvous:   # DDP whenever there is a rendezvous, even for one rank
                digest = state_digest(model.state_dict())
                if session.group is None:
                    session.group = open_group(spec, model, device, time.time())
                agree_start(spec, session.group, digest, time.time())
                trained, control = session.group.ddp, session.group.control
            ready = time.time()
            self.emit("started", steps_round=round_steps, steps_total=total, pid=os.getpid(), warm=warm,
                      setup_s=round(ready - (received if warm else PROCESS_START), 3), ready_at=ready,
                      spec_wait_s=round(self.spec_wait_s, 3), weights=digest)
            sampler = BatchSampler(len(data.train_x), spec.batch_size, (spec.seed, spec.copy, spec.rank), device)
            self.loop = TrainingLoop(model=trained, optimizer=optimizer, data=data, sampler=sampler,
                                     device=device, world_size=spec.world_size, slowdown=spec.slowdown,
                                     progress_s=spec.progress_s, control_group=control)
            self.loop.preempted = self.stop_requested
            report = self._progress if spec.rank == 0 else None
            session.trained = True
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
            return 1   # the process exits: its group (if any) is left in main()

    def _device(self) -> torch.device:
        if self.spec.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("assigned a CUDA device, but CUDA is not available to the worker")
            return torch.device("cuda", 0)   # CUDA_VISIBLE_DEVICES holds exactly this worker's GPU
        return torch.device("cpu")

    def _progress(self, steps_round: int, steps_total: int, samples_per_s: float, loss: float) -> None:
        self.emit("progress", steps_round=steps_round, steps_total=steps_total,
                  samples_per_s=samples_per_s, loss=loss)

    def _from_seed(self, model: nn.Module) -> None:
        """Reset a warm model to the seed's weights (a fresh process would build exactly these)."""
        session = self.session
        if session is not None and session.trained:
            spec = self.spec
            fresh = build_model(spec.model, session.data.info, seed=spec.seed)
            model.load_state_dict(fresh.state_dict(), strict=True)
            session.trained = False

    def _load_start(self, store: StoreClient, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """Load the starting state (worker/start_state.py); return (steps already done this
        round, total steps)."""
        tensors, round_steps, total = load_start(store, self.spec, emit=self.emit, stopped=lambda: self.stop_requested)
        if tensors is None:
            self._from_seed(model)
        else:
            restore(model, optimizer, tensors)
        return round_steps, total

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
            spec.ledger().record(spec.checkpoint, path)   # before the upload: see worker/ledger.py
            self.emit("uploading", key=spec.checkpoint)   # the agent lets an upload outlast its stop timeout
            store.put_file(spec.checkpoint, path)   # atomic: readers never see a partial object
        return spec.checkpoint, metric


def emitter(out: TextIO) -> Callable[..., None]:
    """``emit(kind, **fields)``: one protocol line on ``out``."""
    def emit(kind: str, **fields: Any) -> None:
        out.write(worker_line(kind, **fields) + "\n")
        out.flush()
    return emit


def _claim_stdout() -> TextIO:
    """A private handle on the original stdout for the protocol; fd 1 then goes to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return protocol


def _prewarm() -> None:
    """Import what a spec will need, while this process may still be a waiting spare."""
    import sklearn.datasets  # noqa: F401 - imported ahead for its cost (the digits and diabetes loaders)
    import torch.distributed  # noqa: F401 - imported ahead for its cost


class Control:
    """The worker's stdin, read by a thread: specs queue up, stop lines take effect at once.

    A stop names its copy, so one meant for a spec not yet taken is kept for it and one for
    a copy already finished changes nothing: no stop is lost or misapplied, however the
    lines and the specs interleave.
    """

    def __init__(self, stream: Any) -> None:
        self.specs: queue.Queue[str | None] = queue.Queue()
        self.stopped: set[tuple[str, int, int]] = set()
        self.current: Worker | UserCodeWorker | None = None
        self.terminated = False
        self._stream = stream
        threading.Thread(target=self._read, name="control", daemon=True).start()

    def _read(self) -> None:
        for line in self._stream:
            text = line.strip()
            if not text:
                continue
            copy = parse_stop_line(text)
            if copy is None:
                self.specs.put(text)
                continue
            self.stopped.add(copy)
            worker = self.current
            if worker is not None and (worker.spec.job_id, worker.spec.round, worker.spec.copy) == copy:
                worker.request_stop()
        self.specs.put(None)   # end of input: exit once idle

    def terminate(self) -> None:
        """SIGTERM/SIGINT: stop the running spec and exit after it."""
        self.terminated = True
        if self.current is not None:
            self.current.request_stop()

    def next_spec(self) -> str | None:
        """The next spec's text; None once stdin is closed or the process was told to end."""
        while not self.terminated:
            try:
                return self.specs.get(timeout=0.5)
            except queue.Empty:
                continue
        return None

    def begin(self, worker: Worker | UserCodeWorker) -> None:
        spec = worker.spec
        self.current = worker
        if self.terminated or (spec.job_id, spec.round, spec.copy) in self.stopped:
            worker.request_stop()


def _parse_spec(text: str, first: WorkerSpec | None) -> WorkerSpec:
    spec = WorkerSpec.from_json(text)
    if first is None:
        if torch.cuda.is_initialized():   # too late for CUDA_VISIBLE_DEVICES to take effect
            raise ValueError("CUDA was initialised before the spec's environment could be applied")
        os.environ.update(spec.env)
    elif spec.env != first.env:
        raise ValueError("a warm worker cannot change its environment (CUDA_VISIBLE_DEVICES)")
    structlog.contextvars.bind_contextvars(node=spec.node_id, job=spec.job_id, round=spec.round,
                                           copy=spec.copy, rank=spec.rank)
    return spec


def main() -> int:
    out = _claim_stdout()
    control = Control(sys.stdin)
    # installed before the imports: a SIGTERM before the first spec is not lost
    signal.signal(signal.SIGTERM, lambda *_: control.terminate())
    signal.signal(signal.SIGINT, lambda *_: control.terminate())
    configure_logging("worker")   # stderr, which the agent's log shares
    capture_prints()
    _prewarm()
    first: WorkerSpec | None = None
    session: Session | UserSession | None = None
    try:
        while True:
            idle = time.time()
            text = control.next_spec()
            if text is None:   # stdin closed (a spare not needed, or a warm worker retired)
                return 0
            try:
                spec = _parse_spec(text, first)
            except (ValueError, KeyError, TypeError, ConfigError) as exc:  # ConfigError: bad S3 settings
                out.write(worker_line("failed", reason=f"bad worker spec: {exc}"[:500]) + "\n")
                out.flush()
                return 1
            first = first or spec
            wait_s = time.time() - idle
            worker: Worker | UserCodeWorker
            if spec.code is not None and not isinstance(session, Session):
                worker = UserCodeWorker(spec, emitter(out), spec_wait_s=wait_s, session=session,
                                        process_start=PROCESS_START)
            elif spec.code is None and not isinstance(session, UserSession):
                worker = Worker(spec, out, spec_wait_s=wait_s, session=session)
            else:   # the daemon never sends one: a warm key names the kind of job
                out.write(worker_line("failed", reason="bad worker spec: this warm worker runs another kind "
                                                       "of job (zoo or user code)") + "\n")
                out.flush()
                return 1
            control.begin(worker)
            code = worker.run()
            control.current = None
            session = worker.session
            if code != 0 or control.terminated or warm_key(spec) is None:
                return code
    finally:
        if session is not None:
            session.close()
        close_group()   # a group formed by a spec whose session was not kept


if __name__ == "__main__":
    sys.exit(main())
