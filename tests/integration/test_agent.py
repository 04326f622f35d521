"""The node agent end to end: assignments in, real training in worker subprocesses, events out.

Runs on MemoryBus + LocalStore, and once on real Kafka + MinIO (markers ``kafka``/``s3``).
Each test trains tiny models for a few hundred steps; most of its time is the workers'
``import torch``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.agent.daemon.discovery import NodeDevices, cpu_devices, emulated_devices
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from services.agent.worker.checkpoint import CheckpointMeta, read_checkpoint
from services.agent.worker.training import BatchSampler
from shared.bus import Bus, KafkaBus, MemoryBus
from shared.domain.layout import checkpoint_key, model_key
from shared.store import LocalStore, MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    Hyperparameters,
    JobCancelled,
    JobSpec,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    RoundStarted,
)
from shared.wire.topics import NODES, PLACEMENTS, PROGRESS
from shared.zoo import (
    build_model,
    evaluate,
    load_dataset,
    loss_function,
    make_optimizer,
)


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """Workers run torch on one thread; so does this process (2 threads on a busy 2-core box crawl)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


NODE = "n1"


def job(job_id: str, *, model: str = "resnet", dataset: str = "digits", seed: int = 7,
        optimizer: str = "sgd", workers: int = 1) -> JobSpec:
    return JobSpec(job_id=job_id, user="alice", model=model, dataset=dataset, batch_size=32,
                   workers=workers, iterations=10_000, hyper=Hyperparameters(optimizer=optimizer, lr=0.05, seed=seed))


def assign(spec: JobSpec, round_: int, *, budget: int, copy: int = 0, gpus: tuple[int, ...] = (0,),
           start_from: str | None = None, deadline_s: float = 120.0, node: str = NODE) -> Assignment:
    return Assignment(ts=time.time(), source="test", round=round_, job=spec, copy=copy, node_id=node, gpus=gpus,
                      gpu_type="cpu", world_size=len(gpus), ranks=tuple(range(len(gpus))), step_budget=budget,
                      deadline=time.time() + deadline_s, start_from=start_from)


class Watcher:
    """Collects every event on the agent's output topics, in arrival order."""

    def __init__(self, bus: Bus) -> None:
        self.events: list[Event] = []
        self._sub = bus.subscribe([PROGRESS, NODES], f"watch-{uuid.uuid4().hex[:8]}")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._sub.start()
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for delivery in self._sub:
            self.events.append(delivery.event)
            await delivery.ack()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._sub.stop()

    async def wait(self, predicate: Callable[[Event], bool], timeout_s: float = 90.0) -> Event:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in self.events:
                if predicate(event):
                    return event
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out; saw {[type(e).__name__ for e in self.events]}")

    async def finished(self, job_id: str, round_: int = 0, timeout_s: float = 90.0) -> CopyFinished:
        event = await self.wait(lambda e: isinstance(e, CopyFinished) and e.job_id == job_id and e.round == round_,
                                timeout_s)
        assert isinstance(event, CopyFinished)
        return event


@pytest.fixture
async def memory_bus() -> Bus:
    bus = MemoryBus()
    await bus.start()
    yield bus
    await bus.stop()


async def start_agent(bus: Bus, store: StoreTarget, devices: NodeDevices | None = None, *,
                      node: str = NODE, **config: float) -> tuple[AgentDaemon, Watcher]:
    watcher = Watcher(bus)
    await watcher.start()
    settings = {"progress_s": 0.3, "heartbeat_s": 0.5, "stop_timeout_s": 20.0, "spare_workers": 0, **config}
    agent = AgentDaemon(AgentConfig(node_id=node, **settings), bus=bus, store=store,  # type: ignore[arg-type]
                        devices=devices or cpu_devices(2))
    await agent.start()
    return agent, watcher


def load_local(root: Path, key: str) -> tuple[dict[str, torch.Tensor], CheckpointMeta]:
    tensors, meta = read_checkpoint(root / key)
    return tensors, CheckpointMeta.from_metadata(meta)


