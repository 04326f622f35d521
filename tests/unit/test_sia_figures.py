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
    ratio = (a100.tf32_tflops * gpus.TF32_EFFICIENCY) / (a100.fp32_tflops * gpus.FP32_EFFICIENCY)
    assert fp32.compute_s / tf32.compute_s == pytest.approx(ratio)


@pytest.mark.parametrize(("application", "mixed", "tf32"), [
    ("cifar10", False, True), ("imagenet", True, True), ("bert", False, True),
    ("deepspeech2", False, False), ("yolov3", True, True)])
def test_precision_follows_the_artifacts_training_scripts(application: str, mixed: bool, tf32: bool) -> None:
    """imagenet and yolov3 call apex ``amp.initialize`` (O1); the others train in FP32, which
    PyTorch 1.9 runs as TF32 on an A100 except deepspeech2's packed variable-length GRU batches."""
    job = SIA_APPLICATIONS[application]
    assert (job.mixed_precision, job.tf32) == (mixed, tf32)


def test_deepspeech2_is_the_artifacts_gru_model() -> None:
    """train.py defaults: 5 bidirectional GRU layers of 800 (not LSTMs of 1024) after two convolutions."""
    assert 40e6 < SIA_APPLICATIONS["deepspeech2"].params < 42.5e6


def test_one_replica_runs_the_gradient_noise_scale_difference_estimator() -> None:
    """AdaptDL's GradientNoiseScale works on every parameter tensor each step, twice as much on one
    replica (it differences successive gradients) as on several (it averages the replicas')."""
    for application in SIA_APPLICATIONS:
        one, two = sia_figures(application, 8, 1), sia_figures(application, 8, 2)
        assert one.ops_per_step > two.ops_per_step == sia_figures(application, 8, 8).ops_per_step
    assert sia_figures("bert", 8, 2).ops_per_step > 199 * 9  # 199 parameter tensors
