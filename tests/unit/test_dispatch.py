"""Handler tables: complete for their topics at construction, O(1) dispatch; every consumer has one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shared.bus import Delivery, MemoryBus
from shared.errors import HadarError
from shared.wire.dispatch import HandlerTable, HandlerTableError
from shared.wire.events import (
    EVENT_TYPES,
    Assignment,
    CopyFinished,
    Event,
    JobCancelled,
    JobSpec,
    JobSubmitted,
    LeaderRenewed,
    ModelConsolidated,
    NodeHeartbeat,
    Progress,
    RoundAbandoned,
    RoundStarted,
)
from shared.wire.topics import ALL_TOPICS, JOBS, PLACEMENTS, PROGRESS, event_types_on

T0 = 1_000.0
SPEC = JobSpec(job_id="j1", user="u", model="resnet-8", dataset="digits", batch_size=32, workers=1,
               iterations=500)
SUBMITTED = JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0)
CANCELLED = JobCancelled(ts=T0, source="cli", job_id="j1")
PROGRESS_EVENT = Progress(ts=T0, source="agent", job_id="j1", round=0, copy=0, node_id="n1", gpu_type="v100",
                          workers=1, steps_round=5, steps_total=5, samples_per_s=10.0, loss=1.0)


def noop(event: Any) -> None:
    return None


def assert_covers(table: HandlerTable[Any], topics: Iterable[str]) -> None:
    """``table`` reads exactly ``topics`` and decides about every event type on them."""
    assert table.topics == frozenset(topics)
    assert table.handled | table.ignored == {EVENT_TYPES[name] for name in event_types_on(topics)}
    assert not table.handled & table.ignored


# ---------------------------------------------------------------- the table


def test_a_type_on_the_topics_without_handler_or_ignore_raises_naming_type_and_topic() -> None:
    with pytest.raises(HandlerTableError, match=r"no handler for JobCancelled \(arrives on hadar\.jobs\)"):
        HandlerTable({JobSubmitted: noop}, topics=(JOBS,))


def test_every_missing_type_is_named_at_once() -> None:
    with pytest.raises(HandlerTableError) as info:
        HandlerTable({JobSubmitted: noop}, topics=(JOBS, PROGRESS))
    assert all(name in str(info.value) for name in ("JobCancelled", "Progress", "CopyFinished"))


def test_a_handler_for_a_type_that_cannot_arrive_on_the_topics_raises() -> None:
    with pytest.raises(HandlerTableError, match=r"handler for Progress, which travels on hadar\.progress"):
        HandlerTable({JobSubmitted: noop, JobCancelled: noop, Progress: noop}, topics=(JOBS,))


def test_ignoring_a_type_that_cannot_arrive_on_the_topics_raises() -> None:
    with pytest.raises(HandlerTableError, match=r"ignore entry for Progress"):
        HandlerTable({JobSubmitted: noop}, topics=(JOBS,), ignore=(JobCancelled, Progress))


def test_a_type_both_handled_and_ignored_raises() -> None:
    with pytest.raises(HandlerTableError, match="JobCancelled is both handled and ignored"):
        HandlerTable({JobSubmitted: noop, JobCancelled: noop}, topics=(JOBS,), ignore=(JobCancelled,))


@pytest.mark.parametrize("topics", [("hadar.nope",), ()])
def test_unknown_or_no_topics_raise(topics: tuple[str, ...]) -> None:
    with pytest.raises(HandlerTableError):
        HandlerTable({}, topics=topics)


@pytest.mark.parametrize("cls", [Event, JobSpec])
def test_a_key_that_is_not_an_event_type_raises(cls: type) -> None:
    with pytest.raises(HandlerTableError, match="is not an event type"):
        HandlerTable({JobSubmitted: noop, JobCancelled: noop, cls: noop}, topics=(JOBS,))  # type: ignore[dict-item]


def test_the_error_is_a_hadar_error_that_is_not_retriable() -> None:
    with pytest.raises(HadarError) as info:
        HandlerTable({}, topics=(JOBS,))
    assert info.value.retriable is False


def test_dispatch_returns_the_handler_of_the_events_exact_type() -> None:
    calls: list[tuple[str, Event]] = []

    def on(name: str) -> Callable[[Event], None]:
        return lambda event: calls.append((name, event))

    table = HandlerTable({JobSubmitted: on("submitted"), JobCancelled: on("cancelled")}, topics=(JOBS,))
    for event in (SUBMITTED, CANCELLED, SUBMITTED):
        handler = table.handler_for(event)
        assert handler is not None
        handler(event)
    assert calls == [("submitted", SUBMITTED), ("cancelled", CANCELLED), ("submitted", SUBMITTED)]
    assert table.handled == {JobSubmitted, JobCancelled} and table.ignored == frozenset()


def test_ignored_types_and_types_off_the_topics_have_no_handler() -> None:
    table = HandlerTable({JobSubmitted: noop}, topics=(JOBS,), ignore=(JobCancelled,))
    assert table.handler_for(CANCELLED) is None
    assert table.handler_for(PROGRESS_EVENT) is None  # published to the wrong topic: skipped, not a crash
    assert table.handler_for(SUBMITTED) is noop


def test_the_table_cannot_be_changed_through_the_mapping_it_was_built_from() -> None:
    handlers: dict[type[Event], Callable[[Any], None]] = {JobSubmitted: noop, JobCancelled: noop}
    table = HandlerTable(handlers, topics=(JOBS,))
    del handlers[JobCancelled]
    assert table.handler_for(CANCELLED) is noop


def test_a_table_over_every_topic_must_decide_about_every_event_type() -> None:
    with pytest.raises(HandlerTableError):
        HandlerTable({cls: noop for cls in EVENT_TYPES.values() if cls is not ModelConsolidated},
                     topics=ALL_TOPICS)
    assert_covers(HandlerTable(dict.fromkeys(EVENT_TYPES.values(), noop), topics=ALL_TOPICS), ALL_TOPICS)


# ---------------------------------------------------------------- every consumer has one


def test_scheduler_state_folds_exactly_the_services_input_topics_and_its_placements() -> None:
    from services.scheduler.live.inputs import INPUT_TOPICS
    from services.scheduler.live.state import SchedulerState

    assert_covers(SchedulerState.HANDLERS, (*INPUT_TOPICS, PLACEMENTS))
    assert SchedulerState.HANDLERS.ignored == frozenset()


def test_tracker_state_folds_exactly_the_services_input_topics() -> None:
    from services.tracker.service import INPUT_TOPICS
    from services.tracker.state import TrackerState

    assert_covers(TrackerState.HANDLERS, INPUT_TOPICS)
    assert TrackerState.HANDLERS.ignored == frozenset()


def test_profiler_handles_its_input_topics_and_ignores_copy_results_models_and_heartbeats() -> None:
    from services.profiler.service import INPUT_TOPICS, ProfilerService

    assert_covers(ProfilerService.HANDLERS, INPUT_TOPICS)
    assert ProfilerService.HANDLERS.ignored == {CopyFinished, ModelConsolidated, RoundAbandoned, NodeHeartbeat}


def test_agent_handles_its_topics_and_ignores_submissions() -> None:
    from services.agent.daemon.service import TOPICS, AgentDaemon

    assert_covers(AgentDaemon.HANDLERS, TOPICS)
    assert AgentDaemon.HANDLERS.ignored == {JobSubmitted}


async def test_agent_defers_the_ack_only_of_its_own_assignments(tmp_path: Path) -> None:
    from services.agent.daemon.discovery import cpu_devices
    from services.agent.daemon.service import AgentConfig, AgentDaemon
    from services.agent.protocol import StoreTarget

    agent = AgentDaemon(AgentConfig(node_id="n1"), bus=MemoryBus(), store=StoreTarget.local(tmp_path),
                        devices=cpu_devices())

    def delivery(event: Event) -> Delivery:
        return Delivery(topic="t", partition=0, offset=0, key="", timestamp_ms=0, event=event)

    other_node = Assignment(ts=T0, source="scheduler", round=3, job=SPEC, copy=0, node_id="n2", gpus=(0,),
                            gpu_type="cpu", world_size=1, ranks=(0,), step_budget=10, deadline=T0 + 360)
    started = RoundStarted(ts=T0, source="scheduler", round=2, policy="hadare", started_at=T0, ends_at=T0 + 360)
    assert await agent._handle(delivery(SUBMITTED)) is False
    assert await agent._handle(delivery(other_node)) is False
    assert await agent._handle(delivery(replace(other_node, node_id="n1"))) is False  # deadline passed
    assert await agent._handle(delivery(CANCELLED)) is False
    assert await agent._handle(delivery(started)) is False
    assert agent.latest_round == 2 and not agent.runs


def test_rerun_reads_every_placement_type() -> None:
    from services.scheduler.live.rerun import PLACEMENTS as RERUN_PLACEMENTS
    from services.scheduler.live.rerun import _RecordedRounds

    assert_covers(_RecordedRounds.HANDLERS, (RERUN_PLACEMENTS,))


def test_replay_describes_every_topic_and_leaves_out_heartbeats_and_unasked_progress() -> None:
    from services.cli.replay import _FORMATTERS, describe

    assert_covers(_FORMATTERS, ALL_TOPICS)
    assert _FORMATTERS.ignored == {NodeHeartbeat, LeaderRenewed}   # periodic: they would drown the timeline
    assert describe(NodeHeartbeat(ts=T0, source="agent", node_id="n1"), show_progress=True) is None
    assert describe(PROGRESS_EVENT, show_progress=False) is None
    assert describe(PROGRESS_EVENT, show_progress=True) == (
        "  progress j1 r0 c0 on n1: 5 steps this round (5 total), 10 samples/s, loss 1.0000")
    assert describe(CANCELLED, show_progress=False) == "cancelled j1: "
