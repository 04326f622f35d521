"""SIGTERM during consolidation never announces half a model (issue #13, item 4).

The tracker runs as its own process (``hadar serve tracker``) on the session's real Kafka
broker and MinIO. A round of three replicas large enough that averaging them takes a
while (read from MinIO in small ranged reads: ``HADAR_TRACKER_CHUNK_BYTES``) is fed to it,
and SIGTERM is sent once the round's model is being written in the tracker's staging
directory (a ``model.safetensors`` there past :data:`MIDWAY_BYTES`: this round's, the
only large one). Then:

* with a drain long enough to finish, the process exits 0 and the model is complete (the
  samples-weighted average of the replicas) and announced exactly once;
* restarted with a drain shorter than the averaging, the process still exits 0 soon after
  its drain timeout, having stopped the averaging; nothing of the round is announced, no
  object is visible under the job's models and the staging directory is empty;
* the next tracker recognises the finished round (no second announcement, the same bytes)
  and consolidates the abandoned one: each job has one model and one completion, its
  steps counted once;
* a model stored but not announced (the state a stop between the upload and the
  publish leaves) is announced exactly once by the next tracker, byte for byte as stored.

The tracker's replay reads the whole shared broker: ``--finish-timeout-s`` is huge so that
no other test's open round comes due in it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load, save

from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import Bus, KafkaBus, MemoryBus
from shared.domain.layout import checkpoint_key, model_key, model_prefix
from shared.store import MinioStore, ObjectStore
from shared.store.settings import S3Settings
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    RoundAbandoned,
    RoundStarted,
)
from shared.wire.topics import JOBS, MODELS, PLACEMENTS, PROGRESS
from tests.integration.test_tracker_service import _remove_bucket

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HADAR = [sys.executable, "-m", "services.cli.main"]
STEPS = (120, 60, 20)              # the three copies' steps: the job's iterations are their sum
ELEMENTS = 512 << 10               # float32 elements per replica (2 MiB)
CHUNK_BYTES = 16 << 10             # each ranged read from MinIO: 128 reads per replica, 1-2 s on an idle machine
MIDWAY_BYTES = 64 << 10            # the staged model is this far written: averaging is under way
START_S = 120.0                    # a tracker process's start (torch import, replay) on a loaded machine


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, user="alice", model="resnet-8", dataset="digits", batch_size=32,
                   workers=1, iterations=sum(STEPS))


def replica(copy: int, elements: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(copy)
    return {"w": rng.standard_normal(elements).astype(np.float32),
            "b": rng.standard_normal(64).astype(np.float32)}


def expected_average(replicas: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    total = sum(STEPS)
    return {name: sum(s * r[name].astype(np.float64) for s, r in zip(STEPS, replicas)) / total
            for name in replicas[0]}


@dataclass
class Round:
    """One job's one round, fed to the bus and the store as the scheduler and agents would."""

    job_id: str
    round: int
    replicas: list[dict[str, np.ndarray]]


async def feed(bus: Bus, store: ObjectStore, elements: int = ELEMENTS) -> Round:
    """Submit a job, place one round of three copies, upload their checkpoints, report them."""
    r = 1 + max([d.event.round async for d in bus.read(PLACEMENTS) if isinstance(d.event, RoundStarted)],
                default=-1)
    job = spec(f"job-{uuid.uuid4().hex[:8]}")
    now = time.time()
    await bus.publish(JobSubmitted(ts=now, source="cli", job=job, submitted_at=now))
    await bus.publish(RoundStarted(ts=now, source="scheduler", round=r, policy="hadare", started_at=now,
                                ends_at=now + 3600, assignments=len(STEPS)))
    replicas = []
    for copy in range(len(STEPS)):
        await bus.publish(Assignment(ts=now, source="scheduler", round=r, job=job, copy=copy, node_id=f"n{copy}",
                                  gpus=(0,), gpu_type="V100", world_size=1, ranks=(0,), step_budget=1_000,
                                  deadline=now + 3600))
    for copy, steps in enumerate(STEPS):
        weights = replica(copy, elements)
        key = checkpoint_key(job.job_id, r, copy, node=f"n{copy}")
        await store.put(key, save(weights))
        replicas.append(weights)
        await bus.publish(CopyFinished(ts=time.time(), source=f"agent/n{copy}", job_id=job.job_id, round=r, copy=copy,
                                    node_id=f"n{copy}", status="ok", steps_round=steps, checkpoint=key))
    return Round(job_id=job.job_id, round=r, replicas=replicas)


