"""The fault scenarios of ``benchmarks/faults.py`` on one broker and one MinIO (issue 13 item 5)
and the standby scheduler's (issue 28 item 3), with the waits every scenario shares.

A scenario is ``f(cluster, timeout_s) -> end``: it waits until the workload is mid-work, strikes
(:meth:`Cluster.struck`), and returns the unix time the fault ended (None: no fault). Every wait
goes through :meth:`Cluster.wait_mid_work`: a fault that would find nothing to hit -- every job
already completed, or the moment it waits for never came -- raises :class:`Miss` with the
reason, and the run is reported as a miss (issue 28: a ``tracker_kill`` whose jobs both finished
before a round was due waited out its timeout and reported 0/2 jobs).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable

from benchmarks.fault_harness import Cluster, Miss, leader_terms
from shared.wire.events import Assignment, CopyFinished, Event, Progress, RoundAbandoned, RoundStarted

Scenario = Callable[[Cluster, float], "float | None"]


def first_progress(c: Cluster, timeout_s: float) -> None:
    """Wait until the workload is mid-work: a model that added steps since the last fault
    ended and a job still running; then half a round on (mid-round), and still a job running."""
    c.wait_mid_work(c.mid_work, "a round consolidated with a job still running", timeout_s=timeout_s, poll_s=2.0)
    time.sleep(c.workload.round_s / 2)
    if c.all_completed(c.log()):
        raise Miss("every job completed within half a round of the last model")


def training(c: Cluster, timeout_s: float) -> None:
    """Wait until a copy of a running job reports training steps after the last fault ended:
    a round is under way. Unlike :func:`first_progress` this does not wait for a whole round
    and its model, which on a quiet machine left the CI subset's jobs done before the fault."""
    def copies_train(records: list[tuple[str, Event]]) -> bool:
        done = c.completed(records)
        return any(isinstance(e, Progress) and e.job_id in c.job_ids and e.job_id not in done and e.steps_round > 0
                   and e.ts > c.last_fault_end for _, e in records)
    c.wait_mid_work(copies_train, "a copy training", timeout_s=timeout_s)


def at_deadline(c: Cluster, timeout_s: float, *, after_s: float = 0.0, look_s: float = 6.0) -> tuple[str, int]:
    """Once the workload is mid-work, sleep until ``after_s`` past the deadline of the current
    round of a running job, when its copies stop, write and upload their replicas, and the
    tracker consolidates them; the job and round. Striking then lands mid-consolidation
    whatever the machine's speed, where polling the log for "deadline passed, undecided"
    missed it: with the emulated models a round is decided 0.2-0.3 s after its deadline
    (seen in ``replicated_drive_lost`` runs; a strike 1 s after came too late). ``look_s``
    before the deadline the log is read again: a round whose copies already finished (a copy
    that reached its step budget early; the tracker consolidates it at once), or are on pace
    to (a job's last round: two runs in three missed the drive loss that way), is passed over
    for the next one."""
    first_progress(c, timeout_s)
    give_up = time.monotonic() + timeout_s

    def open_rounds(records: list[tuple[str, Event]], before: float) -> list[Assignment]:
        """Assignments of running jobs whose round no copy finished nor the tracker decided
        yet, with a deadline after ``before``, soonest first."""
        done = c.completed(records)
        over = {(m.job_id, m.round) for m in c.models(records)}
        over |= {(e.job_id, e.round) for _, e in records if isinstance(e, CopyFinished | RoundAbandoned)}
        return sorted((e for _, e in records if isinstance(e, Assignment) and e.job_id in c.job_ids
                       and e.job_id not in done and e.deadline > before
                       and (e.job_id, e.round) not in over), key=lambda e: e.deadline)

    def ends_early(records: list[tuple[str, Event]], target: Assignment) -> bool:
        """A copy of ``target``'s round is on pace to reach its step budget before the
        deadline: the job's last round, whose copies finish and are averaged early (a round
        of a job with more to do has every remaining step in its budgets, more than it can do)."""
        started = next((e.ts for _, e in records if isinstance(e, RoundStarted) and e.round == target.round), None)
        budgets = {e.copy: e.step_budget for _, e in records if isinstance(e, Assignment)
                   and (e.job_id, e.round) == (target.job_id, target.round)}
        latest = {e.copy: e for _, e in records if isinstance(e, Progress)
                  and (e.job_id, e.round) == (target.job_id, target.round)}
        if started is None:
            return False
        return any(p.ts > started and p.steps_round / (p.ts - started) * (target.deadline - started)
                   >= budgets.get(copy, math.inf) for copy, p in latest.items())
    passed: list[str] = []
    while True:
        left = give_up - time.monotonic()
        records = c.wait_mid_work(lambda r: bool(open_rounds(r, time.time() + look_s / 2)),
                                  "a running job's round with its deadline ahead"
                                  + (f" (passed over: {', '.join(passed)})" if passed else ""),
                                  timeout_s=max(1.0, left))
        target = open_rounds(records, time.time() + look_s / 2)[0]
        time.sleep(max(0.0, target.deadline - look_s - time.time()))
        records = c.log()
        if c.all_completed(records):
            raise Miss(f"every job completed before round {target.round}'s deadline")
        if (time.time() < target.deadline + after_s and any(e.id == target.id for e in open_rounds(records, 0.0))
                and not ends_early(records, target)):
            break
        passed.append(f"{target.job_id} round {target.round}")
    if passed:
        c.notes["passed_over"] = passed
    time.sleep(max(0.0, target.deadline + after_s - time.time()))
    return target.job_id, target.round


