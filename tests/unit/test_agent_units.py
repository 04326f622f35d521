"""Pure parts of the agent: batch order, training loop stops, emulation, worker protocol, discovery."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.agent.daemon.discovery import (
    NodeDevices,
    cpu_devices,
    emulated_devices,
    gpu_type_of,
)
from services.agent.daemon.emulation import parse_emulation
from services.agent.daemon.process import WorkerPool, WorkerSlots
from services.agent.protocol import (
    StoreTarget,
    WorkerSpec,
    parse_worker_line,
    worker_line,
)
from services.agent.worker.session import state_digest
from services.agent.worker.training import (
    BatchSampler,
    DivergedError,
    StopCode,
    TrainingLoop,
)
from shared.domain.gpus import CATALOG, emulation_slowdown
from shared.store.settings import S3Settings
from shared.zoo import build_model, load_dataset, make_optimizer

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50), batch=st.integers(1, 70), step=st.integers(0, 200))
def test_batches_walk_a_permutation_per_epoch(n: int, batch: int, step: int) -> None:
    sampler = BatchSampler(n, batch, (3, 1, 0), CPU)
    got = sampler.indices(step)
    assert got.shape == (batch,) and int(got.min()) >= 0 and int(got.max()) < n
    # The stream is the concatenation of per-epoch permutations, whatever the step size.
    epochs = [BatchSampler(n, 1, (3, 1, 0), CPU)._perm(e) for e in range((step + 1) * batch // n + 2)]
    stream = torch.cat(epochs)
    assert torch.equal(got, stream[step * batch:(step + 1) * batch])
    assert sorted(epochs[0].tolist()) == list(range(n))


def test_streams_differ_by_seed_copy_and_rank_and_repeat_exactly() -> None:
    base = BatchSampler(1000, 32, (1, 0, 0), CPU).indices(5)
    assert torch.equal(base, BatchSampler(1000, 32, (1, 0, 0), CPU).indices(5))
    for other in ((2, 0, 0), (1, 1, 0), (1, 0, 1)):
        assert not torch.equal(base, BatchSampler(1000, 32, other, CPU).indices(5))


def _loop(model: str = "autoencoder", lr: float = 0.01, **kw: object) -> TrainingLoop:
    data = load_dataset("synthetic-ratings")
    net = build_model(model, data.info, seed=0)
    return TrainingLoop(model=net, optimizer=make_optimizer("sgd", net.parameters(), lr), data=data,
                        sampler=BatchSampler(len(data.train_x), 16, (0, 0, 0), CPU), device=CPU,
                        **kw)  # type: ignore[arg-type]


def test_loop_stops_at_budget_and_counts_from_the_start() -> None:
    result = _loop().run(start_round_steps=4, start_total=50, budget=10, deadline=time.time() + 60)
    assert (result.stop, result.steps_round, result.steps_total) == (StopCode.BUDGET, 10, 56)


def test_loop_stops_at_deadline_and_when_preempted() -> None:
    now = [100.0]
    loop = _loop(clock=lambda: now[0])
    seen: list[int] = []

    def progress(steps_round: int, *_: float) -> None:
        seen.append(steps_round)
        now[0] = 200.0   # the round ends during the first report

    loop.progress_s = 0.0
    result = loop.run(start_round_steps=0, start_total=0, budget=10**9, deadline=150.0, on_progress=progress)
    assert result.stop == StopCode.DEADLINE and result.steps_round == 1 and seen == [1]
    preempted = _loop()
    preempted.preempted = True
    result = preempted.run(start_round_steps=0, start_total=7, budget=100, deadline=time.time() + 60)
    assert (result.stop, result.steps_round, result.steps_total) == (StopCode.PREEMPTED, 0, 7)


def test_emulated_slowdown_sleeps_in_proportion_to_step_time() -> None:
    slept: list[float] = []
    result = _loop(slowdown=4.0, sleep=slept.append).run(start_round_steps=0, start_total=0, budget=30,
                                                          deadline=time.time() + 60)
    # The sleeps (not taken here) are 3x the time the steps themselves took.
    assert result.steps_round == 30 and slept and min(slept) >= 0.001
    assert 2.4 * result.train_s <= sum(slept) <= 3.0 * result.train_s
    unthrottled: list[float] = []
    _loop(sleep=unthrottled.append).run(start_round_steps=0, start_total=0, budget=5, deadline=time.time() + 60)
    assert unthrottled == []


def test_diverging_loss_fails_the_copy() -> None:
    loop = _loop(lr=1e6, progress_s=0.0)
    with pytest.raises(DivergedError, match="diverged"):
        loop.run(start_round_steps=0, start_total=0, budget=200, deadline=time.time() + 60,
                 on_progress=lambda *_: None)


def test_emulation_spec_and_speeds() -> None:
    assert parse_emulation("v100:2, K80:1") == (("v100", 2), ("k80", 1))
    for bad in ("v100", "v100:0", "v100:x", "gtx480:1", "cpu:1"):
        with pytest.raises(ValueError):
            parse_emulation(bad)
    fastest = max(s.fp32_tflops for k, s in CATALOG.items() if k != "cpu")
    assert emulation_slowdown("h100") == pytest.approx(fastest / CATALOG["h100"].fp32_tflops)
    assert emulation_slowdown("k80") == pytest.approx(fastest / CATALOG["k80"].fp32_tflops)
    assert emulation_slowdown("k80") > emulation_slowdown("t4") > emulation_slowdown("v100") >= 1.0
    assert emulation_slowdown("h100", reference="v100") == 1.0   # never faster than the CPU itself
    devices = emulated_devices((("v100", 2), ("k80", 1)))
    assert [(g.index, g.type) for g in devices.gpus] == [(0, "v100"), (1, "v100"), (2, "k80")]
    assert devices.emulated and devices.slowdown[2] == emulation_slowdown("k80") and devices.worker_device == "cpu"


def test_devices_round_trip_as_json() -> None:
    for devices in (cpu_devices(2), emulated_devices((("t4", 1),)),
                    NodeDevices(kind="cuda", gpus=cpu_devices(1).gpus, visible={0: "3"})):
        assert NodeDevices.from_json(devices.to_json()) == devices


def test_gpu_names_map_to_catalog_types() -> None:
    assert gpu_type_of("NVIDIA H200") == "h200"
    assert gpu_type_of("Tesla V100-SXM2-16GB") == "v100"
    assert gpu_type_of("NVIDIA Quantum Widget 9000 Ultra Extreme Edition") == "nvidia-quantum-widget-9000-ultra"


def test_worker_spec_round_trips_without_leaking_the_secret_in_repr() -> None:
    s3 = S3Settings(endpoint="http://127.0.0.1:9000", access_key="ak", secret_key="very-secret")
    spec = WorkerSpec(job_id="j", round=1, copy=0, node_id="n", gpu_type="v100", model="resnet", dataset="digits",
                      batch_size=8, optimizer="sgd", lr=0.1, seed=1, rank=1, world_size=2,
                      rendezvous="127.0.0.1:1234", device="cpu", step_budget=5, deadline=1.0, start_from=None,
                      checkpoint="checkpoints/j/1/n/0.safetensors", store=StoreTarget.remote(s3),
                      env={"CUDA_VISIBLE_DEVICES": ""}, local_gpus=(3,), local_ranks=(1,), peers=("m", "n"))
    assert WorkerSpec.from_json(spec.to_json()) == spec   # the layout comes back as tuples (warm keys compare it)
    assert "very-secret" not in repr(spec)
    with pytest.raises(ValueError, match="rendezvous"):
        WorkerSpec.from_json(spec.to_json().replace('"127.0.0.1:1234"', "null"))


def test_state_digest_is_equal_exactly_when_names_dtypes_shapes_and_bytes_are() -> None:
    state = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a.steps": torch.tensor(3)}
    same = state_digest({k: v.clone() for k, v in reversed(list(state.items()))})
    assert state_digest(state) == same
    nudged = state["a.weight"].clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(100.0))
    for other in ({**state, "a.weight": nudged}, {**state, "a.weight": state["a.weight"].double()},
                  {**state, "a.weight": state["a.weight"].reshape(3, 2)}, {"b.weight": state["a.weight"],
                                                                          "a.steps": state["a.steps"]}):
        assert state_digest(other) != same


async def test_a_copy_whose_second_rank_cannot_start_leaves_no_slot_taken(tmp_path: Path) -> None:
    base = WorkerSpec(job_id="j", round=1, copy=0, node_id="n", gpu_type="cpu", model="resnet", dataset="digits",
                      batch_size=8, optimizer="sgd", lr=0.1, seed=1, rank=0, world_size=2,
                      rendezvous="127.0.0.1:1234", device="cpu", step_budget=5, deadline=1.0, start_from=None,
                      checkpoint="checkpoints/j/1/n/0.safetensors", store=StoreTarget.local(tmp_path),
                      local_gpus=(0, 1), local_ranks=(0, 1), peers=("n", "n"))
    sleeper = tmp_path / "python"   # a process that starts (the first rank's spare) and does nothing
    sleeper.write_text("#!/bin/sh\nexec sleep 60\n")
    sleeper.chmod(0o755)
    pool = WorkerPool(python=str(sleeper), spares=1)
    pool.start()
    for _ in range(200):
        if pool._ready:
            break
        await asyncio.sleep(0.05)
    spare = pool._ready[0]
    pool.python = str(tmp_path / "missing")   # every later start fails
    slots = WorkerSlots(pool)
    specs = [base, dataclasses.replace(base, rank=1)]
    try:
        for _ in range(2):   # the second try meets empty slots again, not SlotBusy
            with pytest.raises(OSError):
                await slots.take([0, 1], specs)
            assert [slots.slot(g).state for g in (0, 1)] == ["empty", "empty"]
            assert slots.process(0) is None and slots.process(1) is None
        assert await spare.wait() == -signal.SIGKILL   # the first rank's process did not linger
    finally:
        await pool.close()


def test_protocol_lines() -> None:
    line = worker_line("progress", steps_round=3, loss=0.5)
    assert parse_worker_line(line) == {"event": "progress", "steps_round": 3, "loss": 0.5}
    for noise in ("", "hello", "[1]", '{"event": "other"}', b"\xff\xfe"):
        assert parse_worker_line(noise) is None
    with pytest.raises(ValueError):
        worker_line("progress", loss=float("nan"))
