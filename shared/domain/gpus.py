"""GPU catalog (public datasheet figures) and the roofline throughput estimator.

Catalog keys are the lower-case GPU type names used everywhere in Hadar: ``k80``,
``p100``, ``v100``, ``t4``, ``t400``, ``a2000``, ``rtx3090``, ``rtx2080ti``, ``titanrtx``, ``a100``,
``l4``, ``h100``, ``h200``, plus ``cpu``, a pseudo-type with modest figures for agents
without CUDA. One key is one variant: the one named in its ``name`` (a K80 is ONE
GK210 die -- what CUDA and Gavel call a K80 GPU -- so it gets half the board's
figures). TFLOPS are dense (no structured-sparsity doubling) at the boost clock;
``fp16_tflops`` is the tensor-core FP16 rate with FP32 accumulation where the GPU has
tensor cores (what mixed-precision training uses), else its plain FP16 rate;
``tf32_tflops`` is the dense TF32 tensor-core rate on Ampere and later (0 before): what
FP32 convolutions run at under PyTorch's default ``cudnn.allow_tf32`` (JobFigures.tf32).

Guarantees:

* every catalog entry has positive compute, memory and bandwidth figures, and every
  real GPU a PCIe generation and lane count;
* :func:`estimate_steps_per_second` is non-decreasing in every hardware figure
  (TFLOPS, memory size, memory/PCIe/NVLink bandwidth) and returns 0.0 exactly when
  the job does not fit in the GPU's memory;
* :func:`normalize_gpu_name` maps a ``torch.cuda.get_device_name()`` string to a
  catalog key, or ``None`` for a GPU the catalog does not describe;
* :func:`emulation_slowdown` is >= 1 and non-increasing in the type's FP32 TFLOPS, for
  any reference type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # JobFigures lives with the job figures; only its fields are used here.
    from shared.domain.workloads import JobFigures

__all__ = [
    "GpuSpec", "CATALOG", "GPU_TYPES", "gpu_spec", "normalize_gpu_name", "StepEstimate",
    "emulation_reference", "emulation_slowdown",
    "estimate_step", "estimate_steps_per_second", "memory_needed_bytes",
    "TRAIN_FLOPS_FACTOR", "FP32_EFFICIENCY", "TENSOR_EFFICIENCY", "TF32_EFFICIENCY", "MEMORY_EFFICIENCY",
    "PCIE_EFFICIENCY", "LINK_EFFICIENCY", "HOST_SECONDS_PER_OP", "ALLREDUCE_HOP_LATENCY_S",
    "ACTIVATION_PASSES", "MIXED_ACTIVATION_SCALE", "CUDA_CONTEXT_BYTES", "USABLE_MEMORY_FRACTION",
]

# PCIe throughput per lane and direction after line encoding, GB/s.
_PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938}
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Public figures of one GPU type (see the module docstring for conventions)."""

    key: str
    name: str
    architecture: str
    fp32_tflops: float
    fp16_tflops: float
    tensor_cores: bool
    memory_gb: float           # marketed size, GiB
    memory_bw_gb_s: float
    pcie_gen: int              # 0 only for the cpu pseudo-type
    pcie_lanes: int
    nvlink_gb_s: float = 0.0   # per-GPU NVLink bandwidth, one direction; 0 = none
    tf32_tflops: float = 0.0   # dense TF32 tensor rate (Ampere and later); 0 = none
    # Fraction of the boost-clock peak sustained under continuous load: 1.0 unless the
    # board is known to run near its base clock (power-capped), see the K80 entry.
    sustained_clock_fraction: float = 1.0
    # Fraction of the FP32 lanes one instruction per scheduler per clock can fill: 1.0
    # except Kepler, whose SMX feeds 192 lanes from 4 schedulers (128 without dual issue).
    issue_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("fp32_tflops", "fp16_tflops", "memory_gb", "memory_bw_gb_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.key}: {name} must be positive")
        if not (0 < self.sustained_clock_fraction <= 1 and 0 < self.issue_fraction <= 1):
            raise ValueError(f"{self.key}: sustained_clock_fraction and issue_fraction must be in (0, 1]")
        if self.tf32_tflops < 0:
            raise ValueError(f"{self.key}: tf32_tflops must be non-negative")
        if self.pcie_gen not in (0, *_PCIE_LANE_GB_S) or self.pcie_lanes < 0 or self.nvlink_gb_s < 0:
            raise ValueError(f"{self.key}: bad interconnect figures")
        if (self.pcie_gen == 0) != (self.pcie_lanes == 0):
            raise ValueError(f"{self.key}: pcie_gen and pcie_lanes must both be 0 or both set")

    @property
    def pcie_gb_s(self) -> float:
        """Host link bandwidth, GB/s one direction (0 for the cpu pseudo-type)."""
        return _PCIE_LANE_GB_S.get(self.pcie_gen, 0.0) * self.pcie_lanes

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * _GIB)

    @property
    def peer_gb_s(self) -> float:
        """Bandwidth between workers on one node: the fastest path they have -- NVLink, PCIe,
        or for a device without PCIe (the cpu pseudo-type) host memory. Never lower when a
        figure is raised (a spec given NVLink but no PCIe keeps its host-memory path)."""
        host = self.memory_bw_gb_s if self.pcie_gen == 0 else 0.0
        return max(self.nvlink_gb_s, self.pcie_gb_s, host)


