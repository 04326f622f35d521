"""The profiler's estimate and its measurements are in one unit (issue 11): a copy's own
steps per second on ``workers`` GPUs, as the agent counts steps and the scheduler's
ThroughputModel plans with.

The agent reports ``samples_per_s = steps/s x per-worker batch x its world size``; the
roofline counts a step per worker (``n / step_s`` for n workers). For a W-worker job the
catalog estimate, the first measured sample and the step-count samples must agree.
"""

from __future__ import annotations

import pytest

from services.profiler.estimate import catalog_rates, job_figures_for
from services.profiler.state import ProfilerState
from services.scheduler.core.throughput import ThroughputModel
from shared.domain import gpus, workloads
from shared.wire.events import JobSpec, Progress

T0 = 1_700_000_000.0


def _spec(workers: int) -> JobSpec:
    return JobSpec(job_id="j1", user="u", model="ResNet-50", dataset="imagenet", batch_size=32, workers=workers,
                   iterations=1000)


def _progress(at: float, steps: int, samples_per_s: float, workers: int) -> Progress:
    return Progress(ts=at, source="agent", job_id="j1", round=0, copy=0, node_id="n1", gpu_type="v100",
                    workers=workers, steps_round=steps, steps_total=steps, samples_per_s=samples_per_s, loss=0.5)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_catalog_estimate_is_a_copys_steps_per_second_as_the_scheduler_fallback(workers: int) -> None:
    spec = _spec(workers)
    rates = catalog_rates(spec)
    per_worker = gpus.estimate_steps_per_second(gpus.gpu_spec("v100"), job_figures_for(spec), workers)
    assert rates["v100"] == pytest.approx(per_worker / workers)
    fallback = workloads.calibrated_fallback(ThroughputModel(rates={}))
    assert rates["v100"] == pytest.approx(fallback(spec.job_type, "v100", workers))


@pytest.mark.parametrize("workers", [2, 4])
def test_an_agent_running_at_the_estimate_is_measured_at_the_estimate(workers: int) -> None:
    spec = _spec(workers)
    estimate = catalog_rates(spec)["v100"]
    samples_per_s = estimate * spec.batch_size * workers     # what the agent reports at that rate
    state = ProfilerState(alpha=1.0, threshold=0.0)
    state.add_job(spec)
    first = state.observe(_progress(T0, 0, samples_per_s, workers))
    assert first is not None and first.rate == pytest.approx(estimate)
    second = state.observe(_progress(T0 + 100, round(estimate * 100), samples_per_s, workers))
    assert second is not None and second.rate == pytest.approx(estimate, rel=0.01)
