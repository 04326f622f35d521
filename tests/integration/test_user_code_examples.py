"""The user-code examples (examples/user-code/) through the real trainer harness.

For each example: ``export.py`` writes its dataset into ``tmp_path``, then one sandboxed
trainer process (:class:`~services.agent.usercode.trainer.Trainer`, Landlock on) runs
``train.py`` for three rounds, each starting from the state the previous one handed back, as
the tracker would after averaging a single copy. Checked: every round is accepted, the process
stays the same (warm), steps and samples are what was asked, the state's tensor names and
shapes never change, the held-out figure reaches what the example's README states (with
margin), and the final state loads strictly into ``model.build(config)``. For digits also:
two rounds of k steps from a state end in exactly the state one round of 2k steps does.

The trainer gets ``OMP_NUM_THREADS=1`` (through ``TrainerLaunch.passthrough``): these models
are tiny, and on a loaded machine torch's default of one thread per core makes them several
times slower, not faster.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from services.agent.usercode.trainer import RoundRequest, RoundResult, Trainer, TrainerLaunch, TrainerLimits

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "user-code"
OPTIM_PREFIX = "optim."
SEED, BATCH = 7, 32
ROUND_SECONDS = 240.0   # the deadline of one round: far above what it needs, even on loaded cores

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("requires_landlock")]


def export(example: str, out: Path) -> Path:
    subprocess.run([sys.executable, str(EXAMPLES / example / "export.py"), str(out)], check=True,
                   capture_output=True, timeout=120)
    return out


def model_module(example: str) -> ModuleType:
    """The example's ``model.py`` (under a name of its own: both examples have one)."""
    spec = importlib.util.spec_from_file_location(f"user_code_{example.replace('-', '_')}_model",
                                                  EXAMPLES / example / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def trainer(example: str, tmp_path: Path, data: Path, config: Mapping[str, object],
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Trainer]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launch = TrainerLaunch(code_dir=EXAMPLES / example, entrypoint="train.py", scratch=tmp_path / "scratch",
                           seed=SEED, batch_size=BATCH, config=json.dumps(config), data_dir=data,
                           passthrough=("OMP_NUM_THREADS",))
    harness = Trainer(launch, TrainerLimits(hello_s=120, stop_grace_s=30))
    harness.start()
    try:
        yield harness
    finally:
        harness.close()


def run_round(harness: Trainer, number: int, start_steps: int, steps: int,
              start: dict[str, torch.Tensor] | None) -> RoundResult:
    result = harness.run_round(RoundRequest(round=number, copy=0, start_steps=start_steps, max_steps=steps,
                                            seconds=ROUND_SECONDS, max_samples_per_step=BATCH, start=start))
    assert result.ok, f"round {number}: {result.reason}\n{harness.log_tail[-2000:]}"
    assert (result.steps, result.samples) == (steps, steps * BATCH), f"round {number}: {result}"
    assert not result.stopped
    assert result.tensors is not None
    return result


def metric(result: RoundResult, name: str, of: str) -> float | None:
    values = [value for n, o, value in result.metrics if (n, o) == (name, of)]
    assert len(values) <= 1, result.metrics
    return values[0] if values else None


def specs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def three_rounds(harness: Trainer, budgets: tuple[int, ...], name: str) -> list[RoundResult]:
    """Rounds from no state, then each from the last one's tensors; the checks common to all."""
    results: list[RoundResult] = []
    start, done, pid = None, 0, harness.pid
    for number, steps in enumerate(budgets):
        began = time.monotonic()
        result = run_round(harness, number, done, steps, start)
        print(f"round {number}: {steps} steps in {time.monotonic() - began:.1f} s, loss {result.loss:.3f}, "
              f"metrics {result.metrics}")
        assert harness.pid == pid, "the trainer process changed between rounds (not warm)"
        assert result.loss is not None and math.isfinite(result.loss)
        if start is None:
            assert metric(result, name, "start") is None   # no start state: the seeded model, not evaluated
        else:
            assert specs(result.tensors) == specs(start)   # type: ignore[arg-type]
            # The start figure is of exactly the weights the previous round ended with.
            assert metric(result, name, "start") == pytest.approx(metric(results[-1], name, "final"), abs=1e-6)
        assert metric(result, name, "final") is not None
        results.append(result)
        start, done = result.tensors, done + steps
    assert any(k.startswith(OPTIM_PREFIX) for k in start)   # type: ignore[union-attr]
    return results


def weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if not k.startswith(OPTIM_PREFIX)}