def _spec(**kw: Any) -> GpuSpec:
    return GpuSpec(**kw)


# Sources: NVIDIA datasheets and architecture whitepapers (Kepler GK210, Pascal GP100,
# Volta GV100, Turing TU102/TU104/TU117, Ampere GA100/GA102/GA106, Ada AD104, Hopper).
# tf32_tflops: the datasheets' TF32 tensor figure without the sparsity doubling (A100 156,
# A2000 15.6, RTX 3090 35.6, L4 60, H100/H200 SXM 494.7); Turing and older have no TF32.
_SPECS = (
    # Tesla K80, one GK210: 2496 cores x 875 MHz boost x 2 = 4.37 TFLOPS, 12 GiB, 240 GB/s.
    # The two dies share one 300 W board and sustain about the 562 MHz base clock under
    # training load (NVIDIA lists 5.6 TFLOPS per board at base, 8.73 at boost).
    # Both dies share one PCIe 3.0 x16 link through an on-board switch. Kepler SMX: 192
    # lanes, 4 warp schedulers; without dual issue 128 lanes are busy (Kepler whitepaper).
    _spec(key="k80", name="Tesla K80 (one GK210)", architecture="kepler", fp32_tflops=4.37,
          fp16_tflops=4.37, tensor_cores=False, memory_gb=12, memory_bw_gb_s=240,
          pcie_gen=3, pcie_lanes=16, sustained_clock_fraction=562 / 875, issue_fraction=128 / 192),
    _spec(key="p100", name="Tesla P100 PCIe 16GB", architecture="pascal", fp32_tflops=9.3,
          fp16_tflops=18.7, tensor_cores=False, memory_gb=16, memory_bw_gb_s=732,
          pcie_gen=3, pcie_lanes=16),
    _spec(key="v100", name="Tesla V100 SXM2 16GB", architecture="volta", fp32_tflops=15.7,
          fp16_tflops=125.0, tensor_cores=True, memory_gb=16, memory_bw_gb_s=900,
          pcie_gen=3, pcie_lanes=16, nvlink_gb_s=150),
    # T4 (70 W): the 1590 MHz boost is not held under load. NVIDIA's ResNet-50 (DeepLearningExamples
    # resnet50v1.5, NGC 21.03, inference at batch 128) gets 426 img/s FP32 / 1190 AMP on a T4 against
    # 1229 / 3249 on a V100: 0.43 / 0.15 of the T4's peaks where the V100 gets 0.64 / 0.21 of its own
    # (ratios 0.67 / 0.70), so the T4 runs at about 0.69 of the clock its datasheet peaks assume.
    _spec(key="t4", name="Tesla T4", architecture="turing", fp32_tflops=8.1,
          fp16_tflops=65.0, tensor_cores=True, memory_gb=16, memory_bw_gb_s=320,
          pcie_gen=3, pcie_lanes=16, sustained_clock_fraction=0.69),
    # T400 (TU117, 384 cores, 1425 MHz): no tensor cores, FP16 at twice the FP32 rate.
    _spec(key="t400", name="NVIDIA T400 2GB", architecture="turing", fp32_tflops=1.09,
          fp16_tflops=2.19, tensor_cores=False, memory_gb=2, memory_bw_gb_s=80,
          pcie_gen=3, pcie_lanes=16),
    # RTX A2000 (GA106, 104 tensor cores, 1200 MHz): 63.9 TFLOPS sparse = 31.9 dense.
    _spec(key="a2000", name="NVIDIA RTX A2000 6GB", architecture="ampere", fp32_tflops=8.0,
          fp16_tflops=31.9, tensor_cores=True, memory_gb=6, memory_bw_gb_s=288,
          pcie_gen=4, pcie_lanes=16, tf32_tflops=15.6),
    # GeForce RTX 3090: FP16 tensor with FP32 accumulate runs at half the FP16-accumulate
    # rate on GeForce parts (GA102 whitepaper: 71 dense). NVLink bridge not assumed.
    _spec(key="rtx3090", name="NVIDIA GeForce RTX 3090", architecture="ampere",
          fp32_tflops=35.6, fp16_tflops=71.0, tensor_cores=True, memory_gb=24,
          memory_bw_gb_s=936, pcie_gen=4, pcie_lanes=16, tf32_tflops=35.6),
    # GeForce RTX 2080 Ti (TU102, 4352 cores, 1545 MHz reference boost): 13.4 TFLOPS FP32;
    # 544 tensor cores give 107.6 FP16-accumulate, half that (53.8) with FP32 accumulate on
    # GeForce parts (Turing whitepaper). 11 GB GDDR6 at 616 GB/s. The GPU of Sia's "rtx" nodes.
    _spec(key="rtx2080ti", name="NVIDIA GeForce RTX 2080 Ti", architecture="turing",
          fp32_tflops=13.4, fp16_tflops=53.8, tensor_cores=True, memory_gb=11,
          memory_bw_gb_s=616, pcie_gen=3, pcie_lanes=16),
    _spec(key="titanrtx", name="NVIDIA TITAN RTX", architecture="turing", fp32_tflops=16.3,
          fp16_tflops=130.5, tensor_cores=True, memory_gb=24, memory_bw_gb_s=672,
          pcie_gen=3, pcie_lanes=16),
    _spec(key="a100", name="NVIDIA A100 SXM4 80GB", architecture="ampere", fp32_tflops=19.5,
          fp16_tflops=312.0, tensor_cores=True, memory_gb=80, memory_bw_gb_s=2039,
          pcie_gen=4, pcie_lanes=16, nvlink_gb_s=300, tf32_tflops=156.0),
    _spec(key="l4", name="NVIDIA L4", architecture="ada", fp32_tflops=30.3,
          fp16_tflops=121.0, tensor_cores=True, memory_gb=24, memory_bw_gb_s=300,
          pcie_gen=4, pcie_lanes=16, tf32_tflops=60.0),
    _spec(key="h100", name="NVIDIA H100 SXM5 80GB", architecture="hopper", fp32_tflops=67.0,
          fp16_tflops=989.0, tensor_cores=True, memory_gb=80, memory_bw_gb_s=3350,
          pcie_gen=5, pcie_lanes=16, nvlink_gb_s=450, tf32_tflops=494.7),
    _spec(key="h200", name="NVIDIA H200 SXM 141GB", architecture="hopper", fp32_tflops=67.0,
          fp16_tflops=989.0, tensor_cores=True, memory_gb=141, memory_bw_gb_s=4800,
          pcie_gen=5, pcie_lanes=16, nvlink_gb_s=450, tf32_tflops=494.7),
    # Pseudo-type for agents without CUDA: a many-core server CPU, order of magnitude only.
    _spec(key="cpu", name="CPU (no CUDA)", architecture="cpu", fp32_tflops=0.5,
          fp16_tflops=0.5, tensor_cores=False, memory_gb=64, memory_bw_gb_s=50,
          pcie_gen=0, pcie_lanes=0),
)

