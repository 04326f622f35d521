"""The agent runs a user's own script (examples/user-code/digits) end to end on one node.

MemoryBus + LocalStore, real worker subprocesses and sandboxed trainers: the code and data
bundles go in through the CLI's own functions (``deliver``, ``upload_dataset``), the agent
fetches, verifies and caches them, and what comes back is what the harness checked and wrote.
Checked: a warm second round keeps the worker and its trainer process; the checkpoint's
metadata is the harness's; a preempted copy resumes on the exact step (the same tensors as a
copy that never stopped); DDP with two ranks in one copy; hostile bundles (a byte changed in
the store, another user's bundle) fail with a reason while the agent stays up and another
job trains.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.agent.protocol import StoreTarget
from services.agent.worker.checkpoint import read_checkpoint
from services.cli.usercode import CodeRequest, deliver, upload_dataset
from shared.bus import Bus, MemoryBus
from shared.domain.layout import code_bundle_key, final_key, model_key
from shared.store import LocalStore
from shared.wire.events import JobSpec, Progress, RoundStarted, UserCode
from tests.integration.test_agent import assign, job, load_local, start_agent

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("requires_landlock")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "user-code" / "digits"
CONFIG = {"lr": 0.05, "total_steps": 400, "channels": 8}


@pytest.fixture
async def memory_bus() -> AsyncIterator[Bus]:
    bus = MemoryBus()
    await bus.start()
    yield bus
    await bus.stop()


@pytest.fixture(scope="module")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    subprocess.run([sys.executable, str(EXAMPLE / "export.py"), str(out)], check=True, capture_output=True,
                   timeout=120)
    return out


async def submitted(root: Path, data: Path, job_id: str, *, user: str = "alice", workers: int = 1) -> JobSpec:
    """The JobSpec ``hadar submit`` would publish for the digits example (bundles stored)."""
    store = LocalStore(root)
    await store.start()
    try:
        await upload_dataset(store, data, user, "digits")
        request = CodeRequest(folder=EXAMPLE, entrypoint="train.py", args=(), hint="resnet", data="digits",
                              config=json.dumps(CONFIG, sort_keys=True))

        async def accept(code: UserCode) -> JobSpec:
            return JobSpec(job_id=job_id, user=user, model="digits-cnn", dataset="digits", batch_size=32,
                           workers=workers, iterations=10_000, code=code)

        spec, _ = await deliver(store, request, user, accept)
        return spec
    finally:
        await store.stop()


def children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


async def test_a_user_job_trains_warm_over_rounds_with_the_harness_metadata(memory_bus, tmp_path: Path,
                                                                             digits_data: Path) -> None:
    spec = await submitted(tmp_path, digits_data, "user1")
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), cache_dir=str(tmp_path / "cache"))
    try:
        await memory_bus.publish(assign(spec, 0, budget=60))
        first = await watch.finished("user1", 0, timeout_s=180)
        assert (first.status, first.steps_round) == ("ok", 60), (first.reason, first.log_tail)
        assert first.metric_name == "accuracy" and first.final_metric is not None and first.start_metric is None
        worker = agent.slots.process(0)
        assert worker is not None and worker.alive
        trainers = children(worker.pid)
        assert len(trainers) == 1, trainers
        # The tracker's model of round 0 would be the average; one copy: the replica itself.
        tensors, _ = read_checkpoint(tmp_path / (first.checkpoint or ""))
        weights = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
        from safetensors.torch import save_file
        (tmp_path / "models" / "user1").mkdir(parents=True)
        save_file(weights, str(tmp_path / model_key("user1", 0)), metadata={"total_steps": "60"})
        await memory_bus.publish(assign(spec, 1, budget=40, start_from=model_key("user1", 0)))
        second = await watch.finished("user1", 1, timeout_s=180)
        assert (second.status, second.steps_round) == ("ok", 40), (second.reason, second.log_tail)
        assert second.start_metric == pytest.approx(first.final_metric)   # the start model is round 0's replica
        assert agent.slots.slot(0).generation == 1 and agent.slots.slot(0).specs == 2
        assert children(worker.pid) == trainers   # the same trainer process trained both rounds
        progress = [e for e in watch.events if isinstance(e, Progress) and e.job_id == "user1"]
        assert progress and all(p.samples_per_s > 0 for p in progress)
        _, meta = load_local(tmp_path, second.checkpoint or "")
        assert (meta.job, meta.round, meta.copy, meta.steps, meta.total_steps) == ("user1", 1, 0, 40, 100)
        assert meta.model == "digits-cnn" and meta.metric_name == "accuracy"

        # The job completed with round 1's model: an evaluation copy measures its final model
        # with the script's own metric, trains nothing and uploads nothing.
        tensors, _ = read_checkpoint(tmp_path / (second.checkpoint or ""))
        save_file({k: v for k, v in tensors.items() if not k.startswith("optim.")}, str(tmp_path / final_key("user1")),
                  metadata={"total_steps": "100"})
        await memory_bus.publish(dataclasses.replace(assign(spec, 2, budget=0, start_from=final_key("user1")),
                                                     evaluation=True))
        final = await watch.finished("user1", 2, timeout_s=180)
        assert (final.status, final.evaluation, final.steps_round, final.checkpoint) == ("ok", True, 0, None), (
            final.reason, final.log_tail)
        assert final.metric_name == "accuracy" and final.start_metric == pytest.approx(second.final_metric)
        assert not (tmp_path / "checkpoints" / "user1" / "2").exists()
    finally:
        await agent.stop()
        await watch.stop()


async def test_a_preempted_user_copy_resumes_on_the_exact_step(memory_bus, tmp_path: Path,
                                                              digits_data: Path) -> None:
    spec = await submitted(tmp_path, digits_data, "cut1")
    straight = dataclasses.replace(spec, job_id="whole1")
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), cache_dir=str(tmp_path / "cache"),
                                     progress_s=0.2)
    total = 2500   # a tiny CNN trains ~5,000 samples/s here: enough steps for the cut to land mid-way
    try:
        await memory_bus.publish(assign(spec, 0, budget=100_000))
        await watch.wait(lambda e: isinstance(e, Progress) and e.job_id == "cut1" and e.steps_round > 0,
                         timeout_s=180)
        await memory_bus.publish(RoundStarted(ts=time.time(), source="test", round=1, policy="hadare",
                                              started_at=time.time(), ends_at=time.time() + 120))
        await memory_bus.publish(assign(straight, 1, budget=total, gpus=(1,)))
        cut = await watch.finished("cut1", 0, timeout_s=120)
        assert cut.status == "preempted" and cut.checkpoint is not None, (cut.reason, cut.log_tail)
        assert 0 < cut.steps_round < total, "preempted too late for this test"
        await memory_bus.publish(assign(spec, 1, budget=total - cut.steps_round, start_from=cut.checkpoint))
        resumed = await watch.finished("cut1", 1, timeout_s=180)
        whole = await watch.finished("whole1", 1, timeout_s=180)
        assert (resumed.status, resumed.steps_round) == ("ok", total - cut.steps_round), resumed.reason
    finally:
        await agent.stop()
        await watch.stop()
    got, got_meta = load_local(tmp_path, resumed.checkpoint or "")
    want, want_meta = load_local(tmp_path, whole.checkpoint or "")
    assert got_meta.total_steps == want_meta.total_steps == total
    assert got.keys() == want.keys()
    for name in want:   # same batches, same order, same arithmetic: bit for bit
        assert torch.equal(got[name], want[name]), name


async def test_ddp_two_ranks_of_one_user_copy(memory_bus, tmp_path: Path, digits_data: Path) -> None:
    spec = await submitted(tmp_path, digits_data, "ddp1", workers=2)
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), cache_dir=str(tmp_path / "cache"))
    try:
        await memory_bus.publish(assign(spec, 0, budget=30, gpus=(0, 1)))
        done = await watch.finished("ddp1", 0, timeout_s=180)
        assert (done.status, done.steps_round) == ("ok", 30), (done.reason, done.log_tail)
    finally:
        await agent.stop()
        await watch.stop()
    tensors, meta = load_local(tmp_path, done.checkpoint or "")
    assert meta.total_steps == 30 and any(k.startswith("optim.") for k in tensors)


async def test_hostile_bundles_fail_with_a_reason_and_other_jobs_train(memory_bus, tmp_path: Path,
                                                                       digits_data: Path) -> None:
    tampered = await submitted(tmp_path, digits_data, "bad1")
    assert tampered.code is not None
    bundle = tmp_path / code_bundle_key("alice", tampered.code.digest)
    raw = bytearray(bundle.read_bytes())
    raw[len(raw) // 2] ^= 0x01   # same size, one bit changed in the store
    os.chmod(bundle, 0o644)
    bundle.write_bytes(bytes(raw))
    stolen = dataclasses.replace(tampered, job_id="steal1", user="bob")   # bob names alice's bundle
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), cache_dir=str(tmp_path / "cache"))
    try:
        await memory_bus.publish(assign(tampered, 0, budget=20))
        bad = await watch.finished("bad1", 0, timeout_s=120)
        assert bad.status == "failed" and "SHA-256" in bad.reason, bad.reason
        await memory_bus.publish(assign(stolen, 0, budget=20, gpus=(1,)))
        theft = await watch.finished("steal1", 0, timeout_s=120)
        assert theft.status == "failed" and "users/bob/" in theft.reason, theft.reason
        assert not any((tmp_path / "cache").glob("*/tree")), "nothing unverified reached the cache"
        await memory_bus.publish(assign(job("zoo1"), 0, budget=20))   # the agent is up and trains
        fine = await watch.finished("zoo1", 0, timeout_s=180)
        assert (fine.status, fine.steps_round) == ("ok", 20), fine.reason
        assert agent.health()["ok"]
    finally:
        await agent.stop()
        await watch.stop()


async def script_job(root: Path, source: str, job_id: str, *, workers: int = 1) -> JobSpec:
    """The JobSpec of a one-file script (``source``) delivered as alice's code bundle."""
    code = root / job_id
    code.mkdir()
    (code / "train.py").write_text(source)
    store = LocalStore(root)
    await store.start()
    try:
        request = CodeRequest(folder=code, entrypoint="train.py", args=(), hint="resnet", data="", config="")

        async def accept(user_code: UserCode) -> JobSpec:
            return JobSpec(job_id=job_id, user="alice", model="script", dataset="-", batch_size=1, workers=workers,
                           iterations=10_000, code=user_code)

        spec, _ = await deliver(store, request, "alice", accept)
        return spec
    finally:
        await store.stop()


