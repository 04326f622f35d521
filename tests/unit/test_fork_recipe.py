"""The copy count travels from the live scheduler to the agent's local-SGD recipe.

``plan_to_events`` states on every Assignment how many copies of the job run this round
and their workers together (K); the agent builds each worker's ``LocalSgd`` from it
(``services.agent.daemon.runner.local_sgd_recipe``), so a forked copy advances the job by K / W
per own step, as the tracker credits it, instead of the one-whole-copy default.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from services.agent.daemon.runner import local_sgd_recipe
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.live.rounds import RoundTiming, build_request, plan_to_events
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import PolicyChoice
from shared.domain.local_sgd import LocalSgd
from shared.wire.events import (
    Assignment,
    GpuInfo,
    InvalidEvent,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    ThroughputEstimate,
    decode,
    encode,
)

T0 = 1_700_000_000.0
TP = ThroughputModel.from_gavel_table()
JOB_TYPE = "ResNet-50 (batch size 32)"
STEPS = 10_000_000


def _assignments(policy: str, nodes: int, gpus_per_node: int, workers: int) -> list[Assignment]:
    state = SchedulerState()
    for i in range(nodes):
        state.apply(NodeRegistered(ts=T0, source="agent", node_id=f"n{i}", address=f"n{i}.lan",
                                   gpus=tuple(GpuInfo(index=g, type="v100") for g in range(gpus_per_node))))
    spec = JobSpec(job_id="job-a", user="u", model="ResNet-50", dataset="imagenet", batch_size=32,
                   workers=workers, iterations=STEPS)
    state.apply(JobSubmitted(ts=T0, source="cli", job=spec, submitted_at=T0))
    state.apply(ThroughputEstimate(ts=T0, source="profiler", job_id="job-a", basis="estimate", workers=workers,
                                   rates={"v100": TP.rate(JOB_TYPE, "v100", workers)}))
    choice = PolicyChoice(name=policy)
    timing = RoundTiming(round=0, started_at=T0, round_s=360.0, heartbeat_s=5.0)
    request = build_request(state, timing, None, seed=0)
    events = plan_to_events(choice.build().plan(request), request, state, timing, choice=choice, seed=0,
                            source="scheduler", inputs={}, decision_ms=1.0)
    return [e for e in events if isinstance(e, Assignment)]


def test_forked_copies_carry_the_copy_count_and_the_agent_scales_the_recipe_by_it():
    sent = _assignments("hadare", nodes=3, gpus_per_node=1, workers=1)
    assert sorted(a.copy for a in sent) == [0, 1, 2]           # HadarE forks onto every idle node
    assert {(a.copies, a.fork_workers) for a in sent} == {(3, 3)}
    recipes = {local_sgd_recipe(decode(encode(a))) for a in sent}   # as the agent reads it off the wire
    assert recipes == {LocalSgd(fork_workers=3, job_workers=1, job_steps=STEPS)}
    assert next(iter(recipes)).job_steps_per_copy_step == 3.0


def test_a_whole_copy_states_its_own_workers_and_trains_as_before():
    sent = _assignments("hadar", nodes=1, gpus_per_node=2, workers=2)
    assert [(a.copies, a.fork_workers, a.world_size) for a in sent] == [(1, 2, 2)]
    recipe = local_sgd_recipe(sent[0])
    assert recipe.scale == 1.0 and recipe.job_steps_per_copy_step == 1.0


def test_a_record_written_before_the_fields_decodes_as_one_whole_copy():
    [a] = _assignments("hadar", nodes=1, gpus_per_node=1, workers=1)
    raw = msgpack.unpackb(encode(a))
    del raw["body"]["copies"], raw["body"]["fork_workers"]
    old = decode(msgpack.packb(raw))
    assert (old.copies, old.fork_workers) == (1, 0)
    assert local_sgd_recipe(old) == LocalSgd(fork_workers=0, job_workers=1, job_steps=STEPS)


@pytest.mark.parametrize("copies, fork_workers", [(0, 0), (1025, 0), (2, 1), (1, -1)])
def test_an_implausible_copy_count_is_refused(copies: int, fork_workers: int):
    [a] = _assignments("hadar", nodes=1, gpus_per_node=2, workers=2)
    with pytest.raises(InvalidEvent):
        dataclasses.replace(a, copies=copies, fork_workers=fork_workers)
