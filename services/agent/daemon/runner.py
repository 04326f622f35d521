"""One job copy's work on this node for one round: its worker processes and its events.

A :class:`CopyRun` runs one worker per assigned GPU (one DDP rank each) -- the GPU slots'
warm workers when they still hold this job and rank set, process group included
(:mod:`services.agent.slots`), else spares or new processes -- relays rank 0's progress
as :class:`Progress` events, and ends with one :class:`CopyFinished`:

* ``failed`` (from whichever node saw it) if any local worker failed, could not start,
  or exited without reporting -- with the first reason;
* otherwise ``ok``/``preempted`` with the checkpoint key, from the node that hosts rank 0
  (other nodes of a copy spanning nodes stay silent: the copy has one checkpoint).

Stopping: :meth:`CopyRun.preempt` asks each worker to stop the copy (finish the step,
checkpoint, report; on the control channel, so a warm worker stays warm, else SIGTERM)
and sends SIGKILL ``stop_timeout_s`` later to any worker that has not reported by then --
except one that reported ``uploading``: its training is over and its checkpoint is on its
way to a store that may be retrying through an outage (90 s), so it is killed only
``upload_grace_s`` after it began uploading, and a round's work is not thrown away because
MinIO was away at the round's end.
The run ends when every worker reported (a warm one does not exit); a worker that ended
any other way is a crash: the copy fails with the reason, the slot is emptied, logged
(``slot.crashed``) and counted, and its next assignment spawns a fresh process; a DDP
copy's other ranks here are torn down with it (``slot.torn_down``): a group that lost a
member is never kept. A rank that fails makes the run preempt the others, and a rank
blocked in a collective with a lost peer is killed ``stop_timeout_s`` later, so no
collective hangs past that. A watchdog preempts workers still running
``deadline_grace_s`` after the round deadline (a hung peer, a stuck store). A copy
preempted before its workers started (while it waited for its GPUs) starts
none and ends ``failed``: it trained nothing and has no checkpoint.

:meth:`CopyRun.run` never raises (but for cancellation): every failure becomes the result.
It returns the CopyFinished rather than publishing it, so the daemon decides how to deliver
it (:mod:`services.agent.daemon.result_expiry`) and when to ack the Assignment.
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import structlog

from services.agent.daemon.discovery import NodeDevices
from services.agent.daemon.failure_log import failed_copy_log_tail
from services.agent.daemon.metrics import AgentMetrics
from services.agent.daemon.process import WorkerPool, WorkerProcess, WorkerSlots
from services.agent.protocol import CodeTarget, StoreTarget, WorkerSpec
from services.agent.slots import warm_key
from shared.clock import Clock
from shared.domain.layout import checkpoint_key
from shared.domain.local_sgd import LocalSgd
from shared.wire.events import MAX_LOG_TAIL, Assignment, CopyFinished, Event, Progress

__all__ = ["RunContext", "CopyRun", "CopyKey", "free_port", "local_sgd_recipe"]

CopyKey = tuple[str, int, int]   # (job, round, copy)
_CopyStatus = Literal["ok", "preempted", "failed"]   # CopyFinished.status


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """What every copy run on this node shares."""

    node_id: str
    devices: NodeDevices
    store: StoreTarget
    pool: WorkerPool
    clock: Clock
    publish: Callable[[Event], Awaitable[None]]
    metrics: AgentMetrics
    progress_s: float
    threads: int
    stop_timeout_s: float
    deadline_grace_s: float
    upload_grace_s: float = 120.0
    slots: WorkerSlots = None   # type: ignore[assignment]   # None: one over ``pool``
    cache_dir: str = ""            # users' code and data bundles ("": the worker's default per node)
    cache_bytes: int = 20 << 30
    trainer_sandbox: bool = True   # False: user code runs without Landlock (the operator's insecure opt-out)
    ledger_dir: str = ""           # what this node wrote at its checkpoint keys ("": the worker's default per node)

    def __post_init__(self) -> None:
        if self.slots is None:
            object.__setattr__(self, "slots", WorkerSlots(self.pool))

    @property
    def source(self) -> str:
        return f"agent/{self.node_id}"


def local_sgd_recipe(a: Assignment) -> LocalSgd:
    """The local-SGD recipe every worker of copy ``a`` trains with (``shared/domain/local_sgd.py``):
    K = the workers of all the job's copies this round, as the scheduler stated it
    (``Assignment.fork_workers``; 0, unstated, trains as one whole copy), W and the job's
    total steps from its spec. Every copy of the job gets the same recipe."""
    return LocalSgd(fork_workers=a.fork_workers, job_workers=a.job.workers, job_steps=a.job.iterations)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class CopyRun:
    def __init__(self, ctx: RunContext, assignment: Assignment) -> None:
        self.ctx = ctx
        self.a = assignment
        self.key: CopyKey = (assignment.job_id, assignment.round, assignment.copy)
        self.workers: list[WorkerProcess] = []
        self.reported: set[int] = set()    # pids of workers that sent their final message
        self.startup: dict[str, Any] = {}   # rank 0's "started" report: warm, setup_s, ready_at
        self.start_s: float | None = None   # agent clock: GPUs taken -> rank 0 ready (CopyFinished.start_s)
        self._began = 0.0
        self.stop_reason = ""
        self.steps_round = 0
        self.first_failure = ""
        self.first_failed_rank: int | None = None
        self._started = 0
        self.log = structlog.get_logger().bind(node=ctx.node_id, job=assignment.job_id,
                                               round=assignment.round, copy=assignment.copy)
        self._kill_timer: asyncio.TimerHandle | None = None
        self._stopping = False
        self._slots: list[int] = []          # the GPU slot of each of ``workers``
        self._failed: set[int] = set()       # pids that reported ``failed``
        self._uploading: dict[int, float] = {}   # pid -> clock time its checkpoint upload may last until

    @property
    def reports(self) -> bool:
        """Whether this node hosts rank 0 (and so reports the copy's progress and result)."""
        return 0 in self.a.ranks

    def preempt(self, reason: str) -> None:
        """SIGTERM every worker now, SIGKILL those still alive after ``stop_timeout_s``."""
        if self._stopping:
            return
        self._stopping = True
        self.stop_reason = reason
        self.log.info("copy.preempt", reason=reason)
        for worker in self.workers:
            self._stop(worker)
        loop = asyncio.get_running_loop()
        self._kill_timer = loop.call_later(self.ctx.stop_timeout_s, self._kill_all)

    def _stop(self, worker: WorkerProcess) -> None:
        if worker.pid not in self.reported and not worker.stop(self.key):
            worker.terminate()

    def _kill_all(self) -> None:
        now, waits = self.ctx.clock.time(), []
        for worker in self.workers:
            if worker.alive and worker.pid not in self.reported:
                until = self._uploading.get(worker.pid)
                if until is not None and now < until:   # its training is over: its upload is the work
                    waits.append(until - now)
                    continue
                self.log.warning("copy.kill", pid=worker.pid, after_s=self.ctx.stop_timeout_s,
                                 uploading=until is not None)
                worker.kill()
        if waits:
            self.log.info("copy.kill_deferred", reason="checkpoint upload in flight", for_s=round(min(waits), 1))
            self._kill_timer = asyncio.get_running_loop().call_later(min(waits), self._kill_all)

    def _specs(self) -> list[WorkerSpec]:
        a, devices = self.a, self.ctx.devices
        by_index = devices.by_index()
        unknown = [g for g in a.gpus if g not in by_index]
        if unknown:
            raise ValueError(f"assignment names GPU indices {unknown} this node does not have "
                             f"(it has {sorted(by_index)})")
        rendezvous = a.rendezvous
        if rendezvous is None and a.world_size > 1:
            rendezvous = f"127.0.0.1:{free_port()}"   # only a fresh group uses it (a kept one never meets again)
        peers = a.peers or ((self.ctx.node_id,) * a.world_size if a.world_size == len(a.ranks) else ())
        recipe = local_sgd_recipe(a)
        code = None if a.job.code is None else CodeTarget(
            user=a.job.user, digest=a.job.code.digest, size=a.job.code.size, entrypoint=a.job.code.entrypoint,
            args=a.job.code.args, config=a.job.code.config, data_digest=a.job.code.data_digest,
            data_size=a.job.code.data_size, cache_dir=self.ctx.cache_dir, cache_bytes=self.ctx.cache_bytes,
            sandbox=self.ctx.trainer_sandbox)
        specs = []
        for gpu, rank in zip(a.gpus, a.ranks, strict=True):
            env = {"CUDA_VISIBLE_DEVICES": devices.visible.get(gpu, "")}
            specs.append(WorkerSpec(
                job_id=a.job_id, round=a.round, copy=a.copy, node_id=self.ctx.node_id,
                gpu_type=by_index[gpu].type, model=a.job.model, dataset=a.job.dataset,
                batch_size=a.job.batch_size, optimizer=a.job.hyper.optimizer, lr=a.job.hyper.lr,
                seed=a.job.hyper.seed, rank=rank, world_size=a.world_size, rendezvous=rendezvous,
                device=devices.worker_device, step_budget=a.step_budget, deadline=a.deadline,
                start_from=a.start_from, checkpoint=checkpoint_key(a.job_id, a.round, a.copy, node=self.ctx.node_id),
                store=self.ctx.store, slowdown=devices.slowdown.get(gpu, 1.0), emulated=devices.emulated,
                progress_s=self.ctx.progress_s, threads=self.ctx.threads, env=env,
                local_gpus=a.gpus, local_ranks=a.ranks, peers=peers, local_sgd=recipe, code=code,
                ledger_dir=self.ctx.ledger_dir, evaluation=a.evaluation))
        return specs

    async def run(self) -> CopyFinished | None:
        """Run the workers to their end; the copy's result, or None where another node reports it."""
        finals: list[dict[str, Any] | None] = []
        failure = ""
        watchdog: asyncio.Task[None] | None = None
        try:
            if self._stopping:
                raise RuntimeError(f"preempted before its workers started ({self.stop_reason})")
            specs = self._specs()
            self._began = self.ctx.clock.time()
            decisions = []
            for gpu, (worker, decision) in zip(self.a.gpus, await self.ctx.slots.take(list(self.a.gpus), specs)):
                self.workers.append(worker)
                self._slots.append(gpu)
                decisions.append(decision.action)
                self.ctx.metrics.slot(decision.action)
                if decision.action != "spawn" or decision.slot.generation > 1:
                    self.log.info(f"slot.{decision.action}", gpu=gpu, reason=decision.reason, pid=worker.pid,
                                  generation=decision.slot.generation, specs=decision.slot.specs)
            for worker, spec in zip(self.workers, specs, strict=True):
                await worker.send(spec, keep_open=warm_key(spec) is not None)
                if self._stopping:
                    self._stop(worker)
            self.log.info("copy.started", pids=[w.pid for w in self.workers], world_size=self.a.world_size,
                          ranks=list(self.a.ranks), slots=decisions)
            watchdog = asyncio.create_task(self._watchdog())
            finals = list(await asyncio.gather(*(self._follow(w, s) for w, s in zip(self.workers, specs))))
        except asyncio.CancelledError:
            for worker in self.workers:
                worker.kill()
            raise
        except Exception as exc:  # could not start (bad assignment, spawn failure) or lost a worker pipe
            failure = f"{type(exc).__name__}: {exc}"[:500]
            for worker in self.workers:
                worker.kill()
            for worker in self.workers:
                await worker.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            self._release()
        self.ctx.metrics.copy_rate(self.key, None)
        self.ctx.pool.refill()
        return self._finish(finals, failure)

    def _release(self) -> None:
        """Hand every slot back; a worker that did not finish cleanly is a crash (module doc),
        and the copy's other ranks here are torn down with it."""
        clean = [w.pid in self.reported and w.pid not in self._failed for w in self.workers]
        crashed = self.ctx.slots.release(self._slots, reported=clean)
        for gpu, worker, crash in zip(self._slots, self.workers, crashed, strict=True):
            if crash:
                self.ctx.metrics.slot_crash()
                self.log.warning("slot.crashed", gpu=gpu, pid=worker.pid, exit_code=worker.proc.returncode,
                                 note="the slot's next assignment starts a fresh worker")
        self._slots = []

    async def _watchdog(self) -> None:
        late = self.a.deadline + self.ctx.deadline_grace_s - self.ctx.clock.time()
        await asyncio.sleep(max(0.0, late))
        self.preempt(f"still running {self.ctx.deadline_grace_s:.0f} s after the round deadline")

    async def _follow(self, worker: WorkerProcess, spec: WorkerSpec) -> dict[str, Any] | None:
        """Relay one worker's messages; return its final message with its exit code."""
        final: dict[str, Any] | None = None
        warm = warm_key(spec) is not None
        async for message in worker.messages():
            kind = message["event"]
            if kind == "started":
                self._started += 1
                if spec.rank == 0:
                    self.startup = message
                    self.start_s = max(0.0, self.ctx.clock.time() - self._began)
                    if isinstance(message.get("ready_at"), (int, float)):
                        self.ctx.metrics.copy_start(float(message["ready_at"]) - self.a.ts,
                                                    warm=bool(message.get("warm")))
                self.log.info("worker.started", rank=spec.rank, pid=message.get("pid"), warm=message.get("warm"),
                              setup_s=message.get("setup_s"), spare_wait_s=message.get("spec_wait_s"),
                              weights=message.get("weights"),
                              steps_total=message.get("steps_total"))
                if self._started == len(self.a.gpus):
                    self.ctx.pool.refill()
            elif kind == "progress" and spec.rank == 0:
                await self._progress(message)
            elif kind == "uploading":
                self._uploading[worker.pid] = self.ctx.clock.time() + self.ctx.upload_grace_s
                self.log.info("copy.uploading", rank=spec.rank, key=message.get("key"))
            elif kind == "not_ours":
                self.ctx.metrics.not_ours()
                self.log.warning("checkpoint.not_ours", rank=spec.rank, key=message.get("key"),
                                 note="an object this node did not write sat at the copy's own key: ignored, "
                                      "the round starts over")
            elif kind in ("finished", "failed"):
                final = message
                self.reported.add(worker.pid)
                if kind == "failed":
                    self._failed.add(worker.pid)
                if warm and kind == "finished":
                    break   # a warm worker stays, waiting for its slot's next spec
        code = 0 if final is not None and warm and final["event"] == "finished" else await worker.wait()
        if final is None:
            how = f"signal {-code}" if code < 0 else f"code {code}"
            final = {"event": "failed", "reason": f"worker rank {spec.rank} exited with {how} without reporting"
                     + (f" (stopping: {self.stop_reason})" if self.stop_reason else "")}
        if final["event"] == "failed" and not self.first_failure:
            self.first_failure = str(final["reason"])
            self.first_failed_rank = spec.rank
            if not self._stopping and any(w.alive for w in self.workers):
                self.preempt(f"rank {spec.rank} failed")  # its peers cannot finish without it
        return {**final, "rank": spec.rank, "exit_code": code}

    async def _progress(self, m: dict[str, Any]) -> None:
        a = self.a
        try:
            steps_round, steps_total = int(m["steps_round"]), int(m["steps_total"])
            samples_per_s = float(m["samples_per_s"])
            loss = None if m.get("loss") is None else float(m["loss"])   # a user's script may report none
            event = Progress(ts=self.ctx.clock.time(), source=self.ctx.source, job_id=a.job_id, round=a.round,
                             copy=a.copy, node_id=self.ctx.node_id, gpu_type=a.gpu_type, workers=a.world_size,
                             steps_round=steps_round, steps_total=steps_total, samples_per_s=samples_per_s,
                             loss=loss, emulated=self.ctx.devices.emulated,
                             emulation_reference=self.ctx.devices.reference)
        except (KeyError, TypeError, ValueError) as exc:   # ValueError includes InvalidEvent
            self.log.warning("progress.bad_report", error=f"{type(exc).__name__}: {exc}"[:300])
            return
        self.ctx.metrics.steps(max(0, steps_round - self.steps_round))
        self.steps_round = steps_round
        self.ctx.metrics.copy_rate(self.key, samples_per_s / (a.job.batch_size * a.world_size))
        try:
            await self.ctx.publish(event)
        except Exception as exc:  # progress is best effort; the result is not
            self.log.warning("progress.publish_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def _finish(self, finals: list[dict[str, Any] | None], failure: str) -> CopyFinished | None:
        failed = [f for f in finals if f is not None and f["event"] == "failed"]
        if failure or failed:
            reason = failure or self.first_failure or str(failed[0]["reason"])
            tail = failed_copy_log_tail(failed, first_failed_rank=self.first_failed_rank, limit=MAX_LOG_TAIL)
            self.ctx.metrics.failure()
            return self._result("failed", self.steps_round, None, reason, log_tail=tail)
        mine = next((f for f in finals if f is not None and f["rank"] == 0), None)
        if not self.reports or mine is None:   # rank 0 lives on another node, which reports the copy
            self.log.info("copy.finished_here", ranks=list(self.a.ranks))
            return None
        steps = int(mine["steps_round"])
        self.ctx.metrics.steps(max(0, steps - self.steps_round))
        self.steps_round = steps
        self.log.info("copy.finished", status=mine["status"], steps_round=steps,
                      steps_total=mine["steps_total"], samples_per_s=round(mine["samples_per_s"], 1),
                      metric=mine.get("metric"))
        return self._result(str(mine["status"]), steps, mine["checkpoint"],
                            self.stop_reason if mine["status"] == "preempted" else "", metrics=_user_metrics(mine))

    def _result(self, status: str, steps: int, checkpoint: str | None, reason: str, *,
                metrics: dict[str, Any] | None = None, log_tail: str = "") -> CopyFinished:
        a = self.a
        if status == "failed":
            self.log.error("copy.failed", reason=reason, log_tail=log_tail[-500:] or None)
        event = CopyFinished(ts=self.ctx.clock.time(), source=self.ctx.source, job_id=a.job_id, round=a.round,
                             copy=a.copy, node_id=self.ctx.node_id, steps_round=steps,
                             status=cast(_CopyStatus, status),   # as the worker reported it: checked here
                             gpu_type=a.gpu_type, checkpoint=checkpoint, reason=reason[:500],
                             emulated=self.ctx.devices.emulated, log_tail=log_tail[-MAX_LOG_TAIL:],
                             evaluation=a.evaluation, start_s=self.start_s,
                             start_warm=bool(self.startup.get("warm")), **(metrics or {}))
        self.ctx.metrics.finished(status)
        return event


def _user_metrics(final: dict[str, Any]) -> dict[str, Any]:
    """The held-out metric a user script reported, as CopyFinished carries it; nothing that
    is not a name of at most 32 characters with finite numbers."""
    name = final.get("metric_name")
    if not isinstance(name, str) or not name or len(name) > 32:
        return {}
    out: dict[str, Any] = {"metric_name": name}
    for field in ("start_metric", "final_metric"):
        value = final.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[field] = float(value)
    return out
