"""The estimator's figures for Sia's applications, and what TF32 changes (shared.domain.sia_figures)."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.sim.sia_profiles import APPLICATIONS, CLUSTER_GPU_TYPE, AppProfile
from shared.domain import gpus
from shared.domain.sia_figures import SIA_APPLICATIONS, sia_figures
from shared.domain.workloads import JOB_TYPES, figures_for


def test_every_application_of_the_workloads_has_figures() -> None:
    assert set(APPLICATIONS) <= set(SIA_APPLICATIONS)
    with pytest.raises(ValueError, match="known: "):
        sia_figures("ncf", 8)
    with pytest.raises(ValueError):
        sia_figures("bert", 0)


@pytest.mark.parametrize("application", APPLICATIONS)
@pytest.mark.parametrize("cluster", sorted(CLUSTER_GPU_TYPE))
def test_the_largest_batch_measured_on_one_gpu_fits_in_the_estimate(application: str, cluster: str) -> None:
    """The profiles ran it, so an estimate that says it does not fit is wrong."""
    profile = AppProfile.load(application, cluster)
    largest = max(r.local_bsz for r in profile.rows if r.placement == (1,))
    spec = gpus.gpu_spec(CLUSTER_GPU_TYPE[cluster])
    assert gpus.estimate_step(spec, sia_figures(application, largest), 1).fits


@pytest.mark.parametrize("gpu_type", sorted(gpus.CATALOG))
@pytest.mark.parametrize("job_type", JOB_TYPES)
def test_tf32_is_never_slower_than_fp32_and_changes_nothing_without_tf32_units(gpu_type: str, job_type: str) -> None:
    spec = gpus.CATALOG[gpu_type]
    fp32 = figures_for(job_type)
    tf32 = dataclasses.replace(fp32, tf32=True)
    assert gpus.estimate_steps_per_second(spec, tf32) >= gpus.estimate_steps_per_second(spec, fp32)
    if spec.tf32_tflops == 0:
        assert gpus.estimate_step(spec, tf32) == gpus.estimate_step(spec, fp32)
    # A job that does not use TF32 ignores the figure.
    boosted = dataclasses.replace(spec, tf32_tflops=spec.tf32_tflops + 500.0)
    assert gpus.estimate_step(boosted, fp32) == gpus.estimate_step(spec, fp32)


def test_tf32_runs_a_convolution_network_at_the_a100s_tensor_rate() -> None:
    a100 = gpus.gpu_spec("a100")
    job = sia_figures("cifar10", 1024)
    fp32 = gpus.estimate_step(a100, dataclasses.replace(job, tf32=False))
    tf32 = gpus.estimate_step(a100, job)
    ratio = (a100.tf32_tflops * gpus.TENSOR_EFFICIENCY) / (a100.fp32_tflops * gpus.FP32_EFFICIENCY)
    assert fp32.compute_s / tf32.compute_s == pytest.approx(ratio)
