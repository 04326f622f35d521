"""A copy resumes mid-round only from a checkpoint its own node wrote (issue 26).

The attack: a process holding store credentials wrote an object at another node's copy's
checkpoint key, with metadata naming that copy and claiming most of its steps; the copy took
it for its own progress, "finished" at once, and the tracker averaged the planted weights
in. Now the object is ignored (counted, logged) unless its digest is the one the node
recorded writing there, and the copy trains its round from the start; a copy whose own
checkpoint is there (its Assignment redelivered to a restarted agent) still resumes from it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.agent.protocol import StoreTarget
from services.agent.worker.checkpoint import CheckpointMeta, save_checkpoint
from shared.bus import MemoryBus
from shared.domain.layout import checkpoint_key
from shared.store import LocalStore
from shared.zoo import build_model, load_dataset, make_optimizer
from tests.integration.test_agent import assign, job, load_local, memory_bus, start_agent

__all__ = ["memory_bus"]

NODE = {"node": "n1", "emulated": "false"}


async def plant(root: Path, job_id: str, *, steps: int) -> None:
    """The job's model with absurd weights, metadata naming copy 0 of round 0 and ``steps``."""
    model = build_model("resnet", load_dataset("digits").info, seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1000.0)
    optimizer = make_optimizer("sgd", model.parameters(), 0.05)
    path = root / "planted.safetensors"
    save_checkpoint(path, model, optimizer, CheckpointMeta(job=job_id, round=0, copy=0, steps=steps,
                                                           total_steps=steps, gpu_type="cpu", model="resnet",
                                                           dataset="digits"))
    store = LocalStore(root)
    await store.start()
    try:
        # where the agent (start_agent's node) writes, and on an Assignment redelivered, resumes from
        await store.put(checkpoint_key(job_id, 0, 0, node=NODE["node"]), path.read_bytes())
    finally:
        await store.stop()


async def test_a_planted_checkpoint_is_not_taken_for_the_copys_progress(memory_bus, tmp_path: Path) -> None:
    await plant(tmp_path, "plant1", steps=90)
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), ledger_dir=str(tmp_path / "ledger"))
    try:
        await memory_bus.publish(assign(job("plant1"), 0, budget=100))
        await memory_bus.publish(assign(job("clean1"), 0, budget=100, gpus=(1,)))   # the same job, untouched
        planted = await watch.finished("plant1")
        clean = await watch.finished("clean1")
        assert (planted.status, planted.steps_round) == ("ok", 100), planted.reason
        not_ours = agent.registry.get_sample_value("hadar_agent_checkpoints_not_ours_total", NODE)
        assert not_ours == 1
    finally:
        await agent.stop()
        await watch.stop()
    got, _ = load_local(tmp_path, planted.checkpoint or "")
    want, _ = load_local(tmp_path, clean.checkpoint or "")
    for name in want:   # trained from the seed over the same batches: bit for bit
        assert torch.equal(got[name], want[name]), name


async def test_a_redelivered_copy_resumes_from_the_checkpoint_its_node_wrote(tmp_path: Path) -> None:
    ledger = str(tmp_path / "ledger")
    first_bus, second_bus = MemoryBus(), MemoryBus()
    for bus in (first_bus, second_bus):
        await bus.start()
    spec = job("again1")
    agent, watch = await start_agent(first_bus, StoreTarget.local(tmp_path), ledger_dir=ledger)
    try:
        await first_bus.publish(assign(spec, 0, budget=60))
        done = await watch.finished("again1")
        assert (done.status, done.steps_round) == ("ok", 60), done.reason
    finally:
        await agent.stop()
        await watch.stop()
    # The agent restarts (a fresh one, the same node and disk) and the Assignment comes again.
    agent, watch = await start_agent(second_bus, StoreTarget.local(tmp_path), ledger_dir=ledger)
    try:
        await second_bus.publish(assign(spec, 0, budget=60))
        again = await watch.finished("again1")
        assert (again.status, again.steps_round) == ("ok", 60), again.reason
        # the object at its key was recognised as its own (a round retrained from the seed
        # would end in the same bytes, so the counter is what tells the two apart)
        assert agent.registry.get_sample_value("hadar_agent_checkpoints_not_ours_total", NODE) == 0
    finally:
        await agent.stop()
        await watch.stop()
        for bus in (first_bus, second_bus):
            await bus.stop()
