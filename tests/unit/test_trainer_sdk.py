"""The SDK's side of a round, without a harness: a socket pair stands in for it.

Checked: on an emulated GPU (``slowdown`` 3) a fixed number of steps takes about three times
its own work, and a stop cuts the throttling sleep short; ``Round.restore`` says whether a
start state existed (its truth) and whether it held optimizer state; ``connect`` takes its
CPU threads from ``HADAR_THREADS`` and the slowdown from ``HADAR_SLOWDOWN``; ``BatchSampler``
takes a device's name or a ``torch.device``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hadar_sdk
from hadar_sdk import BatchSampler, Restored, state_tensors
from hadar_sdk.run import FD_VARIABLE, START_FILE, Round, RoundOrder, _Channel, _env_slowdown


@pytest.fixture
def channel() -> Iterator[_Channel]:
    ours, theirs = socket.socketpair()
    sdk = _Channel(theirs)
    try:
        yield sdk
    finally:
        sdk.close()
        ours.close()


def order(inbox: Path = Path("/nonexistent"), *, max_steps: int = 10, has_start: bool = False) -> RoundOrder:
    return RoundOrder(round=1, copy=0, rank=0, world_size=1, seed=7, start_steps=0, max_steps=max_steps,
                      seconds=60.0, has_start=has_start, inbox=inbox, outbox=inbox, data=None)


def timed_steps(rnd: Round, work_s: float) -> tuple[int, float, float]:
    """(steps, elapsed, work) of a loop whose every step works ``work_s``."""
    began, work, steps = time.monotonic(), 0.0, 0
    for _ in rnd.steps():
        step_began = time.monotonic()
        time.sleep(work_s)
        work += time.monotonic() - step_began
        steps += 1
    return steps, time.monotonic() - began, work


def test_a_slowdown_makes_the_steps_take_that_many_times_their_work(channel: _Channel) -> None:
    steps, elapsed, work = timed_steps(Round(channel, order(max_steps=10), slowdown=3.0), 0.02)
    assert steps == 10 and 2.5 < elapsed / work < 3.6, (elapsed, work)
    steps, elapsed, work = timed_steps(Round(channel, order(max_steps=10)), 0.02)
    assert steps == 10 and elapsed / work < 1.3, (elapsed, work)


def test_a_stop_cuts_the_throttling_sleep_short(channel: _Channel) -> None:
    rnd = Round(channel, order(max_steps=100), slowdown=1000.0)   # each 10 ms step owes 10 s of sleep
    threading.Timer(0.3, channel.stop_requested.set).start()
    steps, elapsed, _ = timed_steps(rnd, 0.01)
    assert steps == 1 and elapsed < 3.0


def test_restore_says_whether_there_was_a_start_and_optimizer_state(channel: _Channel, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    first = Round(channel, order(tmp_path)).restore(model, opt)
    assert first == Restored(start=False, optimizer=False) and not first
    save_file(state_tensors(nn.Linear(3, 2), None), str(tmp_path / START_FILE))
    weights_only = Round(channel, order(tmp_path, has_start=True)).restore(model, opt)
    assert weights_only and (weights_only.start, weights_only.optimizer) == (True, False)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    save_file(state_tensors(model, opt), str(tmp_path / START_FILE))
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    full = Round(channel, order(tmp_path, has_start=True)).restore(fresh, fresh_opt)
    assert full and full.optimizer and fresh_opt.state[fresh.weight]["exp_avg"].shape == (2, 3)
    assert Round(channel, order(tmp_path, has_start=True)).restore(nn.Linear(3, 2)).optimizer   # held, not loaded


def test_connect_takes_the_threads_and_the_slowdown(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = socket.socketpair()
    previous = torch.get_num_threads()
    monkeypatch.setenv(FD_VARIABLE, str(theirs.fileno()))
    monkeypatch.setenv("HADAR_THREADS", "3")
    monkeypatch.setenv("HADAR_SLOWDOWN", "2.5")
    try:
        with hadar_sdk.connect() as run:
            assert torch.get_num_threads() == 3 and (run.threads, run.slowdown) == (3, 2.5)
            assert b'"op":"hello"' in ours.recv(4096)
        for bad in ("0.5", "nan", "inf", "fast", ""):
            monkeypatch.setenv("HADAR_SLOWDOWN", bad)
            assert _env_slowdown() == 1.0, bad
    finally:
        torch.set_num_threads(previous)
        ours.close()


def test_a_batch_sampler_takes_a_device_or_its_name() -> None:
    by_name, by_device = BatchSampler(10, 4, (7, 0, 0), "cpu"), BatchSampler(10, 4, (7, 0, 0), torch.device("cpu"))
    assert by_name.device == by_device.device == torch.device("cpu")
    assert torch.equal(by_name.indices(3), by_device.indices(3)) and by_name.indices(3).device.type == "cpu"