class TrackerProcess:
    """``hadar serve tracker`` in its own process group, its output in ``log``."""

    def __init__(self, env: dict[str, str], group: str, staging: Path, log: Path, *, drain_s: float) -> None:
        self.log = log
        argv = [*HADAR, "serve", "tracker", "--http-port", "0", "--group", group, "--temp-dir", str(staging),
                "--finish-timeout-s", "1e9", "--tick-s", "0.1", "--snapshot-every", "0",
                "--keep-round-models-after-completion",
                "--drain-timeout-s", str(drain_s)]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def terminate(self) -> float:
        """SIGTERM; the seconds until the process exited."""
        t0 = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=300)
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


async def models_events(bus: Bus, job_id: str) -> list[Event]:
    return [d.event async for d in bus.read(MODELS) if getattr(d.event, "job_id", None) == job_id]


async def until(what: str, probe, timeout_s: float, proc: TrackerProcess | None = None, *, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        found = await probe()
        if found:
            return found
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"tracker exited {proc.proc.returncode} waiting for {what}:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f":\n{proc.tail()}" if proc else ""))
        await asyncio.sleep(poll_s)


def staged_model_bytes(staging: Path) -> int:
    sizes = []
    for path in staging.glob("*/model.safetensors"):
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:
            pass
    return max(sizes, default=0)


async def assert_model_is_the_average(store: ObjectStore, fed: Round, event: ModelConsolidated) -> None:
    assert event.key == model_key(fed.job_id, fed.round)
    assert [(c.copy, c.steps) for c in event.copies] == list(enumerate(STEPS))
    assert event.total_steps == sum(STEPS)
    stored = load(await store.get(event.key))
    expected = expected_average(fed.replicas)
    assert sorted(stored) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(stored[name], value, rtol=1e-5, atol=1e-6)


async def completed_once(bus: Bus, fed: Round, proc: TrackerProcess) -> list[Event]:
    """Wait for the job's JobCompleted; then exactly one model and one completion, steps counted once."""
    async def done() -> list[Event] | None:
        events = await models_events(bus, fed.job_id)
        return events if any(isinstance(e, JobCompleted) for e in events) else None

    events = await until("JobCompleted", done, START_S, proc)
    models = [e for e in events if isinstance(e, ModelConsolidated)]
    completions = [e for e in events if isinstance(e, JobCompleted)]
    assert [m.round for m in models] == [fed.round], events
    assert not [e for e in events if isinstance(e, RoundAbandoned)], events
    assert [c.total_steps for c in completions] == [sum(STEPS)], events
    return events


@asynccontextmanager
async def kafka_minio(kafka_bootstrap: str,
                      s3_settings: S3Settings) -> AsyncIterator[tuple[KafkaBus, MinioStore, dict[str, str]]]:
    """A client bus and a store in a fresh bucket (removed after), and a tracker's environment."""
    settings = replace(s3_settings, bucket=f"test-{uuid.uuid4().hex}")
    bus = KafkaBus(kafka_bootstrap, source="tracker-sigterm-test")
    store = MinioStore(settings)
    await bus.start()
    await store.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HADAR_BOOTSTRAP": kafka_bootstrap,
           "HADAR_S3_ENDPOINT": settings.endpoint, "HADAR_S3_ACCESS_KEY": settings.access_key,
           "HADAR_S3_SECRET_KEY": settings.secret_key, "HADAR_S3_BUCKET": settings.bucket,
           "HADAR_TRACKER_CHUNK_BYTES": str(CHUNK_BYTES)}
    try:
        yield bus, store, env
    finally:
        await store.stop()
        await bus.stop()
        await asyncio.to_thread(_remove_bucket, settings)


async def sigterm_midway(tracker: TrackerProcess, bus: KafkaBus, store: MinioStore,
                         staging: Path) -> tuple[Round, float]:
    """Feed ``tracker`` a round and SIGTERM it while the round's model is being written;
    the round and the seconds the process took to exit (it must exit 0)."""
    try:
        fed = await feed(bus, store)

        async def midway() -> bool:
            return staged_model_bytes(staging) >= MIDWAY_BYTES

        await until("the round's model to be partly written", midway, START_S, tracker, poll_s=0.01)
        seconds = tracker.terminate()
    finally:
        tracker.kill()
    assert tracker.proc.returncode == 0, tracker.tail()
    return fed, seconds


