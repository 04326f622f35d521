"""Job figures for the job types of Gavel's throughput table, and the calibrated fallback.

A job type is ``"<family> (batch size N)"`` or a bare family (``"A3C"``, ``"CycleGAN"``),
as in ``shared/domain/data/gavel_throughputs.json``. Figures describe the workloads Gavel
measured (github.com/stanford-futuredata/gavel, ``workloads/pytorch`` and
``scheduler/job_table.py``), all trained in FP32. Forward FLOPs count a multiply-add as
two FLOPs (the "0.56 GFLOPs" / "4.1 GFLOPs" usually quoted for ResNet-18-CIFAR /
ResNet-50 are multiply-adds). Params, forward FLOPs and saved-activation bytes were
counted with torch.utils.flop_counter and saved-tensor hooks on re-implementations of
the listed architectures; everything marked "est." is an order-of-magnitude estimate.

=============  ==============================  =======  =========  =========  ========================
family         model / data (Gavel workload)    params   fwd FLOPs  act/sample notes
=============  ==============================  =======  =========  =========  ========================
ResNet-18      ResNet-18 (CIFAR variant),       11.2M    1.11 G     4.7 MB     SGD momentum; input
               CIFAR-10 32x32                                                  3x32x32 fp32
ResNet-50      ResNet-50, ImageNet 224x224      25.6M    8.18 G     86 MB      SGD momentum; 8 loaders
Transformer    Transformer base (6+6 layers,    49.3M    2.34 G     19 MB      Adam; vocab est. 5.4k de
               d512, ff2048), Multi30k;                                        / 4.6k en, shared output
               sample = sentence pair, 25                                      projection; 25 tokens
               tokens/side (est.)                                              est. (padded)
LM             2-layer LSTM 200/200, vocab      14.0M    0.47 G     5.8 MB     plain SGD + clipping;
               33,278, WikiText-2, bptt 35;                                    corpus lives on the GPU,
               sample = one 35-token sequence                                  but each sample is cut
                                                                               by ~4 CUDA ops in the
                                                                               loader (est. 100 us)
Recommendation autoencoder 20,108 -> 200 ->    8.1M     16 M       0.4 MB     Adam; sparse input (~86
               20,108 (recoder), ML-20M                (dense     (est.)     ratings/user, 20 B each)
               sample = one user                        bound)                built in Python with no
                                                                               loader workers: est. 30
                                                                               us/user on the CPU
A3C            A3C-LSTM (4 conv + LSTMCell      3.25M    0.118 G    2.0 MB     sample = one Pong frame,
               1024->512), Pong; step = 20-                /frame                20 per step; est. 0.5 ms
               frame rollout                                                   env + preprocessing per
                                                                               frame; shared model on
                                                                               CPU: weights in, grads
                                                                               out, CPU Adam est. 15 ms
CycleGAN       2 ResNet-9 generators + 2        28.3M    702 G      2.5 GB     Adam; step = 6 generator
               PatchGAN discriminators,                  /step                 + 6 discriminator passes
               monet2photo 256x256, batch 1                                    on one image pair
=============  ==============================  =======  =========  =========  ========================

``ops_per_step`` (framework ops per step: forward, backward, zero_grad and a per-tensor
optimizer) is counted from each model's layer and parameter-tensor counts, rounded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Protocol

from shared.domain import gpus

__all__ = [
    "JobFigures", "FAMILIES", "JOB_TYPES", "figures_for", "model_bytes", "estimate",
    "calibrated_fallback", "MeasuredRates",
]

_BATCH_RE = re.compile(r"^(?P<family>.+) \(batch size (?P<batch>[1-9]\d*)\)$")


@dataclass(frozen=True, kw_only=True)
class JobFigures:
    """What the estimator needs to know about one job type (one worker's view)."""

    family: str
    flops_per_sample: float           # forward FLOPs per sample
    params: int
    batch_size: int                   # samples per worker per step
    input_bytes_per_sample: int       # copied host -> GPU per sample
    activation_bytes_per_sample: int  # FP32 bytes saved for backward per sample
    ops_per_step: int                 # framework ops (kernel launches) per step
    optimizer_slots: int              # FP32 state tensors per parameter: SGD 0, momentum 1, Adam 2
    host_seconds_per_sample: float = 0.0  # CPU work on the step's critical path, per sample
    host_seconds_per_step: float = 0.0    # ... and per step
    host_bytes_per_step: int = 0          # extra host <-> GPU bytes per step
    mixed_precision: bool = False
    # FP32 math on tensor cores as TF32 where the GPU has them (Ampere and later): PyTorch's
    # default for cuDNN convolutions and RNNs (torch.backends.cudnn.allow_tf32).
    tf32: bool = False
    distributed: bool = False         # the workload supports data-parallel workers (n > 1)

    def __post_init__(self) -> None:
        if self.flops_per_sample <= 0 or self.params <= 0 or self.batch_size <= 0:
            raise ValueError(f"{self.family}: flops_per_sample, params and batch_size must be positive")
        if min(self.input_bytes_per_sample, self.activation_bytes_per_sample, self.ops_per_step,
               self.host_bytes_per_step) < 0 or min(self.host_seconds_per_sample,
                                                    self.host_seconds_per_step) < 0:
            raise ValueError(f"{self.family}: figures must be non-negative")
        if self.optimizer_slots not in (0, 1, 2):
            raise ValueError(f"{self.family}: optimizer_slots must be 0, 1 or 2")


_MB = 1_000_000

# Per-family figures at a placeholder batch size; job types set their own batch size.
FAMILIES: MappingProxyType[str, JobFigures] = MappingProxyType({
    "ResNet-18": JobFigures(
        family="ResNet-18", flops_per_sample=1.11e9, params=11_173_962, batch_size=1,
        input_bytes_per_sample=3 * 32 * 32 * 4, activation_bytes_per_sample=int(4.74 * _MB),
        ops_per_step=530, optimizer_slots=1, distributed=True),
    "ResNet-50": JobFigures(
        family="ResNet-50", flops_per_sample=8.18e9, params=25_557_032, batch_size=1,
        input_bytes_per_sample=3 * 224 * 224 * 4, activation_bytes_per_sample=int(86.1 * _MB),
        ops_per_step=1330, optimizer_slots=1, distributed=True),
    "Transformer": JobFigures(
        family="Transformer", flops_per_sample=2.34e9, params=49_260_000, batch_size=1,
        input_bytes_per_sample=2 * 25 * 8, activation_bytes_per_sample=int(19.4 * _MB),
        ops_per_step=3900, optimizer_slots=2, distributed=True),
    "LM": JobFigures(
        family="LM", flops_per_sample=0.466e9, params=13_988_478, batch_size=1,
        input_bytes_per_sample=0, activation_bytes_per_sample=int(5.8 * _MB),
        ops_per_step=90, optimizer_slots=0, host_seconds_per_sample=100e-6, distributed=True),
    "Recommendation": JobFigures(
        family="Recommendation", flops_per_sample=16e6, params=8_063_508, batch_size=1,
        input_bytes_per_sample=86 * 20, activation_bytes_per_sample=int(0.4 * _MB),
        ops_per_step=120, optimizer_slots=2, host_seconds_per_sample=30e-6),
    "A3C": JobFigures(
        family="A3C", flops_per_sample=0.118e9, params=3_250_000, batch_size=20,
        input_bytes_per_sample=80 * 80 * 4, activation_bytes_per_sample=int(2.0 * _MB),
        ops_per_step=2400, optimizer_slots=2, host_seconds_per_sample=0.5e-3,
        host_seconds_per_step=15e-3, host_bytes_per_step=2 * 3_250_000 * 4),
    "CycleGAN": JobFigures(
        family="CycleGAN", flops_per_sample=702e9, params=28_280_000, batch_size=1,
        input_bytes_per_sample=2 * 3 * 256 * 256 * 4, activation_bytes_per_sample=int(2510 * _MB),
        ops_per_step=3000, optimizer_slots=2),
})

# The job types of Gavel's table (scheduler/job_table.py); A3C and CycleGAN have no batch.
_BATCHED_FAMILIES = ("ResNet-18", "ResNet-50", "Transformer", "LM", "Recommendation")
JOB_TYPES: tuple[str, ...] = (
    *(f"ResNet-18 (batch size {b})" for b in (16, 32, 64, 128, 256)),
    *(f"ResNet-50 (batch size {b})" for b in (16, 32, 64, 128)),
    *(f"Transformer (batch size {b})" for b in (16, 32, 64, 128, 256)),
    *(f"LM (batch size {b})" for b in (5, 10, 20, 40, 80)),
    *(f"Recommendation (batch size {b})" for b in (512, 1024, 2048, 4096, 8192)),
    "A3C", "CycleGAN",
)


def figures_for(job_type: str) -> JobFigures:
    """Figures for ``job_type``: any batch size of a batched family, or A3C / CycleGAN.

    Raises ``ValueError`` naming the valid job types for anything else.
    """
    m = _BATCH_RE.match(job_type)
    if m is not None and m["family"] in _BATCHED_FAMILIES:
        return replace(FAMILIES[m["family"]], batch_size=int(m["batch"]))
    if job_type in FAMILIES and job_type not in _BATCHED_FAMILIES:
        return FAMILIES[job_type]
    raise ValueError(f"unknown job type {job_type!r}; known: {', '.join(JOB_TYPES)} "
                     f"(or any batch size of {', '.join(_BATCHED_FAMILIES)})")


def model_bytes(job_type: str) -> int:
    """Bytes of the job's model as stored for consolidation: FP32 parameters x 4."""
    return figures_for(job_type).params * 4


def estimate(job_type: str, gpu_type: str, n: int = 1) -> float:
    """Raw (uncalibrated) estimated steps/s of ``job_type`` on ``n`` GPUs of ``gpu_type``."""
    return gpus.estimate_steps_per_second(gpus.gpu_spec(gpu_type), figures_for(job_type), n)


class MeasuredRates(Protocol):
    """The part of ``services.scheduler.core.throughput.ThroughputModel`` the fallback reads."""

    def scales(self, job_type: str, gpu_type: str) -> tuple[int, ...]: ...

    def rate(self, job_type: str, gpu_type: str, n: int) -> float: ...


def calibrated_fallback(model: MeasuredRates, reference: str = "v100") -> Callable[[str, str, int], float]:
    """A ``ThroughputModel.fallback`` that scales the reference GPU's measured rate.

    For a job type measured on ``reference``: ``model.rate(job, reference, n) *
    estimate(job, gpu, n) / estimate(job, reference, n)``, so the estimator only supplies
    the relative speed of the two GPU types. For a job type not measured on
    ``reference``, or one the estimator says cannot run there, the raw estimate divided by
    ``n``: the estimator counts a step per worker, the model a step of the whole copy
    (``shared.domain.progress``). Zero where the job does not fit the GPU. Unknown job or GPU
    types raise ``ValueError``.

    Build the model first, then attach the fallback (the fallback only reads measured
    rates, so it never recurses into itself)::

        base = ThroughputModel.from_gavel_table()
        model = dataclasses.replace(base, fallback=calibrated_fallback(base))
    """
    gpus.gpu_spec(reference)

    def fallback(job_type: str, gpu_type: str, n: int) -> float:
        raw = estimate(job_type, gpu_type, n)
        if raw == 0.0 or not model.scales(job_type, reference):
            return raw / n
        ref_estimate = estimate(job_type, reference, n)
        if ref_estimate == 0.0:
            return raw / n
        return model.rate(job_type, reference, n) * raw / ref_estimate

    return fallback