async def test_trains_a_copy_and_reports_it(memory_bus: Bus, tmp_path: Path) -> None:
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path))
    try:
        registered = await watch.wait(lambda e: isinstance(e, NodeRegistered))
        assert isinstance(registered, NodeRegistered) and [g.type for g in registered.gpus] == ["cpu", "cpu"]
        spec = job("train1")
        await memory_bus.publish(assign(spec, 0, budget=300))
        done = await watch.finished("train1")
        assert (done.status, done.steps_round, done.node_id) == ("ok", 300, NODE)
        assert done.checkpoint == checkpoint_key("train1", 0, 0, node=NODE)
        progress = [e for e in watch.events if isinstance(e, Progress) and e.job_id == "train1"]
        assert progress and all(p.workers == 1 and p.samples_per_s > 0 and not p.emulated for p in progress)
        assert [p.steps_round for p in progress] == sorted(p.steps_round for p in progress)
        tensors, meta = load_local(tmp_path, done.checkpoint)
        assert (meta.job, meta.round, meta.copy, meta.steps, meta.total_steps) == ("train1", 0, 0, 300, 300)
        assert meta.gpu_type == "cpu" and meta.metric_name == "accuracy"
        assert any(k.startswith("optim.") for k in tensors)   # momentum buffers travel too
        data = load_dataset("digits")
        untrained = evaluate(build_model("resnet", data.info, seed=7), data).value
        assert meta.metric_value is not None and meta.metric_value > untrained + 0.3
        await watch.wait(lambda e: isinstance(e, NodeHeartbeat) and e.seq >= 1)
        assert agent.health()["ok"]
    finally:
        await agent.stop()
        await watch.stop()


async def test_ddp_two_workers_match_one_process_on_both_batches(memory_bus: Bus, tmp_path: Path) -> None:
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path))
    steps = 12
    try:
        spec = job("ddp1", workers=2)
        await memory_bus.publish(assign(spec, 0, budget=steps, gpus=(0, 1)))
        done = await watch.finished("ddp1")
        assert (done.status, done.steps_round) == ("ok", steps), done.reason
    finally:
        await agent.stop()
        await watch.stop()
    tensors, meta = load_local(tmp_path, done.checkpoint or "")
    assert meta.total_steps == steps
    # DDP averages the two ranks' gradients: one process on both ranks' batches must agree.
    data = load_dataset("digits")
    model = build_model("resnet", data.info, seed=7)
    opt = make_optimizer("sgd", model.parameters(), 0.05)
    loss_fn = loss_function("classification")
    samplers = [BatchSampler(len(data.train_x), 32, (7, 0, rank), torch.device("cpu")) for rank in (0, 1)]
    for step in range(steps):
        losses = [loss_fn(model(data.train_x[s.indices(step)]), data.train_y[s.indices(step)]) for s in samplers]
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-4, atol=1e-5)


async def test_preempted_copy_resumes_exactly_from_its_checkpoint(memory_bus: Bus, tmp_path: Path) -> None:
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), spare_workers=1)
    total = 400
    try:
        spec = job("resume1", optimizer="adam")
        await memory_bus.publish(assign(spec, 0, budget=100_000))
        await watch.wait(lambda e: isinstance(e, Progress) and e.job_id == "resume1")
        await memory_bus.publish(RoundStarted(ts=time.time(), source="test", round=1, policy="hadare",
                                           started_at=time.time(), ends_at=time.time() + 120))
        # The same job trained in one go, meanwhile, on the other device.
        await memory_bus.publish(assign(replace(spec, job_id="straight1"), 1, budget=total, gpus=(1,)))
        cut = await watch.finished("resume1", 0)
        assert cut.status == "preempted" and cut.checkpoint is not None
        assert 0 < cut.steps_round < total, "preempted too late for this test"
        await memory_bus.publish(assign(spec, 1, budget=total - cut.steps_round, start_from=cut.checkpoint))
        resumed = await watch.finished("resume1", 1)
        assert (resumed.status, resumed.steps_round) == ("ok", total - cut.steps_round), resumed.reason
        whole = await watch.finished("straight1", 1)
    finally:
        await agent.stop()
        await watch.stop()
    got, got_meta = load_local(tmp_path, resumed.checkpoint or "")
    want, want_meta = load_local(tmp_path, whole.checkpoint or "")
    assert got_meta.total_steps == want_meta.total_steps == total
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


async def test_failing_worker_is_reported_and_agent_keeps_running(memory_bus: Bus, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    await store.start()
    await store.put(model_key("bad1", 0), b"\x00not a safetensors file at all")
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path))
    try:
        await memory_bus.publish(assign(job("bad1"), 1, budget=10, start_from=model_key("bad1", 0)))
        await memory_bus.publish(assign(job("kill1"), 1, budget=100_000, gpus=(1,)))
        failed = await watch.finished("bad1", 1)
        assert failed.status == "failed" and failed.checkpoint is None
        assert "bad checkpoint" in failed.reason
        await memory_bus.publish(assign(job("bad2", model="vgg"), 1, budget=10))   # GPU 0 is free again
        unknown = await watch.finished("bad2", 1)
        assert unknown.status == "failed" and "model: unknown 'vgg'" in unknown.reason
        await watch.wait(lambda e: isinstance(e, Progress) and e.job_id == "kill1")
        os.kill(agent.runs[("kill1", 1, 0)].workers[0].pid, signal.SIGKILL)   # out of memory, say
        killed = await watch.finished("kill1", 1)
        assert killed.status == "failed" and "signal 9" in killed.reason
        await memory_bus.publish(assign(job("good1", model="autoencoder", dataset="synthetic-ratings"), 1, budget=30))
        good = await watch.finished("good1", 1)
        assert (good.status, good.steps_round) == ("ok", 30)
        assert agent.health()["ok"]
        metrics = agent.registry.get_sample_value("hadar_agent_worker_failures_total",
                                                  {"node": NODE, "emulated": "false"})
        assert metrics is not None and metrics >= 1
    finally:
        await agent.stop()
        await watch.stop()


