"""Warm workers on real Kafka + MinIO: a copy kept on its GPU slot over rounds keeps its
process and reloads the consolidated model in place (services/agent/slots.py).

The consolidated models here are written by the test, and made to differ from what the
worker holds in memory (its checkpoint averaged half and half with the seed's weights), so
a worker that trained on without reloading would fail the comparison.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.agent.protocol import StoreTarget
from services.agent.worker.checkpoint import read_checkpoint, restore
from services.agent.worker.training import BatchSampler
from shared.bus import KafkaBus
from shared.domain.layout import model_key
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import CopyFinished, RoundStarted
from shared.wire.topics import PLACEMENTS
from shared.zoo import build_model, load_dataset, loss_function, make_optimizer
from tests.integration.test_agent import assign, job, start_agent

STEPS = 20


def averaged_with_seed(tensors: dict[str, torch.Tensor], seed_state: dict[str, torch.Tensor],
                       total_steps: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A stand-in consolidated model: float weights halfway to the seed's; optimizer state kept."""
    out = {}
    for name, value in tensors.items():
        seed_value = seed_state.get(name)
        if seed_value is not None and value.is_floating_point():
            out[name] = ((value + seed_value) / 2).contiguous()
        else:
            out[name] = value.clone().contiguous()
    return out, {"total_steps": str(total_steps), "job": "x", "round": "0"}


def replay(model_state: dict[str, torch.Tensor], *, start_total: int, steps: int) -> dict[str, torch.Tensor]:
    """What a fresh worker computes from ``model_state``: ``steps`` steps of copy 0, rank 0."""
    data = load_dataset("digits")
    model = build_model("resnet", data.info, seed=7)
    optimizer = make_optimizer("sgd", list(model.parameters()), 0.05)
    restore(model, optimizer, model_state)
    sampler = BatchSampler(len(data.train_x), 32, (7, 0, 0), torch.device("cpu"))
    loss_fn = loss_function("classification")
    model.train()
    for step in range(start_total, start_total + steps):
        index = sampler.indices(step)
        loss = loss_fn(model(data.train_x[index]), data.train_y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.kafka
@pytest.mark.s3
async def test_a_copy_kept_on_its_slot_keeps_its_worker_and_reloads_the_consolidated_model(
        kafka_bootstrap: str, s3_settings: S3Settings, tmp_path: Path) -> None:
    settings = replace(s3_settings, bucket=f"warm-{uuid.uuid4().hex[:12]}")
    bus = KafkaBus(kafka_bootstrap, source="test")
    await bus.start()
    store = MinioStore(settings)
    await store.start()
    node, job_id = f"n-{uuid.uuid4().hex[:8]}", f"warm-{uuid.uuid4().hex[:8]}"
    first = 1 + max([d.event.round async for d in bus.read(PLACEMENTS) if isinstance(d.event, RoundStarted)],
                    default=-1)
    spec = job(job_id)
    data = load_dataset("digits")
    seed_state = build_model("resnet", data.info, seed=7).state_dict()
    agent, watch = await start_agent(bus, StoreTarget.remote(settings), node=node)
    pids, finished, models = [], [], {}
    try:
        start_from = None
        for r in range(first, first + 3):
            await bus.publish(RoundStarted(ts=time.time(), source="test", round=r, policy="hadare",
                                        started_at=time.time(), ends_at=time.time() + 120))
            await bus.publish(assign(spec, r, budget=STEPS, node=node, start_from=start_from))
            done = await watch.finished(job_id, r)
            assert (done.status, done.steps_round) == ("ok", STEPS), done.reason
            worker = agent.slots.process(0)
            assert worker is not None and worker.alive and agent.slots.slot(0).state == "idle"
            pids.append(worker.pid)
            finished.append(done)
            # the tracker's part, by hand: a model that differs from the worker's weights
            path = tmp_path / f"ckpt{r}.safetensors"
            await store.get_file(done.checkpoint or "", path)
            tensors, _ = read_checkpoint(path)
            models[r] = averaged_with_seed(tensors, seed_state, total_steps=STEPS * (r - first + 1))
            model_path = tmp_path / f"model{r}.safetensors"
            save_file(models[r][0], str(model_path), metadata=models[r][1])
            await store.put_file(model_key(job_id, r), model_path)
            start_from = model_key(job_id, r)
        assert len(set(pids)) == 1, f"respawned: pids {pids}"
        assert agent.slots.slot(0).generation == 1 and agent.slots.slot(0).specs == 3
        reuses = agent.registry.get_sample_value("hadar_agent_worker_slots_total",
                                                 {"node": node, "emulated": "false", "action": "reuse"})
        assert reuses == 2
    finally:
        await agent.stop()
        await watch.stop()
        await bus.stop()
    try:
        for previous, done in zip(range(first, first + 2), finished[1:]):
            path = tmp_path / f"check{done.round}.safetensors"
            await store.get_file(done.checkpoint or "", path)
            got, meta = read_checkpoint(path)
            assert int(meta["total_steps"]) == STEPS * (previous - first + 2)
            want = replay(models[previous][0], start_total=STEPS * (previous - first + 1), steps=STEPS)
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        await store.stop()
    assert all(isinstance(d, CopyFinished) for d in finished)
    # each report says how its copy started (what the scheduler learns a move costs from)
    assert [d.start_warm for d in finished] == [False, True, True]
    assert all(d.start_s is not None and 0.0 <= d.start_s < 120.0 for d in finished)
