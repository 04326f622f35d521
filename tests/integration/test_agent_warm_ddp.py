"""Warm DDP copies on real Kafka + MinIO: a 2-rank copy kept on the same two device slots
keeps both worker processes and their process group over rounds, and every rank reloads
the consolidated model in place (services/agent/slots.py, services/agent/worker/session.py).

As in test_agent_warm.py the consolidated models are written by the test and differ from
what the workers hold (halfway to the seed's weights). Each rank reports a digest of the
weights it starts a round from; the ranks check together that theirs are equal before the
first step, and the test checks them against the file.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import save_file
from structlog.testing import capture_logs

from services.agent.protocol import StoreTarget
from services.agent.worker.checkpoint import read_checkpoint
from services.agent.worker.session import state_digest
from shared.bus import KafkaBus
from shared.domain.layout import model_key
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import Progress, RoundStarted
from shared.wire.topics import PLACEMENTS
from shared.zoo import build_model, load_dataset
from tests.integration.test_agent import assign, job, start_agent
from tests.integration.test_agent_warm import averaged_with_seed

STEPS = 10


def started(logs: list[dict], job_id: str, round_: int) -> dict[int, dict]:
    """Each rank's ``worker.started`` log entry of one round, by rank."""
    return {e["rank"]: e for e in logs if e.get("event") == "worker.started" and e.get("job") == job_id
            and e.get("round") == round_}


@pytest.mark.kafka
@pytest.mark.s3
@pytest.mark.slow
async def test_a_ddp_copy_kept_on_its_slots_keeps_its_processes_and_every_rank_reloads_in_place(
        kafka_bootstrap: str, s3_settings: S3Settings, tmp_path: Path) -> None:
    settings = replace(s3_settings, bucket=f"warmddp-{uuid.uuid4().hex[:12]}")
    bus = KafkaBus(kafka_bootstrap, source="test")
    await bus.start()
    store = MinioStore(settings)
    await store.start()
    node, job_id = f"n-{uuid.uuid4().hex[:8]}", f"ddpw-{uuid.uuid4().hex[:8]}"
    first = 1 + max([d.event.round async for d in bus.read(PLACEMENTS) if isinstance(d.event, RoundStarted)],
                    default=-1)
    spec = job(job_id, workers=2)
    data = load_dataset("digits")
    seed_state = build_model("resnet", data.info, seed=7).state_dict()
    agent, watch = await start_agent(bus, StoreTarget.remote(settings), node=node, stop_timeout_s=10.0)
    pids: list[tuple[int, int]] = []
    starts: dict[int, str] = {}   # round -> digest of the weights it must start from
    crashed: list = []

    async def round_(r: int, gpus: tuple[int, int], start_from: str | None, budget: int = STEPS) -> None:
        await bus.publish(RoundStarted(ts=time.time(), source="test", round=r, policy="hadar",
                                    started_at=time.time(), ends_at=time.time() + 120))
        await bus.publish(assign(spec, r, budget=budget, gpus=gpus, node=node, start_from=start_from))

    async def consolidate(r: int, checkpoint: str, total: int) -> str:
        """The tracker's part, by hand: a model that differs from every rank's weights."""
        path = tmp_path / f"ckpt{r}.safetensors"
        await store.get_file(checkpoint, path)
        tensors, _ = read_checkpoint(path)
        weights, meta = averaged_with_seed(tensors, seed_state, total_steps=total)
        save_file(weights, str(tmp_path / f"model{r}.safetensors"), metadata=meta)
        await store.put_file(model_key(job_id, r), tmp_path / f"model{r}.safetensors")
        starts[r + 1] = state_digest({k: v for k, v in weights.items() if not k.startswith("optim.")})
        return model_key(job_id, r)

    try:
        with capture_logs() as logs:
            start_from, starts[first] = None, state_digest(seed_state)
            for r in range(first, first + 3):   # kept: same job, GPUs and rank set
                await round_(r, (0, 1), start_from)
                done = await watch.finished(job_id, r)
                assert (done.status, done.steps_round) == ("ok", STEPS), done.reason
                procs = [agent.slots.process(g) for g in (0, 1)]
                assert all(p is not None and p.alive for p in procs)
                assert [agent.slots.slot(g).state for g in (0, 1)] == ["idle", "idle"]
                pids.append((procs[0].pid, procs[1].pid))  # type: ignore[union-attr]
                start_from = await consolidate(r, done.checkpoint or "", STEPS * (r - first + 1))
            swapped = first + 3   # rank 0 on GPU 1, rank 1 on GPU 0: the rank set changed
            await round_(swapped, (1, 0), start_from)
            done = await watch.finished(job_id, swapped)
            assert (done.status, done.steps_round) == ("ok", STEPS), done.reason
            replaced = (agent.slots.process(0).pid, agent.slots.process(1).pid)  # type: ignore[union-attr]
            start_from = await consolidate(swapped, done.checkpoint or "", STEPS * 4)
            # a rank killed mid-round: its peer must not hang in a collective; both are torn down
            doomed = first + 4
            await round_(doomed, (1, 0), start_from, budget=1_000_000)
            await watch.wait(lambda e: isinstance(e, Progress) and e.job_id == job_id and e.round == doomed)
            victims = [agent.slots.process(g) for g in (0, 1)]
            os.kill(victims[0].pid, signal.SIGKILL)  # type: ignore[union-attr]   # rank 1 (GPU 0)
            crashed.append(await watch.finished(job_id, doomed))
            for victim in victims:
                assert victim is not None
                await victim.wait()   # rank 0 ended too (failed in its collective, or killed)
            assert [(agent.slots.slot(g).state, agent.slots.slot(g).generation) for g in (0, 1)] == \
                [("empty", 2), ("empty", 2)]   # the next assignment spawns both
    finally:
        await agent.stop()
        await watch.stop()
        await bus.stop()
        await store.stop()
    assert len(set(pids)) == 1, f"respawned: pids {pids}"
    assert set(replaced).isdisjoint(pids[0]), f"rank set changed but processes kept: {replaced} vs {pids[0]}"
    reuses = agent.registry.get_sample_value("hadar_agent_worker_slots_total",
                                             {"node": node, "emulated": "false", "action": "reuse"})
    assert reuses == 6   # 2 ranks x (rounds 2 and 3, and the doomed round on the swapped processes)
    respawn_reasons = [e["reason"] for e in logs if e.get("event") == "slot.respawn" and e.get("job") == job_id]
    assert respawn_reasons and all(r.startswith("rank set changed") for r in respawn_reasons), respawn_reasons
    for r in range(first, first + 4):
        ranks = started(logs, job_id, r)
        assert sorted(ranks) == [0, 1], f"round {r}: {sorted(ranks)}"
        assert [ranks[k]["weights"] for k in (0, 1)] == [starts[r]] * 2, f"round {r}: not the consolidated model"
        assert [bool(ranks[k]["warm"]) for k in (0, 1)] == [first < r < first + 3] * 2
    assert crashed[0].status == "failed"
    assert agent.registry.get_sample_value("hadar_agent_slot_crashes_total",
                                           {"node": node, "emulated": "false"}) >= 1


