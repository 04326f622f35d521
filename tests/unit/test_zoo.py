"""The model zoo: names and validation, deterministic data, models that learn, counted figures."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain import gpus
from shared.wire.events import Hyperparameters, JobSpec
from shared.zoo import (
    DATASETS,
    MODELS,
    build_model,
    compatible_datasets,
    dataset_info,
    evaluate,
    job_figures,
    load_dataset,
    loss_function,
    make_optimizer,
    model_figures,
    parse_model_name,
    validate_job,
)
from shared.zoo.datasets import _LOADERS


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """Workers run torch on one thread; so does this process (2 threads on a busy 2-core box crawl)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PAIRS = [(m, d) for m in MODELS for d in compatible_datasets(m)]


def spec(model: str = "resnet", dataset: str = "digits") -> JobSpec:
    return JobSpec(job_id="j1", user="u", model=model, dataset=dataset, batch_size=32, workers=1,
                   iterations=100)


def test_names_are_the_documented_ones() -> None:
    assert MODELS == ("autoencoder", "lstm", "resnet", "transformer")
    assert DATASETS == ("diabetes", "digits", "synthetic-ratings", "synthetic-text")
    assert compatible_datasets("resnet") == ("diabetes", "digits")
    assert compatible_datasets("autoencoder") == ("synthetic-ratings",)


@pytest.mark.parametrize("model, dataset", PAIRS)
def test_valid_jobs_pass(model: str, dataset: str) -> None:
    validate_job(spec(model, dataset))


def test_unknown_model_is_rejected_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"model: unknown 'vgg'; valid: autoencoder, lstm, resnet, transformer"):
        validate_job(spec(model="vgg"))


def test_unknown_dataset_is_rejected_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"dataset: unknown 'mnist'; valid: diabetes, digits, synthetic-ratings"):
        validate_job(spec(dataset="mnist"))


def test_model_that_cannot_train_on_the_dataset_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"'autoencoder' cannot train on dataset 'digits'.*valid datasets "
                                         r"for autoencoder: synthetic-ratings"):
        validate_job(spec(model="autoencoder", dataset="digits"))


def test_width_and_depth_knobs() -> None:
    name = parse_model_name("transformer-w64-d3")
    assert (name.family, name.width, name.depth) == ("transformer", 64, 3)
    assert parse_model_name("resnet-d2").width == 8
    for bad in ("resnet-w0", "resnet-w2000", "resnet-d20", "transformer-w33", "resnet-x3", "Resnet"):
        with pytest.raises(ValueError):
            parse_model_name(bad)
    small = build_model("resnet-w4", dataset_info("digits"), seed=0)
    big = build_model("resnet-w16-d2", dataset_info("digits"), seed=0)
    assert sum(p.numel() for p in big.parameters()) > 4 * sum(p.numel() for p in small.parameters())


def test_datasets_are_deterministic_and_well_formed() -> None:
    for name in DATASETS:
        a, b = load_dataset(name), _LOADERS[name]()   # the cached one and a fresh build
        for part in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(a, part), getattr(b, part)), (name, part)
        assert len(a.train_x) == len(a.train_y) == a.info.train_size
        assert len(a.test_x) == len(a.test_y) == a.info.test_size
        assert tuple(a.train_x.shape[1:]) == a.info.input_shape


def test_splits_are_disjoint() -> None:
    digits = load_dataset("digits")
    assert digits.info.train_size + digits.info.test_size == 1797
    train_rows = {tuple(r.flatten().tolist()) for r in digits.train_x}
    overlap = sum(tuple(r.flatten().tolist()) in train_rows for r in digits.test_x)
    assert overlap < 10   # a few scanned digits are pixel-identical; the split itself is by index
    ratings = load_dataset("synthetic-ratings")
    train_mask, test_mask = ratings.train_y[:, 1], ratings.test_y[:, 1]
    assert float((train_mask * test_mask).sum()) == 0.0 and float(test_mask.sum()) > 0
    text = load_dataset("synthetic-text")
    assert int(text.train_x.max()) < text.info.n_outputs and torch.equal(text.train_x[:, 1:], text.train_y[:, :-1])


def test_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    info = dataset_info("synthetic-text")
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_model("transformer", info, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_model("transformer", info, seed=5)
    c = build_model("transformer", info, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert not any(n for n, _ in a.named_buffers())   # all state is parameters


@pytest.mark.parametrize("model, dataset", PAIRS)
def test_every_model_learns_its_data(model: str, dataset: str) -> None:
    data = load_dataset(dataset)
    net = build_model(model, data.info, seed=0)
    opt = make_optimizer("adam", net.parameters(), 0.01)
    loss_fn = loss_function(data.info.task)
    x, y = data.train_x[:32], data.train_y[:32]
    with torch.no_grad():
        first = float(loss_fn(net(x), y))
    for _ in range(30):
        loss = loss_fn(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(loss_fn(net(x), y)) < 0.7 * first
    metric = evaluate(net, data)
    assert metric.name in ("accuracy", "mse")
    assert 0.0 <= metric.value <= 1.0 if metric.name == "accuracy" else metric.value >= 0.0
    assert net.training   # evaluate restores the mode


def test_figures_are_counted_and_grow_with_the_knobs() -> None:
    for model in MODELS:
        f = model_figures(model, 32)
        assert f.params > 0 and f.param_bytes == 4 * f.params
        assert 2.0 <= f.flops_per_sample / f.forward_flops_per_sample <= 3.5
        assert f.activation_bytes_per_sample > 0 and f.ops_per_step > 10
    def forward(name: str) -> float:
        return model_figures(name, 32).forward_flops_per_sample

    assert forward("lstm-w64") > 3 * forward("lstm")
    assert forward("resnet-d3") > forward("resnet")
    with pytest.raises(ValueError):
        model_figures("resnet", 0)


@settings(max_examples=8, deadline=None)
@given(model=st.sampled_from(MODELS), batch=st.sampled_from([1, 7, 32, 100]))
def test_job_figures_feed_the_estimator(model: str, batch: int) -> None:
    figures = job_figures(model, batch, optimizer="adam")
    assert figures.batch_size == batch and figures.optimizer_slots == 2 and figures.distributed
    rates = [gpus.estimate_steps_per_second(gpus.gpu_spec(t), figures, 1) for t in ("k80", "v100")]
    assert 0 < rates[0] <= rates[1]


def test_hyperparameter_optimizers_are_all_known() -> None:
    net = build_model("autoencoder", dataset_info("synthetic-ratings"), seed=0)
    for name in ("sgd", "adam", "adamw"):
        Hyperparameters(optimizer=name)  # the event accepts it...
        make_optimizer(name, net.parameters(), 0.01)  # ...and the zoo builds it
    with pytest.raises(ValueError, match="valid: adam, adamw, sgd"):
        make_optimizer("rmsprop", net.parameters(), 0.01)
