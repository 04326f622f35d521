"""Re-derive recorded rounds from the event log (pure).

Every RoundStarted records, in ``inputs``, how many records of each input topic-partition
the scheduler had folded when it planned, the ``nodes`` it planned on, and the settings
it decided with (policy, options, seed, round length). Re-deriving round r therefore
means: fold exactly those records plus the placements of rounds before r, rebuild the
request on the recorded nodes with the round's recorded start time, and call the policy
the round names -- built with the recorded options -- with the previous re-derived plan.
The live scheduler does this once at start-up to recover its policy's carried state
(e.g. Hadar's ledger); ``hadar replay --rerun`` does it to check that every recorded
decision is reproduced, with no flags to retype.

Rounds are numbered without gaps, so only the rounds that continue the sequence from the
first one in the log are re-derived and folded; a RoundStarted that jumps ahead is
reported (``in_sequence=False``) and otherwise ignored, with its Assignments.

A plan is carried from one round to the next only between rounds decided by the same
policy configuration: a round after a change of policy or options starts afresh, as the
live scheduler did when it was restarted with the new settings.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.scheduler.config import DecisionSettings
from services.scheduler.core.policy import Plan, PlanRequest, Policy
from services.scheduler.core.queues import plan_with_queues
from services.scheduler.live.rounds import RoundTiming, build_request, plan_to_events
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import PolicyChoice, UnknownPolicy
from shared.bus.rejection import Rejected
from shared.wire.dispatch import HandlerTable
from shared.wire.events import Assignment, Event, RoundStarted
from shared.wire.topics import PLACEMENTS

__all__ = ["LoggedEvent", "RoundCheck", "assignment_decision", "rerun"]


@dataclass(frozen=True, kw_only=True)
class LoggedEvent:
    topic: str
    partition: int
    offset: int
    event: Event


@dataclass(frozen=True, kw_only=True)
class RoundCheck:
    """One recorded round against its re-derivation. ``error``: why it could not be
    re-derived (e.g. the log names a policy this version does not have); then ``plan`` and
    ``request`` are None. ``in_sequence`` False: the round does not follow the previous
    one (the scheduler numbers rounds without gaps), so it was neither re-derived nor
    folded -- a forged or misplaced RoundStarted must not move anyone's round counter."""

    round: int
    settings: DecisionSettings | None
    recorded: tuple
    rederived: tuple
    request: PlanRequest | None
    plan: Plan | None
    error: str | None = None
    in_sequence: bool = True

    @property
    def matches(self) -> bool:
        return self.error is None and self.recorded == self.rederived


@dataclass(kw_only=True)
class _RecordedRounds:
    """What the placements topic recorded: each round's first RoundStarted, and its Assignments."""

    started: dict[int, RoundStarted] = field(default_factory=dict)
    assigned: defaultdict[int, list[Assignment]] = field(default_factory=lambda: defaultdict(list))

    def add(self, event: Event) -> None:
        handler = self.HANDLERS.handler_for(event)
        if handler is not None:
            handler(self, event)

    def _on_round_started(self, event: RoundStarted) -> None:
        self.started.setdefault(event.round, event)

    def _on_assignment(self, event: Assignment) -> None:
        self.assigned[event.round].append(event)

    HANDLERS: ClassVar[HandlerTable[Callable[[_RecordedRounds, Any], None]]] = HandlerTable(
        {RoundStarted: _on_round_started, Assignment: _on_assignment}, topics=(PLACEMENTS,))


def _fold(state: SchedulerState, event: Event) -> None:
    """Fold as the live scheduler did: an event it refused changed nothing there either."""
    try:
        state.apply(event)
    except Rejected:
        pass


def assignment_decision(assignments: Iterable[Assignment]) -> tuple:
    """What a round decided, as comparable data: sorted (job, copy, node, gpus)."""
    return tuple(sorted((a.job_id, a.copy, a.node_id, tuple(a.gpus)) for a in assignments))


def rerun(log: Iterable[LoggedEvent], *, state: SchedulerState | None = None,
          override: PolicyChoice | None = None, first_round: int | None = None,
          previous: Plan | None = None, previous_key: tuple[str, str] | None = None) -> Iterator[RoundCheck]:
    """Yield one RoundCheck per recorded round, in round order; ``state`` ends fully folded.

    ``override``: decide every round with this policy instead of the recorded one (a
    what-if; rounds then differ wherever the two policies would have).

    Resuming from a state snapshot: ``state`` is the snapshot's, ``log`` holds only the
    records after the offsets it covers, ``first_round`` is its next round (earlier rounds
    in the log are skipped silently: the snapshot holds them), and ``previous`` /
    ``previous_key`` are its last plan and the policy configuration that made it.
    """
    state = state if state is not None else SchedulerState()
    inputs: dict[str, list[LoggedEvent]] = defaultdict(list)
    placements = _RecordedRounds()
    started, assigned = placements.started, placements.assigned
    for item in log:
        if item.topic == PLACEMENTS:
            placements.add(item.event)
        else:
            inputs[f"{item.topic}:{item.partition}"].append(item)
    for records in inputs.values():
        records.sort(key=lambda r: r.offset)
    folded = dict.fromkeys(inputs, 0)   # index into inputs[tp] of the next record to fold
    policies: dict[tuple[str, str], Policy] = {}
    expected: int | None = first_round
    for r in sorted(started):
        if first_round is not None and r < first_round:
            continue
        rs = started[r]
        if expected is not None and r != expected:
            yield RoundCheck(round=r, settings=None, recorded=assignment_decision(assigned[r]), rederived=(),
                             request=None, plan=None, in_sequence=False,
                             error=f"out of sequence: round {expected} was expected next; ignored")
            continue
        expected = r + 1
        for tp, records in inputs.items():
            limit = rs.inputs.get(tp, 0)
            i = folded[tp]
            while i < len(records) and records[i].offset < limit:
                _fold(state, records[i].event)
                i += 1
            folded[tp] = i
        recorded = assignment_decision(assigned[r])
        try:
            settings = DecisionSettings.of_round(rs)
            choice = override or settings.choice
            policy = policies.get(choice.key) or policies.setdefault(choice.key, choice.build())
        except UnknownPolicy as exc:
            yield RoundCheck(round=r, settings=None, recorded=recorded, rederived=(), request=None, plan=None,
                             error=str(exc))
            previous, previous_key = None, None
        else:
            timing = RoundTiming(round=r, started_at=rs.started_at, round_s=settings.round_s,
                                 heartbeat_s=settings.heartbeat_s)
            carried = previous if previous_key == choice.key else None
            request = build_request(state, timing, carried, settings.seed, nodes=rs.nodes)
            t0 = time.perf_counter()
            plan = plan_with_queues(policy, request)
            ms = (time.perf_counter() - t0) * 1e3
            events = plan_to_events(plan, request, state, timing, choice=choice, seed=settings.seed,
                                    source="replay", inputs=rs.inputs, decision_ms=ms)
            rederived = assignment_decision(e for e in events if isinstance(e, Assignment))
            yield RoundCheck(round=r, settings=settings, recorded=recorded, rederived=rederived,
                             request=request, plan=plan)
            previous, previous_key = plan, choice.key
        _fold(state, rs)
        for a in assigned[r]:
            _fold(state, a)
    for tp, records in inputs.items():
        for record in records[folded[tp]:]:
            _fold(state, record.event)
