"""Checkpoints: safetensors only, exact round trips of weights and optimizer state, clear errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.agent.worker.checkpoint import (
    OPTIM_PREFIX,
    CheckpointError,
    CheckpointMeta,
    read_checkpoint,
    read_total_steps,
    restore,
    save_checkpoint,
    state_tensors,
)
from shared.domain.model_meta import ModelMetadata
from shared.wire.events import CopyWeight
from shared.zoo import (
    build_model,
    dataset_info,
    load_dataset,
    loss_function,
    make_optimizer,
)

META = CheckpointMeta(job="j1", round=3, copy=1, steps=5, total_steps=105, gpu_type="v100", model="resnet",
                      dataset="digits", metric_name="accuracy", metric_value=0.875)


@pytest.fixture(autouse=True)
def one_thread() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def trained(optimizer: str, steps: int = 3, model: str = "resnet", seed: int = 0
            ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    data = load_dataset("digits")
    net = build_model(model, data.info, seed=seed)
    opt = make_optimizer(optimizer, net.parameters(), 0.05)
    loss_fn = loss_function("classification")
    for step in range(steps):
        x, y = data.train_x[step * 16:(step + 1) * 16], data.train_y[step * 16:(step + 1) * 16]
        loss = loss_fn(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, opt


def one_step(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    data = load_dataset("digits")
    loss = loss_function("classification")(net(data.train_x[100:132]), data.train_y[100:132])
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_round_trip_continues_exactly(tmp_path: Path, optimizer: str) -> None:
    net, opt = trained(optimizer)
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, net, opt, META)
    tensors, meta = read_checkpoint(path)
    assert CheckpointMeta.from_metadata(meta) == META
    assert any(k.startswith(OPTIM_PREFIX) for k in tensors)
    fresh, fresh_opt = trained(optimizer, steps=0, seed=99)
    assert restore(fresh, fresh_opt, tensors) is True
    for name, value in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    one_step(net, opt)
    one_step(fresh, fresh_opt)
    for name, value in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_file_is_plain_safetensors(tmp_path: Path) -> None:
    net, opt = trained("sgd")
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, net, opt, META)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    assert header["__metadata__"]["format"] == "hadar-checkpoint-1"
    assert header["__metadata__"]["total_steps"] == "105"
    assert all(v["dtype"] in ("F32", "I64") for k, v in header.items() if k != "__metadata__")


def test_saved_tensors_are_copies(tmp_path: Path) -> None:
    net, opt = trained("sgd", steps=1)
    tensors = state_tensors(net, opt)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    assert not any(torch.equal(tensors[n], p) for n, p in net.named_parameters())


def test_weights_only_file_starts_a_fresh_optimizer(tmp_path: Path) -> None:
    """What the tracker writes: weights and total_steps, no optimizer state."""
    net, _ = trained("sgd")
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path),
              metadata=ModelMetadata(job="j1", round=2, total_steps=40, mode="steps",
                                     copies=(CopyWeight(copy=0, steps=10, weight=0.5),
                                             CopyWeight(copy=1, steps=10, weight=0.5))).to_metadata())
    tensors, meta = read_checkpoint(path)
    fresh, fresh_opt = trained("sgd", steps=0, seed=5)
    assert restore(fresh, fresh_opt, tensors) is False
    assert read_total_steps(meta) == 40
    assert not fresh_opt.state


@pytest.mark.parametrize("meta", [{}, {"total_steps": "x"}, {"total_steps": "-1"}])
def test_total_steps_must_be_a_count(meta: dict[str, str]) -> None:
    with pytest.raises(CheckpointError, match="total_steps"):
        read_total_steps(meta)


def test_metadata_missing_a_field_is_an_error() -> None:
    meta = META.to_metadata()
    del meta["copy"]
    with pytest.raises(CheckpointError, match="copy"):
        CheckpointMeta.from_metadata(meta)


def test_garbage_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x80\x04garbage that might be a pickle")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_checkpoint(path)


def _mismatch(tensors: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    tensors = dict(tensors)
    name = next(k for k in tensors if not k.startswith(OPTIM_PREFIX))
    if kind == "missing":
        del tensors[name]
    elif kind == "extra":
        tensors["nope.weight"] = torch.zeros(2)
    elif kind == "shape":
        tensors[name] = torch.zeros(3, 3)
    elif kind == "dtype":
        tensors[name] = tensors[name].double()
    elif kind == "optim-index":
        tensors[f"{OPTIM_PREFIX}999.momentum_buffer"] = torch.zeros(1)
    elif kind == "optim-shape":
        key = next(k for k in tensors if k.startswith(OPTIM_PREFIX))
        tensors[key] = torch.zeros(7, 7)
    return tensors


@pytest.mark.parametrize("kind", ["missing", "extra", "shape", "dtype", "optim-index", "optim-shape"])
def test_checkpoint_that_does_not_fit_is_rejected(kind: str) -> None:
    net, opt = trained("sgd")
    tensors = _mismatch(state_tensors(net, opt), kind)
    fresh, fresh_opt = trained("sgd", steps=0)
    with pytest.raises(CheckpointError):
        restore(fresh, fresh_opt, tensors)


def test_a_different_model_does_not_load() -> None:
    net, opt = trained("sgd")
    other = build_model("resnet-w16", dataset_info("digits"), seed=0)
    with pytest.raises(CheckpointError, match="checkpoint tensor"):
        restore(other, None, state_tensors(net, opt))