CATALOG: MappingProxyType[str, GpuSpec] = MappingProxyType({s.key: s for s in _SPECS})
# The real GPU types (every catalog key but the cpu pseudo-type).
GPU_TYPES: tuple[str, ...] = tuple(s.key for s in _SPECS if s.key != "cpu")


def gpu_spec(gpu_type: str) -> GpuSpec:
    """The catalog entry for ``gpu_type``; ``ValueError`` naming the valid keys if unknown."""
    try:
        return CATALOG[gpu_type]
    except KeyError:
        raise ValueError(f"unknown GPU type {gpu_type!r}; known: {', '.join(CATALOG)}") from None


# Ordered: the first pattern that matches the lower-cased device name wins. Suffixes a
# catalog key does not cover (3090 Ti, A100 40GB vs 80GB, PCIe vs SXM) are judged: a Ti is
# a different GPU (None); memory and form-factor variants map to the family's key.
_NAME_PATTERNS: tuple[tuple[re.Pattern[str], str | None], ...] = tuple(
    (re.compile(p), key) for p, key in (
        (r"\b3090\s*ti\b", None),
        (r"\bh200\b", "h200"),
        (r"\bh100\b", "h100"),
        (r"\ba100\b", "a100"),
        (r"\bl4\b", "l4"),
        (r"\bv100", "v100"),
        (r"\bp100\b", "p100"),
        (r"\bk80\b", "k80"),
        (r"\bt400\b", "t400"),
        (r"\bt4\b", "t4"),
        (r"\ba2000\b", "a2000"),
        (r"\brtx\s*3090\b", "rtx3090"),
        (r"\b2080\s*ti\b", "rtx2080ti"),
        (r"\btitan\s*rtx\b", "titanrtx"),
        (r"^cpu$", "cpu"),
    )
)


