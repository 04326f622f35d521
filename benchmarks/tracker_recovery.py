"""Tracker restart time with a long history, from a state snapshot and from the whole log.

One MemoryBus holds what the tracker's topics hold after ``--rounds`` rounds of
``--jobs`` concurrent one-copy jobs (each round: RoundStarted, an Assignment, a Progress
and a CopyFinished per job, the tracker's ModelConsolidated per job, and a JobCompleted
plus a new JobSubmitted when a job reaches its iterations): every record is one a tracker
accepts (``refused`` counts any it did not). A tracker with snapshots (LocalStore,
``snapshot_every`` 1) is started on that log, consolidates one live round for real -- with
a report of another job *held* (its Assignment never published), so the snapshot must
leave it uncovered -- writes its snapshot and stops; ``--tail`` more rounds follow.
Then, side by side on the same log: a tracker restarted from the snapshot
(``restart_s``) and one without snapshots replaying the whole log
(``restart_without_snapshot_s``). ``identical``: both arrive at the same state (each job's
consolidated and live steps, completion, open rounds, due rounds, sizes -- the held report
included).

    .venv/bin/python benchmarks/tracker_recovery.py                   # 10,000 rounds
    .venv/bin/python benchmarks/tracker_recovery.py --rounds 2000

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import structlog
from safetensors.numpy import save

from services.tracker.config import TrackerConfig
from services.tracker.service import TrackerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.store import LocalStore
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    Progress,
    RoundStarted,
)

T0 = 1_700_000_000.0
ROUND_S = 60.0
STEPS = 100
NODE = "n1"   # the one node every copy runs on, reports from and writes its checkpoint


class History:
    """Writes a tracker's topics round by round; every job runs ``job_rounds`` rounds."""

    def __init__(self, bus: MemoryBus, *, jobs: int, job_rounds: int) -> None:
        self.bus, self.job_rounds = bus, job_rounds
        self.slots: list[tuple[JobSpec, int]] = []     # (job, rounds done)
        self.next_job = 0
        self.records = 0
        self._submit: list[JobSpec] = []              # new jobs, submitted before the next round
        for _ in range(jobs):
            self.slots.append((self._new(0), 0))

    async def publish(self, event: object) -> None:
        await self.bus.publish(event)  # type: ignore[arg-type]
        self.records += 1

    def _new(self, round_: int) -> JobSpec:
        job = JobSpec(job_id=f"job-{self.next_job}", user="bench", model="resnet", dataset="digits",
                      batch_size=32, workers=1, iterations=STEPS * self.job_rounds)
        self.next_job += 1
        self._submit.append(job)
        return job

    def assignment(self, job: JobSpec, round_: int, copy: int = 0) -> Assignment:
        at = T0 + ROUND_S * round_
        return Assignment(ts=at, source="scheduler", round=round_, job=job, copy=copy, node_id=NODE, gpus=(0,),
                          gpu_type="V100", world_size=1, ranks=(0,), step_budget=1_000, deadline=at + ROUND_S)

    def finished(self, job_id: str, round_: int, copy: int = 0) -> CopyFinished:
        return CopyFinished(ts=T0 + ROUND_S * round_ + 50, source="agent/n1", job_id=job_id, round=round_,
                            copy=copy, node_id=NODE, status="ok", steps_round=STEPS,
                            checkpoint=checkpoint_key(job_id, round_, copy, node=NODE))

    async def round(self, r: int) -> None:
        at = T0 + ROUND_S * r
        for job in self._submit:
            await self.publish(JobSubmitted(ts=at, source="cli", job=job, submitted_at=at))
        self._submit = []
        await self.publish(RoundStarted(ts=at, source="scheduler", round=r, policy="hadare", started_at=at,
                                     ends_at=at + ROUND_S, assignments=len(self.slots)))
        for job, _ in self.slots:
            await self.publish(self.assignment(job, r))
        for job, done in self.slots:
            await self.publish(Progress(ts=at + 30, source="agent/n1", job_id=job.job_id, round=r, copy=0,
                                     node_id=NODE, gpu_type="V100", workers=1, steps_round=STEPS // 2,
                                     steps_total=STEPS * done + STEPS // 2, samples_per_s=10.0, loss=1.0))
            await self.publish(self.finished(job.job_id, r))
        for i, (job, done) in enumerate(self.slots):
            total = STEPS * (done + 1)
            await self.publish(ModelConsolidated(ts=at + 55, source="tracker", job_id=job.job_id, round=r,
                                              key=model_key(job.job_id, r), total_steps=total,
                                              copies=(CopyWeight(copy=0, steps=STEPS, weight=1.0),)))
            if done + 1 == self.job_rounds:
                await self.publish(JobCompleted(ts=at + 58, source="tracker", job_id=job.job_id,
                                             final_key=final_key(job.job_id), total_steps=total,
                                             jct_s=58.0, completed_at=at + 58))
                self.slots[i] = (self._new(r + 1), 0)
            else:
                self.slots[i] = (job, done + 1)


def view(service: TrackerService, job_ids: list[str]) -> tuple[object, ...]:
    state = service.state
    sizes = {k: v for k, v in state.sizes().items() if k not in ("remembered_ids", "refusals")}
    per_job = [(j, state.consolidated_steps(j), state.live_steps(j), state.is_completed(j)) for j in job_ids]
    return per_job, state.due_rounds(T0 + 1e9, 0.0), state.due_completions(), sizes


def tracker(bus: MemoryBus, store: LocalStore, *, group: str, every: int) -> TrackerService:
    config = TrackerConfig(group=group, tick_s=0.02, finish_timeout_s=1e9, snapshot_every=every,
                           delete_checkpoints=False)
    return TrackerService(bus=bus, store=store, config=config, clock=FakeClock(T0))


async def timed_start(service: TrackerService) -> float:
    t0 = time.perf_counter()
    await service.start()
    return time.perf_counter() - t0


async def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp))
        await store.start()
        bus = MemoryBus(clock=FakeClock(T0))
        await bus.start()
        history = History(bus, jobs=args.jobs, job_rounds=args.job_rounds)
        t0 = time.perf_counter()
        for r in range(args.rounds):
            await history.round(r)
        build_s = time.perf_counter() - t0

        # One live round, consolidated for real, while another job's report is held.
        live = tracker(bus, store, group="bench-tracker", every=1)
        first_start_s = await timed_start(live)
        r = args.rounds
        (a, _), (b, _) = history.slots[0], history.slots[1]
        rng = np.random.default_rng(0)
        weights = save({"w": rng.standard_normal(64).astype(np.float32)})
        await store.put(checkpoint_key(a.job_id, r, 0, node=NODE), weights)
        for number, assignments in ((r, 1), (r + 1, 1)):
            at = T0 + ROUND_S * number
            await history.publish(RoundStarted(ts=at, source="scheduler", round=number, policy="hadare", started_at=at,
                                            ends_at=at + ROUND_S, assignments=assignments))
        await history.publish(history.assignment(a, r))
        await history.publish(history.finished(b.job_id, r + 1))   # held: round r + 1's Assignment is unread
        await history.publish(history.finished(a.job_id, r))       # decides round r: the snapshot
        while not live.registry.get_sample_value("hadar_tracker_snapshots_total", {"outcome": "written"}):
            await asyncio.sleep(0.01)
        held = live.state.sizes()["pending"]
        await live.stop()
        # b's Assignment stays unpublished: its report must still be held after either restart,
        # and nothing is due while both are compared (no tracker publishes meanwhile).
        history.slots = history.slots[2:]   # a and b leave the script; the others go on
        for t in range(r + 2, r + 2 + args.tail):
            await history.round(t)

        restarted = tracker(bus, store, group="bench-tracker", every=1)
        restart_s = await timed_start(restarted)
        whole = tracker(bus, store, group="bench-whole", every=0)
        whole_s = await timed_start(whole)
        job_ids = [f"job-{i}" for i in range(history.next_job)]
        same = view(restarted, job_ids) == view(whole, job_ids)
        refused = sum(s.value for m in whole.registry.collect() if m.name == "hadar_tracker_events_rejected"
                      for s in m.samples if s.name.endswith("_total"))
        snapshots = await store.list("snapshots/")
        result = {
            "rounds": args.rounds, "jobs": args.jobs, "tail_rounds": args.tail,
            "input_records_total": history.records, "held_at_snapshot": held,
            "held_after_restart": [restarted.state.sizes()["pending"], whole.state.sizes()["pending"]],
            "restart_s": round(restart_s, 3), "restart_without_snapshot_s": round(whole_s, 3),
            "first_start_s": round(first_start_s, 3), "speedup": round(whole_s / max(restart_s, 1e-9), 1),
            "records_replayed": restarted.recovery.get("records"),
            "records_replayed_without_snapshot": whole.recovery.get("records"),
            "snapshot": restarted.recovery.get("snapshot"), "snapshots_kept": len(snapshots),
            "snapshot_bytes": max([len(await store.get(k)) for k in snapshots], default=0),
            "identical": same, "refused": refused, "history_build_s": round(build_s, 1),
        }
        for service in (restarted, whole):
            await service.stop()
        await bus.stop()
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=8, help="jobs running at once")
    parser.add_argument("--job-rounds", type=int, default=50, help="rounds each job runs")
    parser.add_argument("--tail", type=int, default=10,
                        help="rounds recorded after the snapshot (under 16, ROUND_HISTORY, the held report stays held)")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    result = asyncio.run(run(args))
    print(f"tracker restart after {result['rounds']} rounds: {result['restart_s']} s from a snapshot, "
          f"{result['restart_without_snapshot_s']} s from the whole log; identical: {result['identical']}",
          file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["identical"] and not result["refused"] else 1


if __name__ == "__main__":
    sys.exit(main())