async def test_stale_duplicate_and_cancelled(memory_bus: Bus, tmp_path: Path) -> None:
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), spare_workers=1)
    try:
        stale = assign(job("stale1"), 0, budget=10, deadline_s=-1.0)
        fresh = assign(job("dup1", model="autoencoder", dataset="synthetic-ratings"), 0, budget=20)
        other = assign(job("other1"), 0, budget=10, node="n2")
        for event in (stale, fresh, fresh, other):
            await memory_bus.publish(event)
        await watch.finished("dup1")
        await memory_bus.publish(assign(job("cancel1"), 0, budget=100_000))
        await watch.wait(lambda e: isinstance(e, Progress) and e.job_id == "cancel1")
        await memory_bus.publish(JobCancelled(ts=time.time(), source="cli", job_id="cancel1", reason="by alice"))
        cancelled = await watch.finished("cancel1")
        assert cancelled.status == "preempted" and "job cancelled: by alice" in cancelled.reason
    finally:
        await agent.stop()
        await watch.stop()
    done = [e for e in watch.events if isinstance(e, CopyFinished)]
    assert [(e.job_id, e.status) for e in done] == [("dup1", "ok"), ("cancel1", "preempted")]


async def test_drain_checkpoints_running_copies(memory_bus: Bus, tmp_path: Path) -> None:
    devices = emulated_devices((("v100", 1),))
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), devices)
    try:
        registered = await watch.wait(lambda e: isinstance(e, NodeRegistered))
        assert isinstance(registered, NodeRegistered) and registered.emulated
        await memory_bus.publish(assign(job("drain1", model="lstm", dataset="synthetic-text"), 0, budget=100_000))
        first = await watch.wait(lambda e: isinstance(e, Progress) and e.job_id == "drain1")
        assert isinstance(first, Progress) and first.emulated
    finally:
        await agent.stop()   # returns only after the copy checkpointed and reported
        await watch.stop()
    done = [e for e in watch.events if isinstance(e, CopyFinished)]
    assert len(done) == 1 and done[0].status == "preempted" and done[0].emulated
    _, meta = load_local(tmp_path, done[0].checkpoint or "")
    assert meta.gpu_type == "v100" and meta.steps == done[0].steps_round > 0


@pytest.mark.kafka
@pytest.mark.s3
async def test_trains_on_kafka_and_minio(kafka_bootstrap: str, s3_settings: S3Settings) -> None:
    settings = replace(s3_settings, bucket=f"agent-{uuid.uuid4().hex[:12]}")
    bus = KafkaBus(kafka_bootstrap, source="test")
    await bus.start()
    node = f"n-{uuid.uuid4().hex[:8]}"
    # The broker is shared with other tests and earlier runs: a fresh job id, and a round after
    # every round already on hadar.placements (an agent treats older rounds as stale), started
    # as a scheduler does, so the round's RoundStarted vouches for a round far past the agent's.
    job_id = f"kafka-{uuid.uuid4().hex[:8]}"
    round_ = 1 + max([d.event.round async for d in bus.read(PLACEMENTS) if isinstance(d.event, RoundStarted)],
                     default=-1)
    agent, watch = await start_agent(bus, StoreTarget.remote(settings), node=node)
    try:
        await bus.publish(RoundStarted(ts=time.time(), source="test", round=round_, policy="hadare",
                                    started_at=time.time(), ends_at=time.time() + 120))
        await bus.publish(assign(job(job_id), round_, budget=60, node=node))
        done = await watch.finished(job_id, round_)
        assert (done.status, done.steps_round, done.node_id) == ("ok", 60, node), done.reason
    finally:
        await agent.stop()
        await watch.stop()
        await bus.stop()
    store = MinioStore(settings)
    await store.start()
    try:
        path = Path(f"/tmp/agent-test-{uuid.uuid4().hex}.safetensors")
        await store.get_file(done.checkpoint or "", path)
        _, meta = read_checkpoint(path)
        path.unlink()
        assert CheckpointMeta.from_metadata(meta).total_steps == 60
    finally:
        await store.stop()