SLOW_TO_START = '''\
import time

import torch

import hadar_sdk

time.sleep(6)   # the script's own set-up (data, a model, a warm-up) before its first SDK call
with hadar_sdk.connect() as run:
    model = torch.nn.Linear(4, 2)
    for rnd in run.rounds():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rnd.restore(model, opt)
        for step in rnd.steps():
            rnd.report(samples=1)
        rnd.save(model, opt)
'''


async def test_a_cold_user_copys_start_up_includes_its_scripts_own_set_up(memory_bus, tmp_path: Path) -> None:
    # CopyFinished.start_s is what a move costs the scheduler (JobState.restart_s): for user
    # code a cold start is the worker, the trainer process and the script's own set-up, up to
    # its first SDK call; a warm round keeps the trainer and pays none of it. (Before, start_s
    # ended when the harness held the start state: 2.1 s here against the script's 6.)
    spec = await script_job(tmp_path, SLOW_TO_START, "slow1")
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), cache_dir=str(tmp_path / "cache"))
    try:
        await memory_bus.publish(assign(spec, 0, budget=20))
        cold = await watch.finished("slow1", 0, timeout_s=120)
        assert (cold.status, cold.steps_round) == ("ok", 20), (cold.reason, cold.log_tail)
        assert not cold.start_warm and cold.start_s is not None and cold.start_s >= 6.0, cold.start_s
        # It reports no loss (the SDK's is optional): its progress still reaches the profiler,
        # loss None. The harness used to write NaN into the worker protocol, which refuses it:
        # the round failed ("Out of range float values are not JSON compliant").
        reports = [e for e in watch.events if isinstance(e, Progress) and e.job_id == "slow1"]
        assert reports and all(p.loss is None and p.samples_per_s > 0 for p in reports)
        await memory_bus.publish(assign(spec, 1, budget=20, start_from=cold.checkpoint))
        warm = await watch.finished("slow1", 1, timeout_s=120)
        assert (warm.status, warm.steps_round) == ("ok", 20), (warm.reason, warm.log_tail)
        assert warm.start_warm and warm.start_s is not None and warm.start_s < 6.0, warm.start_s
    finally:
        await agent.stop()
        await watch.stop()