def normalize_gpu_name(device_name: str) -> str | None:
    """Catalog key for a CUDA device name (e.g. "Tesla V100-SXM2-16GB" -> "v100"), or None."""
    lowered = " ".join(device_name.lower().replace("_", " ").split())
    for pattern, key in _NAME_PATTERNS:
        if pattern.search(lowered):
            return key
    return None


# ----------------------------------------------------------------------------- emulation

def emulation_reference(reference: str | None = None) -> str:
    """The type an emulated GPU runs at full CPU speed: ``reference``, or when it is None or
    empty the fastest real GPU type by FP32 TFLOPS; ``ValueError`` naming the valid types."""
    if not reference:
        return max(GPU_TYPES, key=lambda t: CATALOG[t].fp32_tflops)
    if reference not in GPU_TYPES:
        raise ValueError(f"emulation reference: unknown GPU type {reference!r}; valid: {', '.join(GPU_TYPES)}")
    return reference


def emulation_slowdown(gpu_type: str, reference: str | None = None) -> float:
    """How many times longer than the CPU's own step an emulated ``gpu_type`` step takes.

    ``max(1, fp32_tflops(reference) / fp32_tflops(gpu_type))`` with the reference of
    :func:`emulation_reference`: every type slower than the reference is throttled in
    proportion, none runs faster than the CPU itself. The agent throttles its workers by
    it and the profiler re-estimates emulated types by it, so both must use the same
    reference.
    """
    return max(1.0, CATALOG[emulation_reference(reference)].fp32_tflops / CATALOG[gpu_type].fp32_tflops)