async def test_sigterm_while_averaging_finishes_or_abandons_the_round_and_restarts_count_it_once(
        kafka_bootstrap: str, s3_settings: S3Settings, tmp_path: Path) -> None:
    async with kafka_minio(kafka_bootstrap, s3_settings) as (bus, store, env):
        staging = tmp_path / "staging"
        staging.mkdir()
        group = f"tracker-{uuid.uuid4().hex[:8]}"

        # A drain long enough: the round in progress is finished, stored whole and announced once.
        first = TrackerProcess(env, group, staging, tmp_path / "tracker-1.log", drain_s=60.0)
        x, _ = await sigterm_midway(first, bus, store, staging)
        models = [e for e in await models_events(bus, x.job_id) if isinstance(e, ModelConsolidated)]
        assert [m.round for m in models] == [x.round], first.tail()
        await assert_model_is_the_average(store, x, models[0])
        x_model = await store.get(models[0].key)

        # A drain shorter than the averaging: the round is abandoned -- nothing announced, nothing
        # stored under the job's models -- and the process still exits 0 soon after its drain timeout.
        drain_s = 0.2
        second = TrackerProcess(env, group, staging, tmp_path / "tracker-2.log", drain_s=drain_s)
        y, seconds = await sigterm_midway(second, bus, store, staging)
        events = await models_events(bus, y.job_id)
        assert not [e for e in events if isinstance(e, (ModelConsolidated, RoundAbandoned))], events
        assert await store.list(model_prefix(y.job_id)) == []
        assert seconds < drain_s + 15.0, f"the tracker took {seconds:.1f} s to exit after SIGTERM"
        assert "round.consolidation_stopped" in second.tail()
        assert list(staging.iterdir()) == []

        # The next tracker recognises the finished round and consolidates the abandoned one: each
        # job has one model and one completion, its steps counted once.
        third = TrackerProcess(env, group, staging, tmp_path / "tracker-3.log", drain_s=30.0)
        try:
            await completed_once(bus, x, third)
            events = await completed_once(bus, y, third)
            (model,) = [e for e in events if isinstance(e, ModelConsolidated)]
            await assert_model_is_the_average(store, y, model)
            assert await store.get(model_key(x.job_id, x.round)) == x_model
        finally:
            third.kill()


async def test_a_model_stored_but_not_announced_is_announced_once_by_the_next_tracker(
        kafka_bootstrap: str, s3_settings: S3Settings, tmp_path: Path) -> None:
    async with kafka_minio(kafka_bootstrap, s3_settings) as (bus, store, env):
        await _stored_not_announced(bus, store, env, tmp_path)


async def _stored_not_announced(bus: KafkaBus, store: MinioStore, env: dict[str, str], tmp_path: Path) -> None:
    fed = await feed(bus, store, elements=4096)   # no averaging to interrupt here: a small model
    # What a tracker stopped between the upload and the publish leaves: the real tracker code
    # consolidates the same round into the same store, but announces it on a bus of its own.
    private = MemoryBus()
    await private.start()
    for topic in (JOBS, PLACEMENTS, PROGRESS):
        async for d in bus.read(topic):
            mine = getattr(d.event, "job_id", None) == fed.job_id or getattr(d.event, "round", None) == fed.round
            if mine and isinstance(d.event, (JobSubmitted, RoundStarted, Assignment, CopyFinished)):
                await private.publish(d.event)
    writer = TrackerService(bus=private, store=store, config=TrackerConfig(
        group="writer", tick_s=0.05, finish_timeout_s=1e9, snapshot_every=0, delete_checkpoints=False,
        delete_completed_models=False))
    await writer.start()
    try:
        await until("the model object", lambda: store.exists(model_key(fed.job_id, fed.round)), START_S)
    finally:
        await writer.stop()
        await private.stop()
    stored = await store.get(model_key(fed.job_id, fed.round))
    assert not await models_events(bus, fed.job_id)

    staging = tmp_path / "staging"
    staging.mkdir()
    tracker = TrackerProcess(env, f"tracker-{uuid.uuid4().hex[:8]}", staging, tmp_path / "tracker.log", drain_s=30)
    try:
        events = await completed_once(bus, fed, tracker)
        (model,) = [e for e in events if isinstance(e, ModelConsolidated)]
        await assert_model_is_the_average(store, fed, model)
        assert await store.get(model.key) == stored   # announced as stored, not recomputed
    finally:
        tracker.kill()
