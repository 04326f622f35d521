"""The local-SGD recipe (shared/domain/local_sgd.py): the factor, the warm-up and the worker's one hook."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from services.agent.protocol import StoreTarget, WorkerSpec
from shared.domain.local_sgd import SCALINGS, LocalSgd, install, lr_factor


@given(w=st.integers(1, 8), step=st.floats(0, 1e7), scaling=st.sampled_from(tuple(SCALINGS)))
def test_one_whole_copy_trains_at_the_jobs_own_rate(w, step, scaling):
    assert lr_factor(LocalSgd(fork_workers=w, job_workers=w, job_steps=1000, scaling=scaling), step) == 1.0
    assert lr_factor(LocalSgd(), step) == 1.0


@given(k=st.integers(1, 64), w=st.integers(1, 8), total=st.integers(1, 10**6), a=st.floats(0, 1), b=st.floats(0, 1))
def test_linear_factor_warms_up_monotonically_to_k_over_w_capped(k, w, total, a, b):
    recipe = LocalSgd(fork_workers=k, job_workers=w, job_steps=total, scaling="linear")
    full = min(8.0, k / w)
    lo, hi = sorted((a * total, b * total))
    assert lr_factor(recipe, 0) == pytest.approx(1.0 if full != 1.0 else full)
    assert lr_factor(recipe, total * 0.05) == pytest.approx(full)
    f_lo, f_hi = lr_factor(recipe, lo), lr_factor(recipe, hi)
    assert min(1.0, full) - 1e-12 <= min(f_lo, f_hi) and max(f_lo, f_hi) <= max(1.0, full) + 1e-12
    assert (f_hi - f_lo) * (full - 1.0) >= -1e-12       # moves toward the full factor only


def test_sqrt_scaling_and_bad_recipes():
    assert LocalSgd(fork_workers=4, job_workers=1, scaling="sqrt").scale == pytest.approx(2.0)
    assert LocalSgd(fork_workers=4, job_workers=1).scale == 1.0          # the default recipe: none
    for bad in ({"fork_workers": -1}, {"job_workers": 0}, {"scaling": "cubic"}, {"warmup_fraction": 2.0},
                {"max_factor": 0.5}):
        with pytest.raises(ValueError):
            LocalSgd(**bad)


def test_install_sets_each_steps_lr_from_the_jobs_progress():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    recipe = LocalSgd(fork_workers=4, job_workers=1, job_steps=100, scaling="linear")   # warm-up: 5 job steps
    install(opt, recipe, start_job_step=2)
    seen = []
    for _ in range(3):
        param.grad = torch.ones(1)
        opt.step()
        seen.append(opt.param_groups[0]["lr"])
    # job steps 2, 6, 10 (4 per copy step): 0.1 x (1 + 3 x 2/5), then the full 0.4
    assert seen == pytest.approx([0.1 * (1 + 3 * 2 / 5), 0.4, 0.4])


def test_worker_spec_carries_the_recipe_through_json():
    spec = WorkerSpec(job_id="j", round=0, copy=1, node_id="n", gpu_type="cpu", model="resnet", dataset="digits",
                      batch_size=32, optimizer="sgd", lr=0.05, seed=0, rank=0, world_size=1, rendezvous=None,
                      device="cpu", step_budget=10, deadline=1.0, start_from=None, checkpoint="c",
                      store=StoreTarget.local("/tmp/x"),
                      local_sgd=LocalSgd(fork_workers=3, job_workers=1, job_steps=10, scaling="sqrt"))
    back = WorkerSpec.from_json(spec.to_json())
    assert back == spec
    data = json.loads(spec.to_json())
    del data["local_sgd"]                                   # a spec from an older daemon
    assert WorkerSpec.from_json(json.dumps(data)).local_sgd == LocalSgd()
