"""The scheduler with authorship checked (shared.security.authorship), on the memory bus: a
node registered under another node's seal never adds capacity, a job submitted in another
user's name never runs, and the log read with the verifier (``hadar replay --rerun`` with an
admin's settings) re-derives every round; read without it, the forged job is folded and the
rounds differ (why replay must be given the verifier on such a cluster)."""

from __future__ import annotations

import asyncio

from services.scheduler.config import SchedulerConfig
from services.scheduler.live.rerun import LoggedEvent, rerun
from services.scheduler.live.service import SchedulerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.security.authorship import Sealer, Verifier
from shared.security.identities import Credential, Registry, derive_key, new_user_key, public_key_of
from shared.wire.events import (
    Assignment,
    Event,
    GpuInfo,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    ThroughputEstimate,
    encode,
    key_for,
    topic_for,
)
from shared.wire.topics import ALL_TOPICS

MASTER = bytes(range(32))
CONFIG = SchedulerConfig(policy="yarn-cs", round_s=10, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)


def node(name: str) -> Credential:
    return Credential(identity=f"node/{name}", epoch=1, key=derive_key(MASTER, f"node/{name}", 1))


async def sealed(bus: MemoryBus, credential: Credential, event: Event) -> None:
    await bus.write_raw(topic_for(event), key_for(event), Sealer(credential).seal(encode(event)))


async def test_a_node_forged_by_another_never_counts_and_the_rerun_agrees() -> None:
    user = Credential(identity="user/u", epoch=1, key=new_user_key())
    registry, _ = Registry().enrol("user/u", public_key_of(user.key))
    for name in ("n1", "n2"):
        registry, _ = registry.enrol(f"node/{name}")
    bus = MemoryBus()
    bus.verifier = Verifier(MASTER, lambda: registry)
    await bus.start()
    clock = FakeClock()
    now = clock.time()
    gpu = (GpuInfo(index=0, type="t4"),)
    for name in ("n1", "n2"):
        await sealed(bus, node(name), NodeRegistered(ts=now, source="agent", node_id=name, gpus=gpu))
    # n1 registers a third node, and user u submits a job as user v, first in the queue: were
    # they believed, the forged job would run and a real one wait.
    await sealed(bus, node("n1"), NodeRegistered(ts=now, source="agent", node_id="n3", gpus=gpu))
    forged = JobSpec(job_id="z", user="v", model="resnet", dataset="digits", batch_size=32, workers=1, iterations=100)
    await sealed(bus, user, JobSubmitted(ts=now - 1, source="cli", job=forged, submitted_at=now - 1))
    await bus.publish(ThroughputEstimate(ts=now, source="profiler", job_id="z", basis="estimate", workers=1,
                                         rates={"t4": 4.0}))
    for i, job_id in enumerate(("a", "b", "c")):
        spec = JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32, workers=1,
                       iterations=100)
        await sealed(bus, user, JobSubmitted(ts=now + i, source="cli", job=spec, submitted_at=now + i))
        await bus.publish(ThroughputEstimate(ts=now, source="profiler", job_id=job_id, basis="estimate",
                                          workers=1, rates={"t4": 4.0}))
    service = SchedulerService(bus=bus, config=CONFIG, clock=clock, run_rounds=False)
    await service.start()
    for _ in range(300):
        if len(service.state.jobs) == 3 and len(service.state.nodes) == 2:
            break
        await asyncio.sleep(0.01)
    for _ in range(2):
        await service.plan_round()
        clock.advance(10)
    await service.stop()
    assert set(service.state.nodes) == {"n1", "n2"} and "z" not in service.state.jobs

    async def log_read() -> list[LoggedEvent]:
        return [LoggedEvent(topic=d.topic, partition=d.partition, offset=d.offset, event=d.event)
                for topic in ALL_TOPICS async for d in bus.read(topic)]

    checked = await log_read()
    placed = {(a.job_id, a.node_id) for item in checked if isinstance(a := item.event, Assignment)}
    assert {n for _, n in placed} == {"n1", "n2"} and "z" not in {j for j, _ in placed}
    checks = list(rerun(checked))
    assert [c.round for c in checks] == [0, 1] and all(c.matches for c in checks), checks
    bus.verifier = None   # seals unchecked: the forged job is folded, and it would have run first
    unchecked = list(rerun(await log_read()))
    assert not unchecked[0].matches and any(job == "z" for job, *_ in unchecked[0].rederived)
    await bus.stop()
