"""Team queues live, on real Kafka and MinIO: one queue borrows the other's idle GPU; the
owner submits; at the next round boundary the GPU goes back, the preempted job waits with
the reason and later resumes from its checkpoint with no step lost, and ``hadar jobs``
says why at every step.

The embedded system's real services (scheduler under YARN-CS, tracker, profiler, two agents
emulating one T4 each, real training in worker processes) on a private broker: a queue
config on the shared broker's hadar.queues would reach every later scheduler of the session.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from services.agent.protocol import StoreTarget
from services.cli.follow import read_view
from services.cli.jobs import submit
from services.cli.jobview import job_doc, jobs_table, waiting_reason
from services.cli.queues import apply_queues
from services.embedded import EmbeddedConfig, EmbeddedSystem
from shared.bus import KafkaBus
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import Assignment, JobCompleted, JobSpec, ModelConsolidated, QueueConfig, QueueSpec
from shared.wire.topics import MODELS, PLACEMENTS

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.slow]

QUEUES = QueueConfig(queues=(QueueSpec(name="vision", quota={"t4": 1}), QueueSpec(name="audio", quota={"t4": 1})),
                     default_queue="audio")


def spec(job_id: str, queue: str, iterations: int) -> JobSpec:
    return JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=16, workers=1,
                   iterations=iterations, queue=queue)


async def until(predicate, what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.5)


async def test_borrowed_gpus_return_at_the_next_round_and_the_preempted_job_resumes(
        private_bootstrap: str, s3_settings: S3Settings, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = replace(s3_settings, bucket=f"queues-{tag}")
    bus = KafkaBus(private_bootstrap, source="queues-test")
    store = MinioStore(settings)
    await bus.start()
    system = EmbeddedSystem(config=EmbeddedConfig(nodes=(("n1", "t4"), ("n2", "t4")), policy="yarn-cs", round_s=5.0,
                                                  consolidation_wait_s=10.0, copy_finish_timeout_s=10.0,
                                                  scheduler_group=f"sched-{tag}"),
                            bus=bus, store=store, store_target=StoreTarget.remote(settings))
    await system.start()
    try:
        await apply_queues(bus, QUEUES)
        a1, a2, v1 = f"a1-{tag}", f"a2-{tag}", f"v1-{tag}"
        await submit(bus, spec(a1, "audio", 400))
        await submit(bus, spec(a2, "", 400))           # no queue named: the default, audio

        async def running(*jobs: str) -> bool:
            view = await read_view(bus)
            record = view.state.rounds.get(view.state.last_round)
            return record is not None and {a.job_id for a in record.assignments} >= set(jobs)

        await until(lambda: running(a1, a2), "audio running on both GPUs (one borrowed from vision)")
        view = await read_view(bus)
        (audio,) = [s for s in view.state.rounds[view.state.last_round].started.queues if s.name == "audio"]
        assert audio.borrowed == 1 and sum(audio.used.values()) == 2

        await submit(bus, spec(v1, "vision", 60))
        view = await read_view(bus)
        if view.state.jobs[v1].last_round is None:      # between rounds: the reason says what comes next
            assert (waiting_reason(view.state, view.state.jobs[v1]) or "").startswith("waiting for reclaim")

        await until(lambda: running(v1), "vision's job placed at the next round")
        view = await read_view(bus)
        record = view.state.rounds[view.state.last_round]
        placed = {a.job_id for a in record.assignments}
        assert len(placed & {a1, a2}) == 1, "one audio job gives the borrowed GPU back"
        (preempted,) = {a1, a2} - placed
        reason = waiting_reason(view.state, view.state.jobs[preempted]) or ""
        assert reason.startswith("quota: reclaimed: audio gave back 1 GPUs"), reason
        doc = job_doc(view.state, preempted, now=time.time())
        assert doc["queue"]["name"] == "audio" and doc["queue"]["position"] in (1, 2)
        assert "audio" in jobs_table(view.state, include_done=False)

        async def completed(*jobs: str) -> bool:
            view = await read_view(bus)
            return all(view.state.jobs[j].completed_at is not None for j in jobs)

        await until(lambda: completed(v1, a1, a2), "every job completed", timeout_s=600.0)
        log = [d.event for t in (PLACEMENTS, MODELS) async for d in bus.read(t)]
        # The preempted job resumed from the model of its last round before the gap: no step lost.
        mine = sorted((e for e in log if isinstance(e, Assignment) and e.job_id == preempted), key=lambda e: e.round)
        models = {e.round: e for e in log if isinstance(e, ModelConsolidated) and e.job_id == preempted}
        gaps = [(before, after) for before, after in itertools.pairwise(mine) if after.round > before.round + 1]
        assert gaps, "the preempted job ran again after the reclaim"
        for before, after in gaps:
            last = max((r for r in models if r <= before.round), default=None)
            assert last is not None and after.start_from == models[last].key
        steps = [models[r].total_steps for r in sorted(models)]
        assert steps == sorted(steps)                   # never back
        (done,) = [e for e in log if isinstance(e, JobCompleted) and e.job_id == preempted]
        assert done.total_steps == 400                  # samples conserved: exactly what it asked for
    finally:
        await system.stop()
        await bus.stop()
