"""GPU catalog, roofline estimator, job figures and the calibrated fallback."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core.throughput import ThroughputModel
from shared.domain import gpus, workloads
from shared.domain.gpus import (
    CATALOG,
    GPU_TYPES,
    GpuSpec,
    estimate_step,
    estimate_steps_per_second,
)
from shared.domain.workloads import (
    JOB_TYPES,
    calibrated_fallback,
    estimate,
    figures_for,
    model_bytes,
)

THIRTEEN = {"k80", "p100", "v100", "t4", "t400", "a2000", "rtx3090", "rtx2080ti", "titanrtx", "a100", "l4", "h100",
            "h200"}


@pytest.fixture(scope="module")
def table() -> ThroughputModel:
    return ThroughputModel.from_gavel_table()


# ----------------------------------------------------------------------------- catalog

def test_catalog_has_the_thirteen_gpu_types_and_cpu() -> None:
    assert set(GPU_TYPES) == THIRTEEN
    assert set(CATALOG) == THIRTEEN | {"cpu"}
    for key, spec in CATALOG.items():
        assert spec.key == key
        assert spec.fp32_tflops > 0 and spec.fp16_tflops >= spec.fp32_tflops
        assert spec.memory_gb > 0 and spec.memory_bw_gb_s > 0
    for key in GPU_TYPES:
        spec = CATALOG[key]
        assert spec.pcie_gen >= 3 and spec.pcie_lanes == 16 and spec.pcie_gb_s > 0


def test_catalog_figures_follow_public_specs() -> None:
    k80, v100, h200 = CATALOG["k80"], CATALOG["v100"], CATALOG["h200"]
    assert (k80.memory_gb, k80.memory_bw_gb_s) == (12, 240)  # one GK210 die, half a board
    assert not k80.tensor_cores and v100.tensor_cores
    assert h200.memory_gb > CATALOG["h100"].memory_gb
    assert CATALOG["t400"].memory_gb < CATALOG["a2000"].memory_gb < CATALOG["t4"].memory_gb


def test_gpu_spec_rejects_bad_figures_and_unknown_keys() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(CATALOG["t4"], memory_bw_gb_s=0)
    with pytest.raises(ValueError):
        dataclasses.replace(CATALOG["t4"], pcie_lanes=0)
    with pytest.raises(ValueError, match="known: k80"):
        gpus.gpu_spec("gtx1080")


@pytest.mark.parametrize(("device_name", "key"), [
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla V100-PCIE-32GB", "v100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-PCIE-40GB", "a100"),
    ("Tesla T4", "t4"),
    ("NVIDIA T400", "t400"),
    ("NVIDIA T400 4GB", "t400"),
    ("NVIDIA RTX A2000", "a2000"),
    ("NVIDIA RTX A2000 12GB", "a2000"),
    ("Tesla K80", "k80"),
    ("Tesla P100-PCIE-16GB", "p100"),
    ("NVIDIA TITAN RTX", "titanrtx"),
    ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"),
    ("NVIDIA GeForce RTX 2080", None),
    ("NVIDIA L4", "l4"),
    ("cpu", "cpu"),
    ("NVIDIA GeForce RTX 3090 Ti", None),
    ("NVIDIA L40S", None),
    ("NVIDIA A10", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("NVIDIA GH200 480GB", None),
])
def test_normalize_gpu_name(device_name: str, key: str | None) -> None:
    assert gpus.normalize_gpu_name(device_name) == key


# ----------------------------------------------------------------------------- estimator

def _bigger(spec: GpuSpec, data: st.DataObject) -> GpuSpec:
    """``spec`` with every hardware figure kept or raised (never lowered)."""
    grow = st.floats(min_value=1.0, max_value=8.0)
    fp32 = spec.fp32_tflops * data.draw(grow)
    return dataclasses.replace(
        spec, fp32_tflops=fp32, fp16_tflops=max(fp32, spec.fp16_tflops * data.draw(grow)),
        memory_gb=spec.memory_gb * data.draw(grow), memory_bw_gb_s=spec.memory_bw_gb_s * data.draw(grow),
        nvlink_gb_s=spec.nvlink_gb_s + data.draw(st.sampled_from([0.0, 5.0, 50.0, 300.0])),
        tf32_tflops=spec.tf32_tflops * data.draw(grow) + data.draw(st.sampled_from([0.0, 10.0, 150.0])),
        pcie_gen=data.draw(st.integers(min_value=spec.pcie_gen, max_value=5)) if spec.pcie_gen else 0,
        sustained_clock_fraction=data.draw(st.floats(min_value=spec.sustained_clock_fraction, max_value=1.0)))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), gpu_type=st.sampled_from(sorted(CATALOG)), job_type=st.sampled_from(JOB_TYPES),
       n=st.sampled_from([1, 2, 4, 8]), mixed=st.booleans(), tf32=st.booleans())
def test_estimate_is_monotone_in_hardware_figures(data: st.DataObject, gpu_type: str, job_type: str,
                                                  n: int, mixed: bool, tf32: bool) -> None:
    job = dataclasses.replace(figures_for(job_type), mixed_precision=mixed, tf32=tf32)
    base = CATALOG[gpu_type]
    bigger = _bigger(base, data)
    assert estimate_steps_per_second(bigger, job, n) >= estimate_steps_per_second(base, job, n) * (1 - 1e-12)


@settings(max_examples=60, deadline=None)
@given(gpu_type=st.sampled_from(sorted(CATALOG)), job_type=st.sampled_from(JOB_TYPES),
       n=st.sampled_from([1, 2, 4, 8]))
def test_estimate_is_zero_exactly_when_the_job_does_not_fit(gpu_type: str, job_type: str, n: int) -> None:
    spec, job = CATALOG[gpu_type], figures_for(job_type)
    fits = gpus.memory_needed_bytes(job, n) <= gpus.USABLE_MEMORY_FRACTION * spec.memory_bytes
    rate = estimate_steps_per_second(spec, job, n)
    assert (rate > 0) == fits
    assert rate >= 0


def test_models_that_do_not_fit_small_gpus_get_zero() -> None:
    assert estimate("CycleGAN", "t400") == 0.0
    assert estimate("ResNet-50 (batch size 128)", "t400") == 0.0
    assert estimate("ResNet-50 (batch size 128)", "a2000") == 0.0
    assert estimate("ResNet-50 (batch size 128)", "v100") > 0
    assert estimate("ResNet-50 (batch size 2048)", "h200") == 0.0  # ~176 GB of activations
    assert estimate("ResNet-18 (batch size 16)", "t400") > 0


def test_faster_gpus_estimate_faster_for_compute_bound_jobs() -> None:
    for job_type in ("ResNet-50 (batch size 64)", "Transformer (batch size 128)", "CycleGAN"):
        rates = [estimate(job_type, t) for t in ("k80", "p100", "v100", "a100", "h100")]
        assert rates == sorted(rates) and len(set(rates)) == len(rates), job_type


def test_step_terms_follow_the_documented_formula() -> None:
    job, v100 = figures_for("ResNet-50 (batch size 32)"), CATALOG["v100"]
    one = estimate_step(v100, job, 1)
    assert one.sync_s == 0.0 and one.fits
    expected_compute = gpus.TRAIN_FLOPS_FACTOR * job.flops_per_sample * 32 / (15.7e12 * gpus.FP32_EFFICIENCY)
    assert one.compute_s == pytest.approx(expected_compute)
    assert one.dispatch_s == pytest.approx(job.ops_per_step * gpus.HOST_SECONDS_PER_OP)
    four = estimate_step(v100, job, 4)
    assert four.sync_s > 0
    assert estimate_steps_per_second(v100, job, 4) == pytest.approx(4 / four.step_s)
    # Without NVLink the gradient allreduce goes over PCIe and takes longer.
    assert estimate_step(dataclasses.replace(v100, nvlink_gb_s=0.0), job, 4).sync_s > four.sync_s


def test_mixed_precision_uses_tensor_cores_only_where_present() -> None:
    fp32 = figures_for("ResNet-50 (batch size 64)")
    amp = dataclasses.replace(fp32, mixed_precision=True)
    v100, p100 = CATALOG["v100"], CATALOG["p100"]
    assert estimate_step(v100, amp).compute_s < estimate_step(v100, fp32).compute_s / 2
    assert estimate_step(p100, amp).compute_s == estimate_step(p100, fp32).compute_s
    assert gpus.memory_needed_bytes(amp) < gpus.memory_needed_bytes(fp32)


def test_cpu_pseudo_type_is_slow_but_usable() -> None:
    assert 0 < estimate("ResNet-18 (batch size 32)", "cpu") < estimate("ResNet-18 (batch size 32)", "t400")
    assert estimate_step(CATALOG["cpu"], figures_for("ResNet-18 (batch size 32)")).input_s == 0.0


# ----------------------------------------------------------------------------- job figures

def test_figures_cover_every_job_type_of_the_gavel_table(table: ThroughputModel) -> None:
    assert set(table.job_types) == set(JOB_TYPES)
    for job_type in table.job_types:
        job = figures_for(job_type)
        assert job.params > 0 and job.flops_per_sample > 0
        if "(batch size " in job_type:
            assert job_type == f"{job.family} (batch size {job.batch_size})"
        else:
            assert job.family == job_type


def test_figures_for_other_batch_sizes_and_unknown_types() -> None:
    assert figures_for("ResNet-50 (batch size 256)").batch_size == 256
    assert figures_for("ResNet-50 (batch size 256)").params == figures_for("ResNet-50 (batch size 16)").params
    for bad in ("BERT (batch size 8)", "A3C (batch size 4)", "ResNet-50", "ResNet-50 (batch size 0)", ""):
        with pytest.raises(ValueError, match="known: ResNet-18 \\(batch size 16\\)"):
            figures_for(bad)


def test_model_bytes_are_fp32_parameters() -> None:
    assert model_bytes("ResNet-50 (batch size 32)") == figures_for("ResNet-50 (batch size 32)").params * 4
    assert 95e6 < model_bytes("ResNet-50 (batch size 32)") < 110e6  # 25.6M parameters
    assert 40e6 < model_bytes("ResNet-18 (batch size 64)") < 50e6   # 11.2M parameters
    with pytest.raises(ValueError):
        model_bytes("nope")


# ----------------------------------------------------------------------------- calibrated fallback

def test_fallback_returns_the_measured_rate_on_the_reference(table: ThroughputModel) -> None:
    fallback = calibrated_fallback(table, reference="v100")
    for (job_type, gpu_type, n), measured in table.rates.items():
        if gpu_type == "v100":
            assert fallback(job_type, "v100", n) == pytest.approx(measured)


def test_fallback_scales_the_reference_by_the_estimated_ratio(table: ThroughputModel) -> None:
    fallback = calibrated_fallback(table)
    job = "Transformer (batch size 64)"
    expected = table.rate(job, "v100", 2) * estimate(job, "t4", 2) / estimate(job, "v100", 2)
    assert fallback(job, "t4", 2) == pytest.approx(expected)
    assert fallback("CycleGAN", "t400", 1) == 0.0  # does not fit, whatever V100 measured


def test_attached_fallback_places_t4_between_k80_and_v100(table: ThroughputModel) -> None:
    model = dataclasses.replace(table, fallback=calibrated_fallback(table))
    for batch in (16, 32, 64, 128):
        job = f"ResNet-50 (batch size {batch})"
        assert model.rate(job, "k80", 1) < model.rate(job, "t4", 1) < model.rate(job, "v100", 1)
    assert model.rate("ResNet-50 (batch size 64)", "h100", 1) > model.rate("ResNet-50 (batch size 64)", "v100", 1)


def test_fallback_uses_the_raw_estimate_for_job_types_the_table_lacks() -> None:
    only_resnet = ThroughputModel(rates={("ResNet-50 (batch size 32)", "v100", 1): 7.0})
    model = dataclasses.replace(only_resnet, fallback=calibrated_fallback(only_resnet))
    # Not measured anywhere, including on the reference: no recursion, the raw estimate.
    assert model.rate("LM (batch size 20)", "v100", 1) == pytest.approx(estimate("LM (batch size 20)", "v100", 1))
    # the estimator counts a step per worker (as Gavel's table); a model rate is the copy's steps
    assert model.rate("LM (batch size 20)", "a100", 2) == pytest.approx(estimate("LM (batch size 20)", "a100", 2) / 2)
    assert model.rate("ResNet-50 (batch size 32)", "a100", 1) == pytest.approx(
        7.0 * estimate("ResNet-50 (batch size 32)", "a100") / estimate("ResNet-50 (batch size 32)", "v100"))


def test_fallback_rejects_unknown_types(table: ThroughputModel) -> None:
    with pytest.raises(ValueError):
        calibrated_fallback(table, reference="v99")
    fallback = calibrated_fallback(table)
    with pytest.raises(ValueError):
        fallback("ResNet-50 (batch size 32)", "gtx1080", 1)
    with pytest.raises(ValueError):
        fallback("BERT (batch size 8)", "t4", 1)


def test_workloads_module_lists_figures_per_family() -> None:
    assert set(workloads.FAMILIES) == {"ResNet-18", "ResNet-50", "Transformer", "LM", "Recommendation",
                                       "A3C", "CycleGAN"}


def test_the_gpus_swarm_assigned_become_the_visible_devices() -> None:
    from services.agent.daemon.discovery import apply_assigned_gpus, assigned_gpus
    assert assigned_gpus({"PATH": "/bin"}) is None
    assert assigned_gpus({"DOCKER_RESOURCE_NVIDIA-GPU": "GPU-a1,GPU-b2", "DOCKER_RESOURCE_CPU": "x"}) == "GPU-a1,GPU-b2"
    env = {"DOCKER_RESOURCE_NVIDIA-GPU": "GPU-a1"}
    apply_assigned_gpus(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a1"
    env = {"DOCKER_RESOURCE_NVIDIA-GPU": "GPU-a1", "CUDA_VISIBLE_DEVICES": "3"}   # an explicit choice stays
    apply_assigned_gpus(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