HANGS_IN_A_COLLECTIVE = '''\
import time

import torch
import torch.distributed as dist

import hadar_sdk

with hadar_sdk.connect() as run:
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 2)
    for rnd in run.rounds():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rnd.restore(model, opt)
        if run.rank == 1:
            print("rank 1 never reaches the collective", flush=True)
            time.sleep(3600)
        for step in rnd.steps():   # rank 0 waits in the step agreement's all_reduce
            rnd.report(samples=1)
        rnd.save(model, opt)
'''


async def test_a_copy_hanging_in_a_collective_ends_at_its_deadline_and_the_agent_goes_on(
        memory_bus, tmp_path: Path) -> None:
    spec = await script_job(tmp_path, HANGS_IN_A_COLLECTIVE, "hang1", workers=2)
    agent, watch = await start_agent(memory_bus, StoreTarget.local(tmp_path), cache_dir=str(tmp_path / "cache"))
    try:
        began = time.monotonic()
        await memory_bus.publish(assign(spec, 0, budget=100, gpus=(0, 1), deadline_s=8))
        hung = await watch.finished("hang1", 0, timeout_s=120)
        assert hung.status == "failed" and "did not end the round" in hung.reason, (hung.status, hung.reason)
        assert time.monotonic() - began < 90, "the copy outlived its deadline by far"
        assert "never reaches the collective" in hung.log_tail, hung.log_tail
        await memory_bus.publish(assign(job("after1", workers=2), 1, budget=20, gpus=(0, 1)))   # the same GPUs
        fine = await watch.finished("after1", 1, timeout_s=180)
        assert (fine.status, fine.steps_round) == ("ok", 20), fine.reason
        assert agent.health()["ok"]
    finally:
        await agent.stop()
        await watch.stop()