# ----------------------------------------------------------------------------- estimator

TRAIN_FLOPS_FACTOR = 3.0        # forward + backward (2x forward: input and weight grads)
FP32_EFFICIENCY = 0.5           # achieved / peak for cuDNN/cuBLAS FP32 training kernels
TENSOR_EFFICIENCY = 0.25        # achieved / dense tensor peak, mixed precision (NVIDIA's
#                                 published ResNet-50 AMP rates: ~0.26 V100, ~0.21 A100)
TF32_EFFICIENCY = 0.15          # achieved / dense TF32 peak: TF32 keeps FP32 activations (twice
#                                 the bytes) and its non-GEMM layers on CUDA cores. NVIDIA's
#                                 ResNet-50 trains at 938 img/s in TF32 on one A100 (resnet50v1.5
#                                 README, NGC 21.03): 938 x 3 x 8.18 GFLOP / 156 TFLOPS = 0.15
MEMORY_EFFICIENCY = 0.7         # achieved / peak DRAM bandwidth for streaming kernels
PCIE_EFFICIENCY = 0.7           # achieved / peak host-to-device copy bandwidth
LINK_EFFICIENCY = 0.7           # achieved / peak bandwidth of a ring allreduce
HOST_SECONDS_PER_OP = 25e-6     # eager-framework dispatch + launch + autograd cost per op
ALLREDUCE_HOP_LATENCY_S = 10e-6  # per ring step; a ring allreduce takes 2(n-1) steps
ACTIVATION_PASSES = 3.0         # activation bytes written forward, read back, grads written
MIXED_ACTIVATION_SCALE = 0.5    # activations stored in FP16 under mixed precision
CUDA_CONTEXT_BYTES = 500_000_000  # CUDA context, cuDNN/cuBLAS workspaces, allocator slack
USABLE_MEMORY_FRACTION = 0.95   # of the marketed size (ECC, driver reservations)
_FP32 = 4
_FP16 = 2


@dataclass(frozen=True, kw_only=True)
class StepEstimate:
    """One worker's estimated training step on one GPU type, in seconds per term."""

    fits: bool
    compute_s: float
    memory_s: float
    dispatch_s: float
    input_s: float
    host_s: float
    sync_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.dispatch_s + self.input_s + self.host_s + self.sync_s


def memory_needed_bytes(job: JobFigures, n: int = 1) -> int:
    """GPU memory one worker needs: context + weights, grads, optimizer state + activations.

    With ``n > 1`` workers, data-parallel training also holds one FP32 gradient bucket
    copy per parameter for the allreduce.
    """
    per_param = _FP32 * (2 + job.optimizer_slots) + (_FP16 if job.mixed_precision else 0)
    if n > 1:
        per_param += _FP32
    act_scale = MIXED_ACTIVATION_SCALE if job.mixed_precision else 1.0
    activations = job.batch_size * job.activation_bytes_per_sample * act_scale
    return int(CUDA_CONTEXT_BYTES + job.params * per_param + activations)


