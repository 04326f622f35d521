"""The worker's side of a user's own training code: the trusted harness for one rank.

A spec with ``code`` (:class:`~services.agent.protocol.CodeTarget`) is not trained in this
process. The worker -- which holds the store's credentials -- fetches the job's code bundle
and dataset into the node's cache (:class:`~services.agent.worker.artifacts.ArtifactCache`:
size and SHA-256 checked before anything is extracted, extracted read-only), starts the
user's script as a sandboxed child that holds no credential
(:class:`~services.agent.usercode.trainer.Trainer`), and gives it the round: the start state
(this copy's own checkpoint of the round when it is resuming, else the consolidated model
with its averaged optimizer state, else none: the script builds from the job's seed), the
step budget left, the deadline. What the script hands back is checked by the harness before
anything reaches the store (same tensor names, dtypes and shapes as the start; steps and
samples within the budget), and the checkpoint's metadata -- job, round, copy, steps -- is
written here, never taken from the script. A refused or failed round reports ``failed``
with the reason and the end of the script's output, and the process exits (its trainer
with it), so the next round starts a fresh one.

**Warm.** Like a zoo worker (:mod:`services.agent.worker.main`), the process outlives its
spec when the spec has a warm key; so does its trainer, and with it whatever the script
built (its model, its data loaders, a DDP process group it formed).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from services.agent.protocol import WorkerSpec
from services.agent.slots import WarmKey, warm_key
from services.agent.usercode.trainer import RoundRequest, RoundResult, Trainer, TrainerLaunch
from services.agent.worker.artifacts import ArtifactCache
from services.agent.worker.checkpoint import (
    CheckpointMeta,
)
from services.agent.worker.session import StoreClient
from services.agent.worker.start_state import StartState, load_start
from shared.domain.bundles import CODE_LIMITS, DATA_LIMITS
from shared.domain.layout import code_bundle_key, data_bundle_key
from shared.wire.events import MAX_LOG_TAIL

__all__ = ["UserSession", "UserCodeWorker", "default_cache_dir"]



def default_cache_dir(node_id: str) -> Path:
    return Path.home() / ".cache" / "hadar" / "agent" / node_id / "bundles"


@dataclass(kw_only=True)
class UserSession:
    """What a warm worker keeps for a user's code: its store client and its trainer."""

    key: WarmKey | None
    store: StoreClient
    store_target: str
    trainer: Trainer
    leases: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)   # cached bundles in use

    def close(self) -> None:
        try:
            self.trainer.close()
        finally:
            self.leases.close()
            self.store.close()


