"""Catalog estimate of a job's steps/s on every GPU type, before it has run anywhere.

Job figures come from the model zoo (:func:`shared.zoo.job_figures`: counted FLOPs and
parameters of the job's model at its batch size and optimizer) or, for a job named after
a Gavel table workload (``ResNet-50`` at batch 32 ...), from :func:`shared.domain.workloads.figures_for`.
A job of user code (``spec.code``) is never left without figures: its ``hint`` names a zoo
family whose figures stand for it, else a nominal mid-size job's (ResNet-18's, at the job's
batch size) -- a *provisional* estimate that places the job before it was measured. A job's
measurement on a real GPU type re-anchors every other type at the catalog's ratios, for user
code and the zoo alike (:func:`anchored_rates`). Hardware figures and the roofline are
:mod:`shared.domain.gpus`. The rate on each type is a copy's own steps/s on ``spec.workers``
GPUs of that type on one node (0.0 where the job does not fit) -- with all W workers, the
whole job's -- which is what ThroughputEstimate carries, the agent measures and the
scheduler plans with. The roofline counts a step per
worker (``n / step_s`` for n workers, as Gavel's table), so its figure is divided by W,
as :func:`shared.domain.workloads.calibrated_fallback` does (docs/architecture.md "Work accounting").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from shared import zoo
from shared.domain import gpus, workloads
from shared.wire.events import DEFAULT_OPTIMIZER_SLOTS, MAX_MODEL_BYTES, MAX_OPTIMIZER_SLOTS, JobSpec

__all__ = ["Sizer", "catalog_rates", "checkpoint_size", "emulated_rates", "job_figures_for", "size_or_unknown",
           "anchored_rates", "on_emulated_types", "NOMINAL_JOB"]

NOMINAL_JOB = "ResNet-18 (batch size 32)"   # what a job of user code without a usable hint is taken for

Sizer = Callable[[JobSpec], tuple[int, int]]   # (model_bytes, optimizer_slots); ValueError: unknown


def job_figures_for(spec: JobSpec) -> workloads.JobFigures:
    """The estimator's figures for ``spec``; ``ValueError`` if neither zoo nor table knows it
    (never for user code: see the module docstring)."""
    if spec.code is not None:
        if spec.code.hint:
            try:
                return replace(zoo.job_figures(spec.code.hint, spec.batch_size, None, spec.hyper.optimizer),
                               family=f"provisional:{spec.code.hint}")
            except ValueError:
                pass
        return replace(workloads.figures_for(NOMINAL_JOB), batch_size=spec.batch_size, family="provisional")
    try:
        return zoo.job_figures(spec.model, spec.batch_size, spec.dataset, spec.hyper.optimizer)
    except ValueError as zoo_error:
        try:
            return workloads.figures_for(spec.job_type)
        except ValueError:
            raise ValueError(f"no figures for model {spec.model!r}: {zoo_error}"[:300]) from None


def checkpoint_size(spec: JobSpec) -> tuple[int, int]:
    """``(model_bytes, optimizer_slots)`` of ``spec``'s checkpoint, what HadarE charges for
    consolidating its forked copies (``shared.domain.fork_cost``): FP32 weights, 4 bytes per
    parameter as ``shared.domain.workloads.model_bytes`` counts them for the simulator, and the
    optimizer's state tensors per parameter. ``ValueError`` as :func:`job_figures_for`."""
    figures = job_figures_for(spec)
    return figures.params * 4, figures.optimizer_slots


def size_or_unknown(sizer: Sizer, spec: JobSpec) -> tuple[int, int]:
    """The job's checkpoint size, or 0 bytes (charged nothing) for a model without figures
    whose rates a custom estimator still gave, or one beyond the event's bounds."""
    try:
        model_bytes, slots = sizer(spec)
    except ValueError:
        return 0, DEFAULT_OPTIMIZER_SLOTS
    if not (0 <= model_bytes <= MAX_MODEL_BYTES and 0 <= slots <= MAX_OPTIMIZER_SLOTS):
        return 0, DEFAULT_OPTIMIZER_SLOTS
    return model_bytes, slots


def catalog_rates(spec: JobSpec) -> dict[str, float]:
    """``{gpu_type: steps/s}`` for every real GPU type of the catalog. Blocking (counts FLOPs)."""
    figures = job_figures_for(spec)
    rates = {}
    for gpu_type in gpus.GPU_TYPES:
        rate = gpus.estimate_steps_per_second(gpus.gpu_spec(gpu_type), figures, spec.workers) / spec.workers
        rates[gpu_type] = rate if math.isfinite(rate) and rate > 0 else 0.0
    return rates


def emulated_rates(gpu_type: str, rate: float, reference: str = "") -> dict[str, float]:
    """Every catalog type's rate implied by ``rate`` measured on an *emulated* ``gpu_type``.

    An emulated GPU is the agent's CPU throttled by
    :func:`shared.domain.gpus.emulation_slowdown` relative to the agent's emulation
    ``reference`` (as its Progress names it; "" = the catalog's default), so one
    measurement fixes the job's speed on every emulated type:
    ``rate x slowdown(gpu_type) / slowdown(t)``. The catalog estimate describes real GPUs
    and says nothing about a throttled CPU, so on an emulated cluster this is the better
    estimate for the types not measured yet. ``ValueError`` for an unknown reference.
    """
    cpu_rate = rate * gpus.emulation_slowdown(gpu_type, reference)
    return {t: cpu_rate / gpus.emulation_slowdown(t, reference) for t in gpus.GPU_TYPES if t != gpu_type}


def on_emulated_types(rates: Mapping[str, float], emulated: Mapping[str, str]) -> dict[str, float]:
    """A job's first estimate on a cluster where the GPU types ``emulated`` (type -> the
    reference its nodes throttle by, "" = the catalog's default) are emulated: each gets the
    catalog's rate of its reference divided by its slowdown, so the ratios between emulated
    types are the emulation's exact ones (the catalog's describe real GPUs: a launch-bound
    LSTM is equally fast on every one of them, not on throttled CPUs); the level is the
    catalog's until the first measurement re-estimates them (:func:`emulated_rates`). Real
    types, and an emulated type whose reference is unknown or does not run the job, keep
    ``rates``."""
    out = dict(rates)
    for gpu_type, reference in emulated.items():
        if gpu_type not in gpus.GPU_TYPES:
            continue
        try:
            base = rates.get(gpus.emulation_reference(reference or None), 0.0)
            slowdown = gpus.emulation_slowdown(gpu_type, reference or None)
        except ValueError:
            continue
        if base > 0:
            out[gpu_type] = base / slowdown
    return out


def anchored_rates(estimate: Mapping[str, float], gpu_type: str, rate: float) -> dict[str, float]:
    """Every other type's rate of a job from ``rate`` measured on ``gpu_type``: the measurement
    times ``estimate``'s ratio of the two types (``estimate``: the job's rates on each type for
    the measured copy's workers). Empty if the estimate does not run the job on ``gpu_type``.

    Against Sia's measured step times (``benchmarks/estimator_sia.py``) the catalog's rates
    alone are off by 77% on average and, anchored on one measured type, by 37%: what a job
    spends outside the GPU (data loading, framework overhead) is in its measurement, and
    mostly carries over to the other types."""
    base = estimate.get(gpu_type, 0.0)
    if not (math.isfinite(base) and base > 0):
        return {}
    return {t: rate * r / base for t, r in estimate.items() if t != gpu_type}