# Digits: 400 steps of batch 32 (the job file's iterations) in 3 rounds. Measured held-out
# accuracy 0.97 (seed 7); the README states >= 0.95, the test asks 0.93.
DIGITS_CONFIG = {"lr": 0.05, "total_steps": 400, "channels": 16}
DIGITS_ROUNDS = (134, 133, 133)
DIGITS_ACCURACY = 0.93


def test_digits_trains_over_warm_rounds_and_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = export("digits", tmp_path / "data")
    test_x, test_y = np.load(data / "test-images.npy"), np.load(data / "test-labels.npy")
    assert test_x.shape[1:] == (1, 8, 8) and test_x.dtype == np.float32 and test_y.dtype == np.int64
    assert len(test_y) + len(np.load(data / "train-labels.npy")) == 1797
    with trainer("digits", tmp_path, data, DIGITS_CONFIG, monkeypatch) as harness:
        results = three_rounds(harness, DIGITS_ROUNDS, "accuracy")
        final = results[-1]
        accuracy = metric(final, "accuracy", "final")
        assert accuracy is not None and accuracy >= DIGITS_ACCURACY, final.metrics

        # Exact resume: from the state after round 0, k + k steps == 2k steps, bit for bit
        # (weights, BatchNorm running statistics and counters, momentum buffers).
        state, at, k, pid = results[0].tensors, DIGITS_ROUNDS[0], 25, harness.pid
        first = run_round(harness, 3, at, k, state)
        split = run_round(harness, 4, at + k, k, first.tensors)
        whole = run_round(harness, 5, at, 2 * k, state)
        assert harness.pid == pid
        assert split.tensors is not None and whole.tensors is not None
        assert specs(split.tensors) == specs(whole.tensors)
        differ = [name for name in whole.tensors if not torch.equal(split.tensors[name], whole.tensors[name])]
        assert not differ, f"k + k steps differ from 2k steps in {differ}"
        assert not torch.equal(whole.tensors["0.weight"], state["0.weight"])   # type: ignore[index]

    # The final model loads strictly into model.build(config), and its accuracy is the one reported.
    module = model_module("digits")
    net = module.build(DIGITS_CONFIG)
    net.load_state_dict(weights(final.tensors), strict=True)   # type: ignore[arg-type]
    net.eval()
    with torch.no_grad():
        predicted = net(torch.from_numpy(test_x)).argmax(dim=1).numpy()
    assert float((predicted == test_y).mean()) == pytest.approx(accuracy, abs=1e-9)


# tiny-lm: 300 steps of 32 windows of 64 bytes (half the job file's 600) in 3 rounds, to keep
# the test short. Measured held-out bits per byte: 2.73 (seed 7; 2.51 after 600 steps); the
# README states <= 3.0 after 300 steps, the test asks 3.3 (8.0 is a uniform guess over bytes).
TINY_LM_CONFIG = {"lr": 0.01, "context": 64, "total_steps": 300}
TINY_LM_ROUNDS = (100, 100, 100)
TINY_LM_BITS_PER_BYTE = 3.3


def test_tiny_lm_trains_over_warm_rounds_on_streamed_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = export("tiny-lm", tmp_path / "data")
    train_files, test_files = sorted((data / "train").glob("*.txt")), sorted((data / "test").glob("*.txt"))
    assert (len(train_files), len(test_files)) == (300, 30)
    assert not {f.name for f in train_files} & {f.name for f in test_files}
    assert 3e6 < sum(f.stat().st_size for f in train_files + test_files) < 12e6
    with trainer("tiny-lm", tmp_path, data, TINY_LM_CONFIG, monkeypatch) as harness:
        results = three_rounds(harness, TINY_LM_ROUNDS, "bits_per_byte")
    start_bpb = metric(results[1], "bits_per_byte", "start")
    final_bpb = metric(results[-1], "bits_per_byte", "final")
    assert start_bpb is not None and final_bpb is not None
    assert final_bpb <= TINY_LM_BITS_PER_BYTE, results[-1].metrics
    assert final_bpb < start_bpb   # rounds 1 and 2 kept improving on round 0's model

    net = model_module("tiny-lm").build(TINY_LM_CONFIG)
    net.load_state_dict(weights(results[-1].tensors), strict=True)   # type: ignore[arg-type]
    window = torch.frombuffer(bytearray(test_files[0].read_bytes()[:65]), dtype=torch.uint8).long()[None]
    with torch.no_grad():
        assert net(window[:, :-1]).shape == (1, 64, 256)