@pytest.mark.slow
async def test_a_copy_spanning_two_agents_keeps_its_group_while_its_peers_stay(tmp_path: Path) -> None:
    """Two agents (one device each) on one bus run ranks 0 and 1 of a copy that spans them;
    with the same peers next round both keep their process; each rank reloads in place."""
    from services.agent.daemon.discovery import cpu_devices
    from services.agent.daemon.runner import free_port
    from shared.bus import MemoryBus
    from shared.wire.events import Assignment

    bus = MemoryBus()
    await bus.start()
    store = StoreTarget.local(tmp_path)
    job_id, nodes = "span1", ("na", "nb")
    spec = job(job_id, workers=2)
    agents = [await start_agent(bus, store, cpu_devices(1), node=n) for n in nodes]
    rendezvous = f"127.0.0.1:{free_port()}"
    pids: list[tuple[int, int]] = []
    seed_state = build_model("resnet", load_dataset("digits").info, seed=7).state_dict()
    starts = {0: state_digest(seed_state)}
    try:
        with capture_logs() as logs:
            start_from = None
            for r in (0, 1):
                await bus.publish(RoundStarted(ts=time.time(), source="test", round=r, policy="hadar",
                                            started_at=time.time(), ends_at=time.time() + 120))
                for rank, node in enumerate(nodes):
                    await bus.publish(Assignment(
                        ts=time.time(), source="test", round=r, job=spec, copy=0, node_id=node, gpus=(0,),
                        gpu_type="cpu", world_size=2, ranks=(rank,), step_budget=STEPS, deadline=time.time() + 120,
                        start_from=start_from, rendezvous=rendezvous, peers=nodes))
                done = await agents[0][1].finished(job_id, r)
                assert (done.status, done.steps_round) == ("ok", STEPS), done.reason
                pids.append(tuple(a.slots.process(0).pid for a, _ in agents))  # type: ignore[misc, union-attr]
                tensors, _ = read_checkpoint(tmp_path / (done.checkpoint or ""))
                weights, meta = averaged_with_seed(tensors, seed_state, total_steps=STEPS * (r + 1))
                (tmp_path / model_key(job_id, r)).parent.mkdir(parents=True, exist_ok=True)
                save_file(weights, str(tmp_path / model_key(job_id, r)), metadata=meta)
                start_from = model_key(job_id, r)
                starts[r + 1] = state_digest({k: v for k, v in weights.items() if not k.startswith("optim.")})
        # rank 1's agent reports nothing (rank 0's node reports the copy) but its worker started warm
        for r in (0, 1):
            ranks = started(logs, job_id, r)
            assert sorted(ranks) == [0, 1] and [bool(ranks[k]["warm"]) for k in (0, 1)] == [r == 1] * 2
            assert [ranks[k]["weights"] for k in (0, 1)] == [starts[r]] * 2, f"round {r}: not the start model"
    finally:
        for agent, watch in agents:
            await agent.stop()
            await watch.stop()
        await bus.stop()
    assert pids[0] == pids[1], f"respawned: {pids}"