class UserCodeWorker:
    """Runs one spec of user code, in a fresh or a warm :class:`UserSession`."""

    def __init__(self, spec: WorkerSpec, out: Callable[..., None], spec_wait_s: float = 0.0,
                 session: UserSession | None = None, process_start: float = 0.0) -> None:
        assert spec.code is not None
        self.spec, self.code = spec, spec.code
        self.emit = out
        self.spec_wait_s = spec_wait_s
        self.session = session
        self.process_start = process_start
        self.stop_requested = False

    def request_stop(self, *_: Any) -> None:
        self.stop_requested = True
        if self.session is not None:
            self.session.trainer.request_stop()

    # ------------------------------------------------------------------ session

    def _session(self) -> tuple[UserSession, bool]:
        spec, old = self.spec, self.session
        key, target = warm_key(spec), repr(spec.store.to_json())
        if old is not None:
            if old.key is None or old.key != key:
                raise ValueError("this worker runs another job's or script's trainer; a spec for "
                                 f"{spec.job_id} needs a fresh worker")
            if old.store_target != target:
                old.store.close()
                old.store, old.store_target = StoreClient(spec.store), target
            return old, True
        store = StoreClient(spec.store)
        leases = contextlib.ExitStack()
        try:
            code_dir, data_dir = self._fetch(store, leases)
            scratch = Path(tempfile.mkdtemp(prefix=f"hadar-trainer-{spec.job_id}-"))
            leases.callback(_remove_tree, scratch)
            host, _, port = (spec.rendezvous or "127.0.0.1:29500").rpartition(":")
            trainer = Trainer(TrainerLaunch(
                code_dir=code_dir, entrypoint=self.code.entrypoint, args=self.code.args, scratch=scratch,
                seed=spec.seed, rank=spec.rank, world_size=spec.world_size,
                local_rank=spec.local_ranks.index(spec.rank) if spec.rank in spec.local_ranks else 0,
                master_addr=host, master_port=int(port), batch_size=spec.batch_size,
                device=spec.device, config=self.code.config, data_dir=data_dir, sandbox=self.code.sandbox,
                threads=spec.threads, slowdown=spec.slowdown))
            trainer.start()
        except BaseException:
            leases.close()
            store.close()
            raise
        self.session = UserSession(key=key, store=store, store_target=target, trainer=trainer, leases=leases)
        if self.stop_requested:
            trainer.request_stop()
        return self.session, False

    def _fetch(self, store: StoreClient, leases: contextlib.ExitStack) -> tuple[Path, Path | None]:
        """The code bundle's and the dataset's cached folders, held in use for the session."""
        code = self.code
        cache = ArtifactCache(Path(code.cache_dir) if code.cache_dir else default_cache_dir(self.spec.node_id),
                              max_bytes=code.cache_bytes)

        def fetcher(key: str) -> Callable[[Path], None]:
            return lambda path: store.get_file(key, path)

        code_dir = leases.enter_context(cache.use(code.digest, code.size,
                                                  fetcher(code_bundle_key(code.user, code.digest)),
                                                  limits=CODE_LIMITS))
        data_dir = None
        if code.data_digest:
            data_dir = leases.enter_context(cache.use(code.data_digest, code.data_size,
                                                      fetcher(data_bundle_key(code.user, code.data_digest)),
                                                      limits=DATA_LIMITS))
        return code_dir, data_dir

    # ------------------------------------------------------------------ one round

    def run(self) -> int:
        spec = self.spec
        received = time.time()
        session: UserSession | None = None
        try:
            session, warm = self._session()
            start, round_steps, total = self._load_start(session.store)
            reason = session.trainer.wait_ready()   # the script's own set-up is part of a cold start
            if reason is not None:
                self.emit("failed", reason=f"user code: {reason}"[:500], log_tail=self._tail(session))
                return 1
            ready = time.time()
            self.emit("started", steps_round=round_steps, steps_total=total, pid=os.getpid(), warm=warm,
                      setup_s=round(ready - (received if warm else self.process_start), 3), ready_at=ready,
                      spec_wait_s=round(self.spec_wait_s, 3), weights=None)
            tracker = _Rate(round_steps, total, spec.batch_size * spec.world_size)
            result = session.trainer.run_round(RoundRequest(
                round=spec.round, copy=spec.copy, start_steps=total,
                max_steps=max(0, spec.step_budget - round_steps), seconds=max(0.0, spec.deadline - time.time()),
                max_samples_per_step=spec.batch_size, start=start),
                on_progress=lambda steps, samples, loss: self._progress(tracker, steps, loss))
            if not result.ok:
                self.emit("failed", reason=f"user code: {result.reason}"[:500], log_tail=self._tail(session))
                return 1
            key = None
            if spec.rank == 0 and not spec.evaluation:   # an evaluation copy measures its start, nothing more
                key = self._checkpoint(session.store, result, round_steps, total)
            status = "preempted" if self.stop_requested else "ok"
            name, start_metric, final_metric = _metrics(result)
            self.emit("finished", status=status, steps_round=round_steps + result.steps,
                      steps_total=total + result.steps, samples_per_s=tracker.overall(result.steps),
                      loss=result.loss if result.loss is not None and math.isfinite(result.loss) else None,
                      checkpoint=key, train_s=tracker.elapsed(), metric=None if final_metric is None else
                      [name, final_metric], metric_name=name, start_metric=start_metric, final_metric=final_metric)
            return 0
        except BaseException as exc:  # report every failure, including KeyboardInterrupt
            reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
            self.emit("failed", reason=reason, log_tail=self._tail(session))
            return 1

    @staticmethod
    def _tail(session: UserSession | None) -> str:
        return session.trainer.log_tail[-MAX_LOG_TAIL:] if session is not None else ""

    def _progress(self, rate: _Rate, steps: int, loss: float | None) -> None:
        if steps <= rate.window_steps:   # no step since the last report: no rate to tell
            return
        steps_round, steps_total, samples_per_s = rate.update(steps)
        self.emit("progress", steps_round=steps_round, steps_total=steps_total, samples_per_s=samples_per_s,
                  loss=loss if loss is not None and math.isfinite(loss) else None)   # None: not reported

    def _load_start(self, store: StoreClient) -> StartState:
        return load_start(store, self.spec, emit=self.emit, stopped=lambda: self.stop_requested)

    def _checkpoint(self, store: StoreClient, result: RoundResult, round_steps: int, total: int) -> str:
        spec = self.spec
        assert result.tensors is not None
        name, _, final_metric = _metrics(result)
        meta = CheckpointMeta(job=spec.job_id, round=spec.round, copy=spec.copy, steps=round_steps + result.steps,
                              total_steps=total + result.steps, gpu_type=spec.gpu_type, model=spec.model,
                              dataset=spec.dataset, metric_name=name, metric_value=final_metric)
        with tempfile.TemporaryDirectory(prefix="hadar-ckpt-") as tmp:
            path = Path(tmp) / "checkpoint.safetensors"
            save_file({k: v.contiguous() for k, v in result.tensors.items()}, str(path),
                      metadata=meta.to_metadata())
            spec.ledger().record(spec.checkpoint, path)   # before the upload: see worker/ledger.py
            self.emit("uploading", key=spec.checkpoint)
            store.put_file(spec.checkpoint, path)
        return spec.checkpoint


class _Rate:
    """Turns the trainer's cumulative step counts into the copy's progress figures."""

    def __init__(self, round_steps: int, total: int, samples_per_step: int) -> None:
        self.round_steps, self.total, self.samples_per_step = round_steps, total, samples_per_step
        self.started = self.window_start = time.perf_counter()
        self.window_steps = 0

    def update(self, steps: int) -> tuple[int, int, float]:
        now = time.perf_counter()
        rate = (steps - self.window_steps) * self.samples_per_step / max(1e-9, now - self.window_start)
        self.window_steps, self.window_start = steps, now
        return self.round_steps + steps, self.total + steps, max(0.0, rate)

    def overall(self, steps: int) -> float:
        return steps * self.samples_per_step / max(1e-9, time.perf_counter() - self.started)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _metrics(result: RoundResult) -> tuple[str, float | None, float | None]:
    """(name, of the start model, of the final weights) of the first metric the script reported."""
    if not result.metrics:
        return "", None, None
    name = result.metrics[0][0][:32]
    values = {of: value for metric, of, value in result.metrics if metric == result.metrics[0][0]}
    return name, values.get("start"), values.get("final")



def _remove_tree(path: Path) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)

