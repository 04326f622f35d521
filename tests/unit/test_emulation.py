"""Emulated GPUs: the agent and the profiler scale by the same slowdowns, whatever the reference.

The agent throttles an emulated type by ``shared.domain.gpus.emulation_slowdown`` relative to its
``--emulate-reference``; its Progress names that reference, and the profiler re-estimates
the other emulated types from a measured rate by the same slowdowns.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from services.agent.daemon.discovery import NodeDevices, emulated_devices
from services.agent.daemon.metrics import AgentMetrics
from services.agent.daemon.process import WorkerPool
from services.agent.daemon.runner import CopyRun, RunContext
from services.agent.protocol import StoreTarget
from services.profiler.estimate import emulated_rates
from services.profiler.service import ProfilerConfig, ProfilerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.gpus import (
    CATALOG,
    GPU_TYPES,
    emulation_reference,
    emulation_slowdown,
)
from shared.wire.events import (
    Assignment,
    Event,
    JobSpec,
    JobSubmitted,
    Progress,
    ThroughputEstimate,
)

T0 = 1_700_000_000.0
SPEC = JobSpec(job_id="j1", user="u", model="resnet", dataset="digits", batch_size=32, workers=1, iterations=1000)
# Slower than the catalog's fastest type, so that it changes every faster type's slowdown.
REFERENCE = "v100"


def test_slowdowns_follow_the_catalog_relative_to_the_reference() -> None:
    fastest = max(GPU_TYPES, key=lambda t: CATALOG[t].fp32_tflops)
    assert emulation_reference() == emulation_reference("") == fastest
    assert emulation_slowdown("k80") == pytest.approx(CATALOG[fastest].fp32_tflops / CATALOG["k80"].fp32_tflops)
    assert emulation_slowdown("k80", REFERENCE) == pytest.approx(
        CATALOG[REFERENCE].fp32_tflops / CATALOG["k80"].fp32_tflops)
    assert emulation_slowdown("h100", REFERENCE) == emulation_slowdown(REFERENCE, REFERENCE) == 1.0
    assert emulation_slowdown(REFERENCE) > 1.0
    with pytest.raises(ValueError, match="unknown GPU type 'gtx480'"):
        emulation_slowdown("k80", "gtx480")


def test_emulated_devices_carry_their_reference() -> None:
    assert emulated_devices((("t4", 1),)).reference == ""
    devices = emulated_devices((("t4", 1),), REFERENCE)
    assert devices.reference == REFERENCE and devices.slowdown[0] == emulation_slowdown("t4", REFERENCE)
    assert NodeDevices.from_json(devices.to_json()) == devices


async def _agent_progress(devices: NodeDevices, gpu_type: str) -> Progress:
    """The Progress the agent's copy run publishes for one worker report on ``devices``."""
    published: list[Event] = []

    async def publish(event: Event) -> None:
        published.append(event)

    ctx = RunContext(node_id="n1", devices=devices, store=StoreTarget.local("/nonexistent"),
                     pool=WorkerPool(spares=0), clock=FakeClock(T0), publish=publish,
                     metrics=AgentMetrics(CollectorRegistry(), node_id="n1", emulated=devices.emulated),
                     progress_s=1.0, threads=1, stop_timeout_s=1.0, deadline_grace_s=1.0)
    assignment = Assignment(ts=T0, source="scheduler", round=0, job=SPEC, copy=0, node_id="n1", gpus=(0,),
                            gpu_type=gpu_type, world_size=1, ranks=(0,), step_budget=100, deadline=T0 + 60)
    await CopyRun(ctx, assignment)._progress({"steps_round": 10, "steps_total": 10, "samples_per_s": 320.0,
                                              "loss": 0.5})
    assert len(published) == 1 and isinstance(published[0], Progress)
    return published[0]


async def test_the_agent_names_its_reference_in_progress() -> None:
    default = await _agent_progress(emulated_devices((("k80", 1),)), "k80")
    assert default.emulated and default.emulation_reference == ""
    chosen = await _agent_progress(emulated_devices((("k80", 1),), REFERENCE), "k80")
    assert chosen.emulated and chosen.emulation_reference == REFERENCE


async def test_profiler_re_estimates_by_the_agents_slowdowns_for_a_non_default_reference() -> None:
    """The bug: the profiler scaled by the default reference's slowdowns, whatever the agent used."""
    measured_on = "k80"
    agent = emulated_devices(tuple((t, 1) for t in GPU_TYPES), REFERENCE)
    slowdown = {g.type: agent.slowdown[g.index] for g in agent.gpus}
    progress = await _agent_progress(emulated_devices(((measured_on, 1),), REFERENCE), measured_on)

    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(T0),
                              estimator=lambda spec: {measured_on: 1.0})
    await service.start()
    try:
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0))
        await bus.publish(progress)   # first report: samples_per_s / batch_size = 10 steps/s
        derived = await _derived_estimate(bus)
    finally:
        await service.stop()
        await bus.stop()
    rate = 320.0 / SPEC.batch_size
    expected = {t: rate * slowdown[measured_on] / slowdown[t] for t in GPU_TYPES if t != measured_on}
    assert derived.rates == pytest.approx(expected)
    assert derived.rates == pytest.approx(emulated_rates(measured_on, rate, REFERENCE))
    # With the default reference the faster types would come out faster than on the agent.
    assert emulated_rates(measured_on, rate)["h100"] > derived.rates["h100"] == pytest.approx(derived.rates["v100"])


async def _derived_estimate(bus: MemoryBus, timeout_s: float = 10.0) -> ThroughputEstimate:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in [d async for d in bus.read("hadar.throughput")]:
            event = d.event
            if isinstance(event, ThroughputEstimate) and event.basis == "estimate" and len(event.rates) > 1:
                return event
        await asyncio.sleep(0.02)
    raise AssertionError("the profiler published no re-estimate from the emulated measurement")
