"""Emulated GPUs: a CPU machine standing in for GPUs of named types (development, demos).

``--emulate v100:2,k80:2`` gives a node four devices, indices 0..3 in the order named.
Each emulated device runs its worker on the CPU and throttles every step so that its step
rate relative to the other types follows the GPU catalog's FP32 TFLOPS, by
:func:`shared.domain.gpus.emulation_slowdown`:

    slowdown(type) = reference_tflops / fp32_tflops(type)      (>= 1)

where the reference (``--emulate-reference``) defaults to the fastest type in the catalog,
so that every type is throttled (a CPU cannot run faster than itself) and nodes that
emulate different types agree on the same scale without coordinating. A worker for type
T sleeps after each step for (slowdown(T) - 1) times the step's own duration. Everything
an emulating agent produces (events, metrics) says ``emulated``, and its Progress events
name a non-default reference, so that the profiler scales by the same slowdowns.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.domain.gpus import CATALOG, GPU_TYPES, emulation_slowdown
from shared.wire.events import GpuInfo

__all__ = ["EmulatedGpu", "parse_emulation", "emulated_gpus"]

MAX_EMULATED = 64


@dataclass(frozen=True, kw_only=True)
class EmulatedGpu:
    info: GpuInfo
    slowdown: float


def parse_emulation(text: str) -> tuple[tuple[str, int], ...]:
    """``TYPE:N[,TYPE:N...]`` -> ((type, n), ...); ValueError names the valid types."""
    items: list[tuple[str, int]] = []
    for part in text.split(","):
        gpu_type, sep, count = part.strip().partition(":")
        gpu_type = gpu_type.strip().lower()
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"{part.strip()!r} is not TYPE:N with N >= 1")
        if gpu_type not in GPU_TYPES:
            raise ValueError(f"unknown GPU type {gpu_type!r}; valid: {', '.join(GPU_TYPES)}")
        items.append((gpu_type, int(count)))
    if sum(n for _, n in items) > MAX_EMULATED:
        raise ValueError(f"at most {MAX_EMULATED} devices")
    return tuple(items)


def emulated_gpus(spec: tuple[tuple[str, int], ...], reference: str | None = None) -> tuple[EmulatedGpu, ...]:
    """Devices of an emulating node, indexed 0.. in the order ``spec`` names them."""
    devices: list[EmulatedGpu] = []
    for gpu_type, count in spec:
        for _ in range(count):
            info = GpuInfo(index=len(devices), type=gpu_type, memory_gb=CATALOG[gpu_type].memory_gb)
            devices.append(EmulatedGpu(info=info, slowdown=emulation_slowdown(gpu_type, reference)))
    return tuple(devices)
