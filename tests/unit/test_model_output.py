"""What the tracker stores for a round (issue 17 item 3): a weights-only model that loads
strictly into the module its metadata names, its optimizer state beside it for resuming,
and the model's held-out metric. Real zoo models and optimizers, real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from services.agent.worker.checkpoint import (
    OPTIM_PREFIX,
    CheckpointError,
    CheckpointMeta,
    restore,
    save_checkpoint,
    state_tensors,
    with_optimizer_state,
)
from services.tracker.averaging.consolidate import Replica, weigh_replicas
from services.tracker.averaging.safetensors_format import FileRangeReader
from services.tracker.model_files import (
    OPTIM_FORMAT,
    held_out_metric,
    write_model_files,
)
from shared.domain.model_meta import ModelMetadata
from shared.errors import UsageError
from shared.wire.records import Hyperparameters, JobSpec
from shared.zoo import (
    build_from_metadata,
    build_model,
    evaluate,
    load_dataset,
    loss_function,
    make_optimizer,
)

SPEC = JobSpec(job_id="j1", user="alice", model="resnet-w8-d1", dataset="digits", batch_size=16, workers=2,
               iterations=1000, hyper=Hyperparameters(optimizer="adam", lr=0.01, seed=3))


@pytest.fixture(autouse=True)
def one_thread() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def checkpoint(tmp_path: Path, copy: int, steps: int, *, poison_optim: bool = False) -> Path:
    data = load_dataset(SPEC.dataset)
    net = build_model(SPEC.model, data.info, seed=SPEC.hyper.seed)
    opt = make_optimizer(SPEC.hyper.optimizer, net.parameters(), SPEC.hyper.lr)
    loss_fn = loss_function(data.info.task)
    for step in range(steps):
        lo = (copy * 50 + step) * 16
        loss = loss_fn(net(data.train_x[lo:lo + 16]), data.train_y[lo:lo + 16])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if poison_optim:
        next(iter(opt.state.values()))["exp_avg"].fill_(float("nan"))
    path = tmp_path / f"c{copy}.safetensors"
    save_checkpoint(path, net, opt, CheckpointMeta(job="j1", round=0, copy=copy, steps=steps, total_steps=steps,
                                                   gpu_type="V100", model=SPEC.model, dataset=SPEC.dataset))
    return path


def outputs_of(tmp_path: Path, paths: list[tuple[Path, int]], prior: int = 0):
    readers = [FileRangeReader(p) for p, _ in paths]
    replicas = [Replica(copy=i, steps=s, reader=r, workers=1) for i, (r, (_, s)) in enumerate(zip(readers, paths))]
    weighing = weigh_replicas(replicas, prior_worker_steps=prior, job_workers=SPEC.workers,
                              limit_worker_steps=SPEC.workers * SPEC.iterations)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return write_model_files(weighing, out, job_id="j1", round_=0, missing=(), spec=SPEC, chunk_bytes=4096)


def test_the_model_file_is_weights_only_and_loads_strictly_into_the_module_its_metadata_names(
        tmp_path: Path) -> None:
    result = outputs_of(tmp_path, [(checkpoint(tmp_path, 0, 3), 30), (checkpoint(tmp_path, 1, 2), 10)], prior=60)
    # The README's three lines, verbatim:
    model = build_from_metadata(safe_open(str(result.model_path), "pt").metadata())
    model.load_state_dict(load_file(str(result.model_path)), strict=True)
    assert not any(name.startswith(OPTIM_PREFIX) for name in load_file(str(result.model_path)))
    meta = ModelMetadata.from_metadata(safe_open(str(result.model_path), "pt").metadata())
    assert meta == result.meta and meta.description is not None
    d = meta.description
    assert (d.model, d.dataset, d.width, d.depth) == ("resnet-w8-d1", "digits", 8, 1)
    assert d.library.startswith("hadar ")
    assert json.loads(d.zoo) == {"family": "resnet", "width": 8, "depth": 1, "task": "classification",
                                 "input_shape": [1, 8, 8], "n_outputs": 10}
    # samples: the job's worker-steps (60 before + 30 + 10 on one worker each) x per-worker batch 16
    assert meta.total_steps == 50 and d.samples == 100 * 16


def test_the_optimizer_state_beside_it_resumes_a_copy_exactly_as_the_combined_file_did(tmp_path: Path) -> None:
    paths = [(checkpoint(tmp_path, 0, 3), 30), (checkpoint(tmp_path, 1, 2), 10)]
    result = outputs_of(tmp_path, paths)
    assert result.optim_path is not None
    with safe_open(str(result.optim_path), "pt") as f:
        assert f.metadata()["format"] == OPTIM_FORMAT and all(k.startswith(OPTIM_PREFIX) for k in f.keys())
        optim = {k: f.get_tensor(k) for k in f.keys()}
    # The same average written the old way (one file, weights and optimizer state together):
    readers = [FileRangeReader(p) for p, _ in paths]
    weighing = weigh_replicas([Replica(copy=i, steps=s, reader=r) for i, (r, (_, s)) in
                               enumerate(zip(readers, paths))], job_workers=SPEC.workers)
    from services.tracker.averaging.consolidate import write_consolidated
    with open(tmp_path / "combined.safetensors", "wb") as out:
        write_consolidated(weighing, out, chunk_bytes=4096)
    combined = load_file(str(tmp_path / "combined.safetensors"))
    split = with_optimizer_state(load_file(str(result.model_path)), optim)
    assert split.keys() == combined.keys()
    assert all(torch.equal(split[k], combined[k]) for k in combined)
    data = load_dataset(SPEC.dataset)
    net = build_model(SPEC.model, data.info, seed=0)
    opt = make_optimizer(SPEC.hyper.optimizer, net.parameters(), SPEC.hyper.lr)
    assert restore(net, opt, split) is True
    assert set(state_tensors(net, opt)) == set(combined)


def test_a_replica_whose_optimizer_state_is_not_finite_leaves_both_files(tmp_path: Path) -> None:
    paths = [(checkpoint(tmp_path, 0, 3), 30), (checkpoint(tmp_path, 1, 2, poison_optim=True), 10)]
    result = outputs_of(tmp_path, paths)
    assert [c.copy for c in result.meta.copies] == [0] and [r.copy for r in result.meta.rejected] == [1]
    only = load_file(str(paths[0][0]))
    model = load_file(str(result.model_path))
    assert all(torch.equal(model[k], only[k]) for k in model)   # one replica: its own tensors back
    assert ModelMetadata.from_metadata(safe_open(str(result.model_path), "pt").metadata()) == result.meta


def test_optimizer_state_that_is_not_named_so_is_refused() -> None:
    with pytest.raises(CheckpointError, match="not named"):
        with_optimizer_state({"w": torch.zeros(1)}, {"w2": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="already holds"):
        with_optimizer_state({"optim.0.step": torch.zeros(1)}, {})


def test_the_held_out_metric_is_the_zoo_evaluation_of_the_written_model(tmp_path: Path) -> None:
    result = outputs_of(tmp_path, [(checkpoint(tmp_path, 0, 4), 40)])
    metric, why = held_out_metric(result.model_path, SPEC)
    data = load_dataset(SPEC.dataset)
    net = build_model(SPEC.model, data.info, seed=0)
    net.load_state_dict(load_file(str(result.model_path)))
    assert why == "" and metric == ("accuracy", evaluate(net, data).value)
    assert held_out_metric(result.model_path, None) == (None, "job spec unknown")
    other = JobSpec(**{**SPEC.__dict__, "model": "resnet-w16-d1"})
    metric, why = held_out_metric(result.model_path, other)
    assert metric is None and "size mismatch" in why


def test_build_from_metadata_refuses_a_file_that_does_not_say_what_it_is() -> None:
    with pytest.raises(UsageError, match="names no model"):
        build_from_metadata({"job": "j1"})
    with pytest.raises(UsageError, match="cannot build"):
        build_from_metadata({"model": "nosuch", "dataset": "digits", "width": "1", "depth": "1", "zoo": "{}",
                             "library": "hadar 0.1.0", "samples": "0"})