def estimate_step(spec: GpuSpec, job: JobFigures, n: int = 1) -> StepEstimate:
    """Roofline estimate of one data-parallel worker's step (``n`` workers, one node).

    With ``B`` = per-worker batch, ``F`` = forward FLOPs per sample, ``P`` = parameters,
    ``A`` = activation bytes per sample (FP32), ``s`` = slots of optimizer state:

    * compute_s = TRAIN_FLOPS_FACTOR * F * B / (peak * eff * sustained_clock_fraction
      * issue_fraction),
      where peak * eff = fp16_tflops * TENSOR_EFFICIENCY for a mixed-precision job on a GPU
      with tensor cores; for a TF32 job (``job.tf32``) the larger of fp32_tflops *
      FP32_EFFICIENCY and tf32_tflops * TF32_EFFICIENCY (never slower than plain FP32);
      else fp32_tflops * FP32_EFFICIENCY;
    * memory_s = (P * 4 * (6 + 2s) + ACTIVATION_PASSES * B * A') / (bandwidth *
      MEMORY_EFFICIENCY): weights read forward and backward, grads written, the
      optimizer reading weights, grads and state and writing weights and state;
      A' = A (halved under mixed precision);
    * dispatch_s = ops_per_step * HOST_SECONDS_PER_OP: eager frameworks synchronise
      often enough (loss.item(), .cpu()) that launch overhead is charged, not hidden;
    * input_s = (B * input_bytes_per_sample + host_bytes_per_step) / (PCIe * PCIE_EFFICIENCY),
      zero for the cpu pseudo-type (data already in host memory);
    * host_s = B * host_seconds_per_sample + host_seconds_per_step: CPU work on the
      step's critical path (loaders without worker processes, RL environments);
    * sync_s (n > 1) = 2(n-1)/n * 4P / (peer bandwidth * LINK_EFFICIENCY)
      + 2(n-1) * ALLREDUCE_HOP_LATENCY_S: a ring allreduce of FP32 gradients over
      the faster of NVLink and PCIe;
    * step_s = max(compute_s, memory_s) + dispatch_s + input_s + host_s + sync_s.

    ``fits`` is False when :func:`memory_needed_bytes` exceeds
    USABLE_MEMORY_FRACTION of the GPU's memory.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    b = job.batch_size
    if job.mixed_precision and spec.tensor_cores:
        achieved = spec.fp16_tflops * TENSOR_EFFICIENCY
    elif job.tf32:
        achieved = max(spec.fp32_tflops * FP32_EFFICIENCY, spec.tf32_tflops * TF32_EFFICIENCY)
    else:
        achieved = spec.fp32_tflops * FP32_EFFICIENCY
    flops = TRAIN_FLOPS_FACTOR * job.flops_per_sample * b
    compute_s = flops / (achieved * 1e12 * spec.sustained_clock_fraction * spec.issue_fraction)
    act_scale = MIXED_ACTIVATION_SCALE if job.mixed_precision else 1.0
    moved: float = job.params * _FP32 * (6 + 2 * job.optimizer_slots)
    moved += ACTIVATION_PASSES * b * job.activation_bytes_per_sample * act_scale
    memory_s = moved / (spec.memory_bw_gb_s * 1e9 * MEMORY_EFFICIENCY)
    dispatch_s = job.ops_per_step * HOST_SECONDS_PER_OP
    host_bytes = b * job.input_bytes_per_sample + job.host_bytes_per_step
    input_s = host_bytes / (spec.pcie_gb_s * 1e9 * PCIE_EFFICIENCY) if spec.pcie_gb_s else 0.0
    host_s = b * job.host_seconds_per_sample + job.host_seconds_per_step
    sync_s = 0.0
    if n > 1:
        ring = 2 * (n - 1) / n * job.params * _FP32
        sync_s = ring / (spec.peer_gb_s * 1e9 * LINK_EFFICIENCY) + 2 * (n - 1) * ALLREDUCE_HOP_LATENCY_S
    fits = memory_needed_bytes(job, n) <= USABLE_MEMORY_FRACTION * spec.memory_bytes
    return StepEstimate(fits=fits, compute_s=compute_s, memory_s=memory_s, dispatch_s=dispatch_s,
                        input_s=input_s, host_s=host_s, sync_s=sync_s)


def estimate_steps_per_second(spec: GpuSpec, job: JobFigures, n: int = 1) -> float:
    """Whole job's steps/s on ``n`` GPUs of ``spec``'s type on one node; 0.0 if it does not fit.

    As in Gavel's table, a step is one worker's minibatch of ``job.batch_size`` samples,
    so ``n`` workers together make ``n / step_s`` steps per second (see :func:`estimate_step`).
    """
    est = estimate_step(spec, job, n)
    return n / est.step_s if est.fits else 0.0
