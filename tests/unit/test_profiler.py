"""Profiler: EWMA of measured rates, the 5% publish threshold, catalog estimates, the service."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.profiler.estimate import (
    catalog_rates,
    checkpoint_size,
    emulated_rates,
    job_figures_for,
    on_emulated_types,
)
from services.profiler.service import ProfilerConfig, ProfilerService
from services.profiler.state import ProfilerState
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain import gpus, workloads
from shared.wire.events import (
    GpuInfo,
    Hyperparameters,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    Progress,
    ThroughputEstimate,
)
from shared.wire.topics import THROUGHPUT

T0 = 1_700_000_000.0
SPEC = JobSpec(job_id="j1", user="u", model="resnet", dataset="digits", batch_size=32, workers=2,
               iterations=1000)


def progress(at: float, steps: int, *, round_: int = 0, copy: int = 0, samples_per_s: float = 0.0,
             gpu: str = "v100", workers: int = 2, emulated: bool = False, job: str = "j1") -> Progress:
    return Progress(ts=at, source="agent", job_id=job, round=round_, copy=copy, node_id="n1", gpu_type=gpu,
                    workers=workers, steps_round=steps, steps_total=steps, samples_per_s=samples_per_s,
                    loss=0.5, emulated=emulated)


def test_rates_from_successive_progress_are_smoothed_by_ewma() -> None:
    state = ProfilerState(alpha=0.5, threshold=0.0)
    assert state.observe(progress(T0, 0)) is None  # no batch-size fallback without samples_per_s
    first = state.observe(progress(T0 + 10, 100))   # 10 steps/s
    assert first is not None and first.rate == pytest.approx(10.0)
    assert (first.job_id, first.gpu_type, first.workers) == ("j1", "v100", 2)
    second = state.observe(progress(T0 + 20, 300))  # 20 steps/s -> 0.5 * 20 + 0.5 * 10
    assert second is not None and second.rate == pytest.approx(15.0)
    assert state.rate("j1", "v100", 2) == pytest.approx(15.0)


def test_published_only_when_the_rate_moves_more_than_five_percent() -> None:
    state = ProfilerState(alpha=1.0)  # no smoothing: the EWMA is the last sample
    state.observe(progress(T0, 0))
    assert state.observe(progress(T0 + 10, 1000)).rate == pytest.approx(100.0)
    assert state.observe(progress(T0 + 20, 2040)) is None        # 104: within 5% of 100
    assert state.observe(progress(T0 + 30, 2990)) is None        # 95: within 5%
    moved = state.observe(progress(T0 + 40, 4050))               # 106: more than 5%
    assert moved is not None and moved.rate == pytest.approx(106.0)
    assert state.observe(progress(T0 + 50, 5060)) is None        # 101 vs last published 106: 4.7%


def test_first_report_of_a_copy_uses_samples_per_second_over_its_copys_batch() -> None:
    state = ProfilerState()
    assert state.observe(progress(T0, 5, samples_per_s=640.0)) is None  # job unknown: no batch size
    state.add_job(SPEC)
    update = state.observe(progress(T0, 5, copy=1, samples_per_s=640.0))
    # 640 samples/s of a copy on 2 workers of batch 32 (issue 11: not / 32 alone, a step per worker)
    assert update is not None and update.rate == pytest.approx(10.0)


def test_repeats_older_reports_and_round_changes_give_no_bogus_samples() -> None:
    state = ProfilerState(alpha=1.0, threshold=0.0)
    state.observe(progress(T0, 0))
    state.observe(progress(T0 + 10, 100))
    assert state.observe(progress(T0 + 10, 100)) is None   # the same report again
    assert state.observe(progress(T0 + 5, 40)) is None     # an older one
    assert state.observe(progress(T0 + 400, 7, round_=1)) is None  # new round: a new baseline
    update = state.observe(progress(T0 + 410, 57, round_=1))
    assert update is not None and update.rate == pytest.approx(5.0)


def test_keys_are_per_job_gpu_type_and_workers() -> None:
    state = ProfilerState(alpha=1.0, threshold=0.0)
    for copy, (gpu, workers, rate) in enumerate((("v100", 2, 10), ("k80", 2, 3), ("v100", 4, 18))):
        state.observe(progress(T0, 0, gpu=gpu, workers=workers, copy=copy))
        state.observe(progress(T0 + 10, rate * 10, gpu=gpu, workers=workers, copy=copy))
    assert [state.rate("j1", g, w) for g, w in (("v100", 2), ("k80", 2), ("v100", 4))] == [10, 3, 18]


def test_seeding_from_a_published_measurement_resumes_without_republishing() -> None:
    state = ProfilerState(alpha=1.0)
    state.seed(ThroughputEstimate(ts=T0, source="profiler", job_id="j1", basis="measured", workers=2,
                                  rates={"v100": 50.0}))
    state.observe(progress(T0, 0))
    assert state.observe(progress(T0 + 10, 510)) is None  # 51 vs 50
    state.seed(ThroughputEstimate(ts=T0, source="profiler", job_id="j2", basis="estimate", workers=1,
                                  rates={"v100": 1.0}))
    assert not state.add_job(JobSpec(job_id="j2", user="u", model="resnet", dataset="digits", batch_size=8,
                                     workers=1, iterations=10))


def test_catalog_estimate_covers_every_gpu_type_and_prefers_faster_hardware() -> None:
    rates = catalog_rates(JobSpec(job_id="j", user="u", model="ResNet-50", dataset="imagenet",
                                  batch_size=32, workers=1, iterations=10))
    assert set(rates) == set(gpus.GPU_TYPES)
    assert all(r >= 0 for r in rates.values())
    assert rates["h100"] > rates["v100"] > rates["k80"] > 0


def test_catalog_estimate_refuses_an_unknown_model() -> None:
    with pytest.raises(ValueError, match="no figures"):
        catalog_rates(JobSpec(job_id="j", user="u", model="nonsense-model", dataset="digits", batch_size=8,
                              workers=1, iterations=10))


async def _estimates(bus: MemoryBus, predicate, timeout_s: float = 10.0) -> list[ThroughputEstimate]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [d.event async for d in bus.read(THROUGHPUT)]
        if predicate(found) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.02)


async def test_service_publishes_estimates_then_measurements_and_survives_a_restart() -> None:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    calls: list[str] = []

    def estimator(spec: JobSpec) -> dict[str, float]:
        calls.append(spec.job_id)
        return {"v100": 12.5, "k80": 2.0}

    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(T0),
                              estimator=estimator, sizer=lambda spec: (1000, 2))
    await service.start()
    try:
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0))
        await bus.publish(progress(T0 + 1, 0, emulated=True))
        await bus.publish(progress(T0 + 11, 80, emulated=True))
        found = await _estimates(bus, lambda es: len(es) >= 3)
        assert [(e.basis, e.workers, e.rates, e.model_bytes) for e in found[:2]] == [
            ("estimate", 2, {"v100": 12.5, "k80": 2.0}, 1000), ("measured", 2, {"v100": pytest.approx(8.0)}, 0)]
        # Measured on an emulated V100: every other type re-estimated by the emulation's slowdowns.
        derived = found[2]
        assert derived.basis == "estimate" and "v100" not in derived.rates
        assert derived.rates["k80"] == pytest.approx(emulated_rates("v100", 8.0)["k80"])
        assert service.registry.get_sample_value("hadar_profiler_progress_total", {"emulated": "true"}) == 2
        assert service.registry.get_sample_value(
            "hadar_profiler_estimates_published_total", {"basis": "measured", "emulated": "true"}) == 1
        assert service.health()["ok"]
    finally:
        await service.stop()

    # A restarted profiler (new group: it re-reads the job) must not estimate the job again.
    again = ProfilerService(bus=bus, config=ProfilerConfig(group="prof-2"), clock=FakeClock(T0),
                            estimator=estimator)
    await again.start()
    try:
        await bus.publish(progress(T0 + 21, 161))  # 8.1 steps/s: within 5% of the published 8.0
        await asyncio.sleep(0.2)
        assert len([d async for d in bus.read(THROUGHPUT)]) == 3
        assert calls == ["j1"]
    finally:
        await again.stop()
        await bus.stop()


async def test_service_counts_a_job_it_cannot_estimate() -> None:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()

    def estimator(spec: JobSpec) -> dict[str, float]:
        raise ValueError("no figures for model")

    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), estimator=estimator)
    await service.start()
    try:
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0))
        deadline = time.monotonic() + 5
        while service.registry.get_sample_value("hadar_profiler_estimate_failures_total") != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert [d async for d in bus.read(THROUGHPUT)] == []
    finally:
        await service.stop()
        await bus.stop()


async def test_service_publishes_the_checkpoint_size_with_the_estimate() -> None:
    # The live HadarE charges consolidation by the job's checkpoint: the profiler states it.
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    adam = JobSpec(job_id="j2", user="u", model="resnet", dataset="digits", batch_size=32, workers=1,
                   iterations=10, hyper=Hyperparameters(optimizer="adam"))
    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(T0),
                              estimator=lambda spec: {"v100": 3.0})
    await service.start()
    try:
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=adam, submitted_at=T0))
        await bus.publish(progress(T0 + 1, 0, job="j2", workers=1))
        await bus.publish(progress(T0 + 11, 40, job="j2", workers=1))
        # the default sizer counts the zoo model's figures (seconds on a loaded machine)
        found = await _estimates(bus, lambda es: len(es) >= 2, timeout_s=60.0)
        figures = job_figures_for(adam)
        assert checkpoint_size(adam) == (figures.params * 4, 2)
        assert [(e.basis, e.model_bytes, e.optimizer_slots) for e in found[:2]] == [
            ("estimate", figures.params * 4, 2), ("measured", 0, 1)]   # a measurement states no size
    finally:
        await service.stop()
        await bus.stop()


@pytest.mark.parametrize("size", [ValueError("no figures"), (2**50, 1), (10, 7), (-1, 1)])
async def test_an_unknown_or_implausible_size_is_published_as_none(size) -> None:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()

    def sizer(spec: JobSpec) -> tuple[int, int]:
        if isinstance(size, Exception):
            raise size
        return size

    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(T0),
                              estimator=lambda spec: {"v100": 3.0}, sizer=sizer)
    await service.start()
    try:
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0))
        found = await _estimates(bus, lambda es: len(es) >= 1)
        assert [(e.rates, e.model_bytes) for e in found] == [({"v100": 3.0}, 0)]
    finally:
        await service.stop()
        await bus.stop()


def test_checkpoint_size_of_a_table_workload_is_the_simulators():
    spec = JobSpec(job_id="j", user="u", model="ResNet-50", dataset="imagenet", batch_size=32, workers=1,
                   iterations=10)
    assert checkpoint_size(spec) == (workloads.model_bytes(spec.job_type), 1)


def test_a_rate_measured_on_an_emulated_gpu_re_estimates_every_other_type():
    rates = emulated_rates("t4", 10.0)
    assert "t4" not in rates and {"k80", "rtx3090", "h200"} <= set(rates)
    slowdown = gpus.emulation_slowdown
    assert rates["rtx3090"] == pytest.approx(10.0 * slowdown("t4") / slowdown("rtx3090"))
    assert rates["rtx3090"] > 10.0 > rates["k80"]     # faster and slower emulated types


def node(node_id: str, *types: str, emulated: bool, reference: str = "") -> NodeRegistered:
    return NodeRegistered(ts=T0, source="agent", node_id=node_id, emulated=emulated, emulation_reference=reference,
                          gpus=tuple(GpuInfo(index=i, type=t) for i, t in enumerate(types)))


def test_a_type_is_emulated_while_only_emulated_nodes_offer_it():
    state = ProfilerState()
    state.add_node(node("a", "t4", "k80", emulated=True, reference="v100"))
    state.add_node(node("b", "a100", emulated=True))
    assert state.emulated_types() == {"t4": "v100", "k80": "v100", "a100": ""}
    state.add_node(node("c", "k80", emulated=False))                 # a real K80 somewhere
    assert state.emulated_types() == {"t4": "v100", "a100": ""}
    state.add_node(node("a", "t4", emulated=False))                  # node a registered again, real now
    assert state.emulated_types() == {"a100": ""}


def test_the_first_estimate_on_emulated_types_has_the_emulations_ratios():
    # The catalog's LSTM is launch-bound: about equally fast on a K80 and an RTX 3090. Emulated,
    # the K80 is throttled far more; the first estimate must say so before any measurement.
    lstm = JobSpec(job_id="l", user="u", model="lstm", dataset="digits", batch_size=32, workers=1, iterations=100)
    catalog = catalog_rates(lstm)
    assert catalog["k80"] == pytest.approx(catalog["rtx3090"], rel=0.2)
    first = on_emulated_types(catalog, {"k80": "", "rtx3090": ""})
    slowdown = gpus.emulation_slowdown
    assert first["rtx3090"] / first["k80"] == pytest.approx(slowdown("k80") / slowdown("rtx3090"))
    assert first["k80"] == pytest.approx(catalog[gpus.emulation_reference()] / slowdown("k80"))
    assert first["v100"] == catalog["v100"]                           # not emulated: the catalog's
    assert on_emulated_types(catalog, {"k80": "no-such-gpu"}) == catalog   # an unknown reference: no scale


async def test_service_reads_nodes_and_estimates_emulated_types_by_their_slowdowns_after_a_restart_too() -> None:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    flat = dict.fromkeys(gpus.GPU_TYPES, 10.0)
    await bus.publish(node("n0", "k80", "t4", emulated=True, reference="a100"))
    await bus.publish(node("n1", "v100", emulated=False))
    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(T0),
                              estimator=lambda spec: dict(flat))
    await service.start()
    try:
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0))
        [first] = await _estimates(bus, lambda es: len(es) >= 1)
    finally:
        await service.stop()
    slowdown = gpus.emulation_slowdown
    assert first.rates["k80"] == pytest.approx(10.0 / slowdown("k80", "a100"))
    assert first.rates["t4"] == pytest.approx(10.0 / slowdown("t4", "a100"))
    assert first.rates["v100"] == 10.0 and first.rates["h100"] == 10.0     # real or absent: the catalog's
    # A restarted profiler knows the nodes from the log before it estimates the next job.
    again = ProfilerService(bus=bus, config=ProfilerConfig(group="prof-2"), clock=FakeClock(T0),
                            estimator=lambda spec: dict(flat))
    await again.start()
    try:
        assert again.state.emulated_types() == {"k80": "a100", "t4": "a100"}
    finally:
        await again.stop()
        await bus.stop()


def test_a_snapshot_from_before_nodes_were_kept_restores_with_none():
    from services.profiler.snapshot import capture, restore

    state = ProfilerState()
    del state.__dict__["_nodes"]                                      # as a snapshot written before them
    restored = restore(capture(state, {}, created_at=T0), alpha=0.3, threshold=0.05)
    assert restored.emulated_types() == {}
    restored.add_node(node("a", "k80", emulated=True))
    assert restored.emulated_types() == {"k80": ""}


async def test_a_jobs_first_real_measurement_re_estimates_every_other_real_type_at_the_estimates_ratio() -> None:
    # Against Sia's measured step times the catalog alone is off by 77% on average; anchored on
    # one measured type it is off by 37% (benchmarks/estimator_sia.py). So a zoo job, not only
    # user code, measured on a real V100 has every other real type re-estimated from it, at
    # the estimate's ratio for the measured copy's own workers; emulated types keep theirs.
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    await bus.publish(node("n0", "t4", emulated=True))
    seen: list[int] = []

    def estimator(spec: JobSpec) -> dict[str, float]:
        seen.append(spec.workers)
        return {"v100": 10.0, "k80": 2.0 if spec.workers == 2 else 4.0, "a100": 20.0, "t4": 5.0}

    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(T0),
                              estimator=estimator, sizer=lambda spec: (1000, 2))
    await service.start()
    try:
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0))
        await bus.publish(progress(T0 + 1, 0))
        await bus.publish(progress(T0 + 11, 80))                           # 8 steps/s on 2 V100s
        await bus.publish(progress(T0 + 1, 0, copy=1, workers=1))
        await bus.publish(progress(T0 + 11, 50, copy=1, workers=1))        # 5 steps/s on 1 V100
        found = await _estimates(bus, lambda es: len(es) >= 5)
    finally:
        await service.stop()
        await bus.stop()
    assert [(e.basis, e.workers) for e in found] == [("estimate", 2), ("measured", 2), ("estimate", 2),
                                                    ("measured", 1), ("estimate", 1)]
    assert found[2].rates == {"k80": pytest.approx(1.6), "a100": pytest.approx(16.0)}
    assert found[4].rates == {"k80": pytest.approx(2.0), "a100": pytest.approx(10.0)}
    assert seen == [2, 2, 1]