def busy_agent(c: Cluster) -> str:
    """The agent with an assignment in the latest round (the first agent if none)."""
    records = c.log()
    rounds = [e.round for _, e in records if isinstance(e, RoundStarted)]
    latest = max(rounds, default=-1)
    for _, e in records:
        if isinstance(e, Assignment) and e.round == latest and e.job_id in c.job_ids:
            return f"agent:{e.node_id}"
    return f"agent:{c.workload.agents[0][0]}"


def baseline(c: Cluster, timeout_s: float) -> float | None:
    return None


def agent_kill(c: Cluster, timeout_s: float) -> float:
    first_progress(c, timeout_s)
    c.struck()
    c.signal(busy_agent(c), signal.SIGKILL)
    return time.time()


def agent_kill_restart(c: Cluster, timeout_s: float) -> float:
    first_progress(c, timeout_s)
    name = busy_agent(c)
    c.struck()
    c.signal(name, signal.SIGKILL)
    time.sleep(20)
    c.start(name)
    return time.time()


def agent_stop(c: Cluster, timeout_s: float) -> float:
    first_progress(c, timeout_s)
    name = busy_agent(c)
    c.struck()
    c.signal(name, signal.SIGSTOP)
    time.sleep(4 * c.workload.heartbeat_s + c.workload.round_s)   # past 3 heartbeats and a round
    c.signal(name, signal.SIGCONT)
    return time.time()


def kill_restart(name: str, pause_s: float = 2.0) -> Scenario:
    """SIGKILL service ``name`` while a round's copies train, start it ``pause_s`` later."""
    def scenario(c: Cluster, timeout_s: float) -> float:
        training(c, timeout_s)
        c.struck()
        c.signal(name, signal.SIGKILL)
        time.sleep(pause_s)
        c.start(name)
        return time.time()
    return scenario


def active_scheduler(c: Cluster) -> tuple[str, int]:
    """The scheduler replica holding the newest term, and the term."""
    terms = leader_terms(c.log())
    if not terms:
        raise Miss("no scheduler replica holds the role")
    term, holder, _ = terms[-1]
    return holder, term


def await_takeover(c: Cluster, term: int, timeout_s: float) -> tuple[str, float]:
    """Wait for a newer term than ``term``: its holder, and the unix time of its first renewal."""
    records = c.wait(lambda r: any(t > term for t, _, _ in leader_terms(r)), timeout_s=timeout_s, poll_s=0.5)
    return next((holder, ts) for t, holder, ts in leader_terms(records) if t > term)


def standby_kill(c: Cluster, timeout_s: float) -> float:
    """SIGKILL the active scheduler while a round's copies train and leave it dead: the
    standby takes over (the fault ends when its first renewal is out)."""
    training(c, timeout_s)
    name, term = active_scheduler(c)
    old = c.writer(name)
    killed = c.struck()
    c.signal(name, signal.SIGKILL)
    holder, took_over = await_takeover(c, term, timeout_s)
    c.takeovers.append(round(took_over - killed, 1))
    c.superseded.append((old, c.writer(holder)))
    return took_over


def standby_freeze(c: Cluster, timeout_s: float) -> float:
    """SIGSTOP the active scheduler while a round's copies train, past its lease and a round,
    then SIGCONT it: the standby has taken over, and the resumed one -- fenced -- must
    publish nothing and step down (exit 3; the harness restarts it as a standby)."""
    training(c, timeout_s)
    name, term = active_scheduler(c)
    old = c.writer(name)
    frozen = c.struck()
    c.signal(name, signal.SIGSTOP)
    holder, took_over = await_takeover(c, term, timeout_s)
    c.takeovers.append(round(took_over - frozen, 1))
    c.superseded.append((old, c.writer(holder)))
    time.sleep(c.workload.round_s)   # the successor plans a round while the old one is still frozen
    c.signal(name, signal.SIGCONT)
    c.wait(lambda r: name in c.step_downs, timeout_s=60, poll_s=0.5)   # crashes() sees the exit
    return time.time()


def tracker_kill_consolidating(c: Cluster, timeout_s: float) -> float:
    """SIGKILL the tracker at a running job's round deadline, as it consolidates; restart it 2 s later."""
    job, round_ = at_deadline(c, timeout_s)
    c.notes["target"] = f"{job} round {round_}"
    c.struck()
    c.signal("tracker", signal.SIGKILL)
    time.sleep(2)
    c.start("tracker")
    return time.time()


def server_outage(name: str, down_s: float) -> Scenario:
    """SIGKILL the server once the workload is mid-work (mid-round), ``hadar infra restart``
    it ``down_s`` later; the fault ends when it answers again."""
    def scenario(c: Cluster, timeout_s: float) -> float:
        first_progress(c, timeout_s)
        c.struck()
        c.kill_server(name)
        time.sleep(down_s)
        c.restart_server(name)
        return time.time()
    return scenario


def consolidating_when_struck(c: Cluster, records: list[tuple[str, Event]]) -> bool | None:
    """Whether the round a deadline-timed fault targeted was decided only after it struck."""
    target = c.notes.get("target")
    if not isinstance(target, str) or not c.strikes:
        return None
    job, _, round_ = target.partition(" round ")
    decided = [m.ts for m in c.models(records) if m.job_id == job and m.round == int(round_)]
    return not decided or min(decided) > c.strikes[0]


__all__ = ["Scenario", "first_progress", "training", "at_deadline", "busy_agent", "baseline", "agent_kill",
           "agent_kill_restart", "agent_stop", "kill_restart", "active_scheduler", "await_takeover",
           "standby_kill", "standby_freeze", "tracker_kill_consolidating", "server_outage",
           "consolidating_when_struck"]
