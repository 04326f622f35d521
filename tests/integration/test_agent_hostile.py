"""The node agent against bad, forged and failing input (issue 12), on MemoryBus with fake workers.

Every copy here runs ``fake_worker.py`` (the worker protocol without torch), so a test
runs hundreds of assignments in seconds. What is checked is the daemon: which events it
believes, admits, refuses (dead letter + ``hadar_agent_events_rejected_total{reason}``),
how it delivers results through a broker outage, and that its consumer never dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from services.agent.daemon.discovery import cpu_devices
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from shared.bus import BusError, Delivery, MemoryBus
from shared.bus.memory import MemorySubscription
from shared.domain.layout import model_key
from shared.wire.events import (
    Assignment,
    CopyFinished,
    DeadLetter,
    Event,
    Hyperparameters,
    JobCancelled,
    JobSpec,
    RoundStarted,
)
from shared.wire.topics import DEADLETTER, PLACEMENTS, PROGRESS

NODE = "n1"


def spec(job_id: str, model: str = "resnet") -> JobSpec:
    return JobSpec(job_id=job_id, user="mallory", model=model, dataset="digits", batch_size=8, workers=1,
                   iterations=1000, hyper=Hyperparameters(optimizer="sgd", lr=0.1, seed=1))


def assign(job_id: str, round_: int, *, budget: int = 5, gpus: tuple[int, ...] = (0,), copy: int = 0,
           deadline: float | None = None, model: str = "resnet", **fields: Any) -> Assignment:
    values: dict[str, Any] = {"world_size": len(gpus), "ranks": tuple(range(len(gpus))), **fields}
    return Assignment(ts=time.time(), source="scheduler", round=round_, job=spec(job_id, model), copy=copy,
                      node_id=NODE,
                      gpus=gpus, gpu_type="cpu", step_budget=budget,
                      deadline=time.time() + 60 if deadline is None else deadline, **values)


def round_started(round_: int) -> RoundStarted:
    now = time.time()
    return RoundStarted(ts=now, source="scheduler", round=round_, policy="hadare", started_at=now, ends_at=now + 60)


class FlakyBus(MemoryBus):
    """A MemoryBus whose publishes fail (retriable) for ``outage_s`` from the first CopyFinished
    attempt, whose subscriptions can fail fetches, and which records when deliveries are acked."""

    def __init__(self, *, outage_s: float = 0.0) -> None:
        super().__init__()
        self.outage_s = outage_s
        self.down_until: float | None = None
        self.finished_at: dict[str, float] = {}     # job -> when its CopyFinished was published
        self.acked_at: dict[str, float] = {}        # job -> when its Assignment was acked
        self.failed_fetches = 0                     # fetches still to fail

    def _gate(self, event: Event) -> None:
        if isinstance(event, CopyFinished) and self.outage_s and self.down_until is None:
            self.down_until = time.monotonic() + self.outage_s
        if self.down_until is not None and time.monotonic() < self.down_until:
            raise BusError("broker away", retriable=True)

    def _published(self, event: Event) -> None:
        if isinstance(event, CopyFinished):
            self.finished_at.setdefault(event.job_id, time.monotonic())

    async def publish_pipelined(self, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        self._gate(event)   # publish goes through here too
        ack = await super().publish_pipelined(event, topic=topic, key=key)
        self._published(event)
        return ack

    def subscribe(self, topics: Any, group: str) -> MemorySubscription:
        bus = self

        class Recording(MemorySubscription):
            async def __anext__(self) -> Delivery:
                if bus.failed_fetches > 0:
                    bus.failed_fetches -= 1
                    raise BusError("fetch failed: broker away", retriable=True)
                delivery = await super().__anext__()
                if not isinstance(delivery.event, Assignment) or delivery._on_ack is None:
                    return delivery
                job_id, on_ack = delivery.event.job_id, delivery._on_ack

                def ack() -> None:
                    bus.acked_at.setdefault(job_id, time.monotonic())
                    on_ack()
                return dataclasses.replace(delivery, _on_ack=ack)

        sub = super().subscribe(topics, group)
        return Recording(self, sub.topics, sub.group)


async def started_agent(bus: MemoryBus, tmp_path: Path, python: str, *, gpus: int = 2,
                        **config: Any) -> AgentDaemon:
    settings: dict[str, Any] = {"progress_s": 0.2, "heartbeat_s": 0.5, "stop_timeout_s": 5.0, "spare_workers": 0,
                                "python": python, **config}
    agent = AgentDaemon(AgentConfig(node_id=NODE, **settings), bus=bus, store=StoreTarget.local(tmp_path),
                        devices=cpu_devices(gpus))
    await agent.start()
    return agent


@pytest.fixture
async def bus() -> AsyncIterator[MemoryBus]:
    memory = MemoryBus()
    await memory.start()
    yield memory
    await memory.stop()


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.05)


async def finished(bus: MemoryBus, job_id: str) -> list[CopyFinished]:
    return [d.event async for d in bus.read(PROGRESS) if isinstance(d.event, CopyFinished) and d.event.job_id == job_id]


async def wait_finished(bus: MemoryBus, job_id: str, timeout_s: float = 10.0) -> CopyFinished:
    async def done() -> bool:
        return bool(await finished(bus, job_id))
    await until(done, timeout_s, f"CopyFinished of {job_id}")
    return (await finished(bus, job_id))[0]


async def letters(bus: MemoryBus) -> list[DeadLetter]:
    return [d.event async for d in bus.read(DEADLETTER) if isinstance(d.event, DeadLetter)]


def rejected(agent: AgentDaemon, reason: str) -> float:
    value = agent.registry.get_sample_value("hadar_agent_events_rejected_total",
                                            {"node": NODE, "emulated": "false", "reason": reason})
    return value or 0.0


async def test_a_forged_far_round_does_not_make_real_assignments_stale(bus: MemoryBus, tmp_path: Path,
                                                                       fake_python: str) -> None:
    agent = await started_agent(bus, tmp_path, fake_python)
    try:
        await bus.publish(round_started(2**62))
        await bus.publish(assign("real1", 3))
        done = await wait_finished(bus, "real1")
        assert (done.status, done.round) == ("ok", 3)
        assert agent.health()["latest_round"] == 3
        # A forged Assignment for this node, far ahead of the believed round, is refused too.
        await bus.publish(assign("forged2", 2**61, gpus=(1,)))
        await until(lambda: _count(letters(bus), 2), what="two dead letters")
        refused = await letters(bus)
        assert all(d.topic == PLACEMENTS and "ahead" in d.reason for d in refused), [d.reason for d in refused]
        assert rejected(agent, "round_far_ahead") == 2
        assert not any(key[0] == "forged2" for key in agent.runs)
        assert agent.health()["latest_round"] == 3
    finally:
        await agent.stop()


async def _count(items: Awaitable[list[Any]], n: int) -> bool:
    return len(await items) >= n


async def test_a_flood_of_assignments_runs_at_most_one_copy_per_gpu(bus: MemoryBus, tmp_path: Path,
                                                                    fake_python: str) -> None:
    agent = await started_agent(bus, tmp_path, fake_python, gpus=1)
    try:
        for i in range(300):
            await bus.publish(assign(f"flood{i}", 0, budget=100_000))

        async def all_handled() -> bool:
            return len(agent.runs) + len(await letters(bus)) >= 300
        await until(all_handled, 20.0, "300 assignments handled")
        assert len(agent.runs) == 1, f"{len(agent.runs)} copies running on a 1-GPU node"
        refused = await letters(bus)
        assert len(refused) == 299 and all("GPU 0" in d.reason for d in refused)
        assert rejected(agent, "gpu_busy") == 299
    finally:
        await agent.stop()


BAD_RENDEZVOUS = ("tcp://10.0.0.1:29500", "10.0.0.1:29500/x", "host name:29500", "user@host:29500", "host:80",
                  "host:65536", "host", ":29500", "host:", "host:29500 ", "-host:29500", "host:+29500",
                  "999.1.1.1:29500", "[::1:29500", "host:029500", "h\nost:29500")


async def test_malformed_rendezvous_is_refused(bus: MemoryBus, tmp_path: Path, fake_python: str) -> None:
    agent = await started_agent(bus, tmp_path, fake_python)
    try:
        for i, bad in enumerate(BAD_RENDEZVOUS):
            await bus.publish(assign(f"rdv{i}", 0, world_size=2, rendezvous=bad))
        await until(lambda: _count(letters(bus), len(BAD_RENDEZVOUS)), what="every bad rendezvous dead-lettered")
        assert all("rendezvous" in d.reason for d in await letters(bus))
        assert rejected(agent, "rendezvous") == len(BAD_RENDEZVOUS)
        assert not agent.runs
        await bus.publish(assign("rdv-ok1", 0, world_size=2, rendezvous="node-b.example:29500"))
        await bus.publish(assign("rdv-ok2", 0, gpus=(1,), world_size=2, rendezvous="[::1]:29500"))
        assert (await wait_finished(bus, "rdv-ok1")).status == "ok"
        assert (await wait_finished(bus, "rdv-ok2")).status == "ok"
        assert len(await letters(bus)) == len(BAD_RENDEZVOUS)
    finally:
        await agent.stop()


async def test_implausible_assignments_are_refused(bus: MemoryBus, tmp_path: Path, fake_python: str) -> None:
    agent = await started_agent(bus, tmp_path, fake_python)
    bad = {
        "deadline": assign("far1", 0, deadline=1e12),
        "gpus": assign("nogpu1", 0, gpus=(3,)),
        "ranks": assign("ranks1", 0, gpus=(0, 1), ranks=(0, 0)),
        "start_from": assign("theft1", 1, start_from=model_key("someone-else", 0)),
    }
    twice = assign("twice1", 0, gpus=(0, 0))
    try:
        for event in (*bad.values(), twice):
            await bus.publish(event)
        await until(lambda: _count(letters(bus), len(bad) + 1), what="every implausible assignment dead-lettered")
        for reason in bad:
            assert rejected(agent, reason) == (1 if reason != "gpus" else 2), reason
        assert not agent.runs and not await finished(bus, "nogpu1")
        await bus.publish(assign("good1", 1, start_from=model_key("good1", 0), budget=3))
        assert (await wait_finished(bus, "good1")).status == "ok"
    finally:
        await agent.stop()


async def test_a_result_outlives_a_broker_outage_and_the_assignment_is_acked_after_it(
        tmp_path: Path, fake_python: str) -> None:
    bus = FlakyBus(outage_s=4.5)   # longer than the 3.5 s the agent used to retry for
    await bus.start()
    agent = await started_agent(bus, tmp_path, fake_python, result_retry_s=0.05, result_retry_max_s=0.3)
    try:
        await bus.publish(assign("outage1", 0, budget=5))
        done = await wait_finished(bus, "outage1", timeout_s=15.0)
        assert done.status == "ok"
        assert bus.down_until is not None and bus.finished_at["outage1"] >= bus.down_until

        async def acked() -> bool:
            return "outage1" in bus.acked_at
        await until(acked, what="the Assignment acked")
        assert bus.acked_at["outage1"] >= bus.finished_at["outage1"]
        retries = agent.registry.get_sample_value("hadar_agent_result_retries_total",
                                                  {"node": NODE, "emulated": "false"})
        assert retries is not None and retries >= 5
        assert agent.health()["ok"]
    finally:
        await agent.stop()
        await bus.stop()


async def test_stopping_during_an_outage_leaves_the_assignment_for_the_next_run(tmp_path: Path,
                                                                                fake_python: str) -> None:
    bus = FlakyBus(outage_s=3600.0)
    await bus.start()
    agent = await started_agent(bus, tmp_path, fake_python, stop_timeout_s=1.0, result_retry_s=0.05,
                                result_retry_max_s=0.2)
    try:
        await bus.publish(assign("restart1", 0, budget=3))
        await until(lambda: _is(bus.down_until is not None), what="the first CopyFinished attempt")
    finally:
        began = time.monotonic()
        await agent.stop()
    assert time.monotonic() - began < 5.0 and "restart1" not in bus.acked_at
    bus.down_until = time.monotonic()   # the broker is back
    again = await started_agent(bus, tmp_path, fake_python)
    try:
        assert (await wait_finished(bus, "restart1")).status == "ok"
    finally:
        await again.stop()
        await bus.stop()


async def _is(value: bool) -> bool:
    return value


class _Raising:
    """Delegates to the agent's handler table, except that JobCancelled's handler raises."""

    def handler_for(self, event: Event) -> Any:
        if isinstance(event, JobCancelled):
            def boom(*_: Any) -> bool:
                raise RuntimeError("handler bug")
            return boom
        return AgentDaemon.HANDLERS.handler_for(event)


async def test_a_handler_error_dead_letters_the_event_and_the_consumer_goes_on(
        bus: MemoryBus, tmp_path: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = await started_agent(bus, tmp_path, fake_python)
    monkeypatch.setattr(agent, "HANDLERS", _Raising())
    try:
        await bus.publish(JobCancelled(ts=time.time(), source="cli", job_id="victim1", reason="no"))
        await bus.publish(assign("after1", 0))
        assert (await wait_finished(bus, "after1")).status == "ok"
        [letter] = await letters(bus)
        assert "RuntimeError: handler bug" in letter.reason
        assert rejected(agent, "handler_error") == 1
        assert agent.health()["ok"]
    finally:
        await agent.stop()


async def test_a_failed_fetch_does_not_end_the_consumer(tmp_path: Path, fake_python: str) -> None:
    bus = FlakyBus()
    await bus.start()
    bus.failed_fetches = 2
    agent = await started_agent(bus, tmp_path, fake_python)
    try:
        await bus.publish(assign("fetch1", 0))
        assert (await wait_finished(bus, "fetch1")).status == "ok"
        assert agent.health()["ok"]
    finally:
        await agent.stop()
        await bus.stop()


async def test_a_restarted_agent_believes_the_rounds_on_the_log(bus: MemoryBus, tmp_path: Path,
                                                                fake_python: str) -> None:
    """The cluster is at round 5000 when this agent starts: it seeds its belief from the log,
    so none of those rounds is 'far ahead' and its own assignment of the round runs at once."""
    for round_ in (4998, 4999, 5000):
        await bus.publish(round_started(round_))
    agent = await started_agent(bus, tmp_path, fake_python)
    try:
        assert agent.latest_round == 5000
        await bus.publish(assign("mine1", 5000))
        assert (await wait_finished(bus, "mine1")).status == "ok"
        assert not await letters(bus)
    finally:
        await agent.stop()


async def test_results_held_by_the_bus_do_not_hold_up_the_copy_and_arrive_in_order(tmp_path: Path,
                                                                                   fake_python: str) -> None:
    """Kafka's producer holds a record through an outage without failing it: the copy must
    finish meanwhile, and its Progress reports and CopyFinished arrive afterwards, in order."""
    from tests.unit.test_bus_retry import HeldAcks

    bus = HeldAcks()
    await bus.start()
    agent = await started_agent(bus, tmp_path, fake_python)
    try:
        await bus.publish(assign("held", 0, budget=100))
        await until(lambda: _is(bool(bus.held)), what="a Progress held by the bus")
        await until(lambda: _is(not agent.runs), what="the copy finished while the bus held its reports")
        assert not await finished(bus, "held")
        while not await finished(bus, "held"):
            await bus.release()
            await asyncio.sleep(0.05)
        mine = [d.event async for d in bus.read(PROGRESS) if getattr(d.event, "job_id", None) == "held"]
        assert isinstance(mine[-1], CopyFinished) and mine[-1].status == "ok"
        assert len(mine) >= 3 and len({e.id for e in mine}) == len(mine)
        assert [e.id for e in mine] == [e.id for e in bus.sent if getattr(e, "job_id", None) == "held"]
    finally:
        await bus.release()
        await agent.stop()
        await bus.stop()


async def test_past_the_progress_backlog_reports_are_dropped_and_counted_never_the_result(
        tmp_path: Path, fake_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.agent.daemon import service as daemon
    from tests.unit.test_bus_retry import HeldAcks

    monkeypatch.setattr(daemon, "MAX_PENDING_PROGRESS", 2)
    bus = HeldAcks()
    await bus.start()
    agent = await started_agent(bus, tmp_path, fake_python)
    try:
        await bus.publish(assign("backlog", 0, budget=100))
        await until(lambda: _is(bool(bus.held)), what="a Progress held by the bus")
        await until(lambda: _is(not agent.runs), what="the copy finished while the bus held its reports")
        dropped = agent.registry.get_sample_value("hadar_agent_results_undelivered_total",
                                                  {"node": NODE, "emulated": "false", "reason": "backlog"})
        assert dropped is not None and dropped >= 1
        while not await finished(bus, "backlog"):
            await bus.release()
            await asyncio.sleep(0.05)
        mine = [d.event async for d in bus.read(PROGRESS) if getattr(d.event, "job_id", None) == "backlog"]
        assert isinstance(mine[-1], CopyFinished) and mine[-1].status == "ok"
        assert len(mine) == 3   # the two reports held within the bound, then the result
    finally:
        await bus.release()
        await agent.stop()
        await bus.stop()


async def test_a_checkpoint_upload_outlasting_the_stop_timeout_is_not_killed(bus: MemoryBus, tmp_path: Path,
                                                                           fake_python: str) -> None:
    """MinIO away at the round's end: the worker's upload retries (90 s by default), longer than
    ``deadline_grace_s`` + ``stop_timeout_s``. Killing it then threw the round's work away
    (issue 13, the 70 s MinIO outage); within ``upload_grace_s`` it is left to finish."""
    agent = await started_agent(bus, tmp_path, fake_python, deadline_grace_s=0.0, stop_timeout_s=1.0,
                                upload_grace_s=30.0)
    try:
        await bus.publish(assign("upload1", 0, budget=10_000, deadline=time.time() + 2.0, model="slow-upload"))
        done = await wait_finished(bus, "upload1", timeout_s=20.0)
        assert done.status in ("ok", "preempted"), done.reason   # the watchdog's stop may land first
        assert done.checkpoint is not None and done.steps_round > 0
    finally:
        await agent.stop()


async def test_an_upload_past_its_allowance_is_killed_and_the_copy_fails(bus: MemoryBus, tmp_path: Path,
                                                                        fake_python: str) -> None:
    agent = await started_agent(bus, tmp_path, fake_python, deadline_grace_s=0.0, stop_timeout_s=1.0,
                                upload_grace_s=0.5)
    try:
        await bus.publish(assign("upload2", 0, budget=10_000, deadline=time.time() + 2.0, model="slow-upload"))
        done = await wait_finished(bus, "upload2", timeout_s=20.0)
        assert done.status == "failed" and "signal 9" in done.reason, done.reason
    finally:
        await agent.stop()
