"""Re-derive recorded rounds from the event log (pure).

Every RoundStarted records, in ``inputs``, how many records of each input topic-partition
the scheduler had folded when it planned. Re-deriving round r therefore means: fold
exactly those records plus the placements of rounds before r, rebuild the snapshot with
the round's recorded start time, and call the same policy with the previous re-derived
plan. The live scheduler does this once at start-up to recover its policy's state (e.g.
Hadar's ledger); ``hadar replay --rerun`` does it to check that every recorded decision
is reproduced.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from services.scheduler.policy import Plan, Policy, Snapshot
from services.scheduler.rounds import RoundTiming, build_snapshot, plan_to_events
from services.scheduler.state import SchedulerState
from shared.events import Assignment, Event, RoundStarted
from shared.topics import PLACEMENTS


@dataclass(frozen=True, kw_only=True)
class LoggedEvent:
    topic: str
    partition: int
    offset: int
    event: Event


@dataclass(frozen=True, kw_only=True)
class RoundCheck:
    round: int
    recorded: tuple
    rederived: tuple
    snapshot: Snapshot
    plan: Plan

    @property
    def matches(self) -> bool:
        return self.recorded == self.rederived


def assignment_decision(assignments: Iterable[Assignment]) -> tuple:
    """What a round decided, as comparable data: sorted (job, copy, node, gpus)."""
    return tuple(sorted((a.job_id, a.copy, a.node_id, tuple(a.gpus)) for a in assignments))


def rerun(log: Iterable[LoggedEvent], policy: Policy, *, seed: int = 0, heartbeat_s: float = 5.0,
          state: SchedulerState | None = None) -> Iterator[RoundCheck]:
    """Yield one RoundCheck per recorded round, in round order; ``state`` ends fully folded."""
    state = state if state is not None else SchedulerState()
    inputs: dict[str, list[LoggedEvent]] = defaultdict(list)
    started: dict[int, RoundStarted] = {}
    assigned: dict[int, list[Assignment]] = defaultdict(list)
    for item in log:
        if item.topic == PLACEMENTS:
            if isinstance(item.event, RoundStarted):
                started.setdefault(item.event.round, item.event)
            elif isinstance(item.event, Assignment):
                assigned[item.event.round].append(item.event)
        else:
            inputs[f"{item.topic}:{item.partition}"].append(item)
    for records in inputs.values():
        records.sort(key=lambda r: r.offset)
    folded = {tp: 0 for tp in inputs}   # index into inputs[tp] of the next record to fold
    previous: Plan | None = None
    for r in sorted(started):
        rs = started[r]
        for tp, records in inputs.items():
            limit = rs.inputs.get(tp, 0)
            i = folded[tp]
            while i < len(records) and records[i].offset < limit:
                state.apply(records[i].event)
                i += 1
            folded[tp] = i
        timing = RoundTiming(round=r, started_at=rs.started_at, round_s=rs.ends_at - rs.started_at,
                             heartbeat_s=heartbeat_s)
        snapshot = build_snapshot(state, timing, previous, seed)
        t0 = time.perf_counter()
        plan = policy.plan(snapshot)
        ms = (time.perf_counter() - t0) * 1e3
        events = plan_to_events(plan, snapshot, state, timing, policy=rs.policy, source="replay",
                                inputs=rs.inputs, decision_ms=ms)
        rederived = assignment_decision(e for e in events if isinstance(e, Assignment))
        yield RoundCheck(round=r, recorded=assignment_decision(assigned[r]), rederived=rederived,
                         snapshot=snapshot, plan=plan)
        previous = plan
        state.apply(rs)
        for a in assigned[r]:
            state.apply(a)
    for tp, records in inputs.items():
        for record in records[folded[tp]:]:
            state.apply(record.event)
