"""benchmarks/model_quality.py at a tiny size: its output, and that its rounds mean what it says."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors import safe_open

from shared.domain.layout import checkpoint_key


def _load_benchmark() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "model_quality.py"
    spec = importlib.util.spec_from_file_location("bench_model_quality", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


mq = _load_benchmark()
REGRESSION = next(t for t in mq.TASKS if t.key == "regression")


def _training(steps: int, rounds: int) -> Any:
    return mq.Training(batch_size=16, optimizer="sgd", lr=0.05, steps=steps, rounds=rounds, threads=1)


def _file(root: Path, key: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(root / key), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def test_last_line_is_the_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert mq.main(["--steps", "8", "--rounds", "2", "--copies", "2", "--seeds", "1", "--batch-size", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cls, reg = result["classification"], result["regression"]
    assert 0.0 <= cls["single_acc"] <= 1.0 and 0.0 <= cls["forked_acc"] <= 1.0
    assert reg["single_mse"] > 0.0 and reg["forked_mse"] > 0.0
    assert result["settings"]["copies"] == 2


def test_steps_not_divisible_by_copies_times_rounds_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exit_info:
        mq.main(["--steps", "10", "--rounds", "3", "--copies", "4"])
    assert exit_info.value.code == 2


def test_single_copy_in_rounds_equals_one_uninterrupted_run(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    single = mq.Arm(name="single", copies=1)
    one = mq.train_job(tmp_path / "a", REGRESSION, single, 3, _training(12, 1), scratch)
    three = mq.train_job(tmp_path / "b", REGRESSION, single, 3, _training(12, 3), scratch)
    tensors_one, meta_one = _file(tmp_path / "a", one)
    tensors_three, meta_three = _file(tmp_path / "b", three)
    assert meta_one["total_steps"] == meta_three["total_steps"] == "12"
    assert tensors_one.keys() == tensors_three.keys()
    for name in tensors_one:
        assert torch.equal(tensors_one[name], tensors_three[name]), name


def test_forked_round_is_the_mean_of_its_copies_which_differ(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    root = tmp_path / "store"
    key = mq.train_job(root, REGRESSION, mq.Arm(name="forked", copies=2), 0, _training(8, 2), scratch)
    model, meta = _file(root, key)
    assert meta["total_steps"] == "8" and meta["round"] == "1"
    job_id = key.split("/")[1]
    first, _ = _file(root, checkpoint_key(job_id, 1, 0, node=mq.NODE))
    second, _ = _file(root, checkpoint_key(job_id, 1, 1, node=mq.NODE))
    assert any(not torch.equal(first[n], second[n]) for n in first)   # different data orders
    for name, value in model.items():
        torch.testing.assert_close(value, (first[name] + second[name]) / 2, rtol=1e-6, atol=1e-7)
