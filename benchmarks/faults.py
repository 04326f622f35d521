"""What a crash or an outage costs: one fault at a time on real Kafka + MinIO (issue 13 item 5).

    PYTHONPATH=. python benchmarks/faults.py [--scenarios NAME ...] [--out DIR]

Each scenario starts its own Kafka broker and MinIO server and every service as its own
process (``benchmarks/fault_harness.py``: scheduler, tracker, profiler, emulated agents),
submits a small workload, injects one fault once the first model is out (mid-round), and
waits for every job to complete. Printed per scenario: jobs completed/total, models
verified/total (each round model against the samples-weighted average of its stored
replicas), events lost (results produced and never consumed), service crashes, rounds
lost (worst job) and recovery time (end of the fault to the next model that added steps).
The last line is one JSON object ``{"scenarios": {name: {...}}}``.

Targets: every job completes, every model verifies, 0 events lost, 0 crashes, at most 1
round lost per job per fault. Exit code 1 if a scenario misses one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fault_harness import (
    Cluster,
    Workload,
    events_lost,
    leader_terms,
    progress_times,
    round_numbering_faults,
    rounds_lost,
    verify_models,
)
from shared.bus import KafkaBus
from shared.runtime.logging import configure_logging
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    Event,
    JobCompleted,
    ModelConsolidated,
    NodeHeartbeat,
    Progress,
    RoundStarted,
    ThroughputEstimate,
)
from shared.wire.topics import ALL_TOPICS

FIELDS = ("jobs_completed", "jobs_total", "models_verified", "models_total", "events_lost", "service_crashes",
          "rounds_lost_max", "recovery_s")


def _first_progress(c: Cluster, timeout_s: float) -> None:
    """Wait until the system works: a model that added steps since the last fault ended
    (then mid-round: half a round on)."""
    c.wait(lambda r: any(t > c.last_fault_end for t in progress_times(c.models(r))), timeout_s=timeout_s)
    time.sleep(c.workload.round_s / 2)


def _busy_agent(c: Cluster) -> str:
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
    _first_progress(c, timeout_s)
    c.signal(_busy_agent(c), signal.SIGKILL)
    return time.time()


def agent_kill_restart(c: Cluster, timeout_s: float) -> float:
    _first_progress(c, timeout_s)
    name = _busy_agent(c)
    c.signal(name, signal.SIGKILL)
    time.sleep(20)
    c.start(name)
    return time.time()


def agent_stop(c: Cluster, timeout_s: float) -> float:
    _first_progress(c, timeout_s)
    name = _busy_agent(c)
    c.signal(name, signal.SIGSTOP)
    time.sleep(4 * c.workload.heartbeat_s + c.workload.round_s)   # past 3 heartbeats and a round
    c.signal(name, signal.SIGCONT)
    return time.time()


def _training(c: Cluster, timeout_s: float) -> None:
    """Wait until a copy of our jobs reports training steps after the last fault ended: a
    round is under way. Unlike :func:`_first_progress` this does not wait for a whole round
    and its model, which on a quiet machine left the CI subset's jobs done before the fault."""
    c.wait(lambda r: any(isinstance(e, Progress) and e.job_id in c.job_ids and e.steps_round > 0
                         and e.ts > c.last_fault_end for _, e in r), timeout_s=timeout_s, poll_s=1.0)


def _kill_restart(name: str, pause_s: float = 2.0) -> Callable[[Cluster, float], float]:
    """SIGKILL service ``name`` while a round's copies train, start it ``pause_s`` later."""
    def scenario(c: Cluster, timeout_s: float) -> float:
        _training(c, timeout_s)
        c.signal(name, signal.SIGKILL)
        time.sleep(pause_s)
        c.start(name)
        return time.time()
    return scenario


def _active_scheduler(c: Cluster) -> tuple[str, int]:
    """The scheduler replica holding the newest term, and the term."""
    terms = leader_terms(c.log())
    if not terms:
        raise RuntimeError("no scheduler replica holds the role")
    term, holder, _ = terms[-1]
    return holder, term


def _await_takeover(c: Cluster, term: int, timeout_s: float) -> float:
    """Wait for a newer term than ``term``; the unix time its holder's first renewal was published."""
    records = c.wait(lambda r: any(t > term for t, _, _ in leader_terms(r)), timeout_s=timeout_s, poll_s=0.5)
    return next(ts for t, _, ts in leader_terms(records) if t > term)


def standby_kill(c: Cluster, timeout_s: float) -> float:
    """SIGKILL the active scheduler while a round's copies train and leave it dead: the
    standby takes over (the fault ends when its first renewal is out)."""
    _training(c, timeout_s)
    name, term = _active_scheduler(c)
    c.signal(name, signal.SIGKILL)
    killed = time.time()
    took_over = _await_takeover(c, term, timeout_s)
    c.takeovers.append(round(took_over - killed, 1))
    return took_over


def standby_freeze(c: Cluster, timeout_s: float) -> float:
    """SIGSTOP the active scheduler while a round's copies train, past its lease and a round,
    then SIGCONT it: the standby has taken over, and the resumed one -- fenced -- must
    publish nothing and step down (exit 3; the harness restarts it as a standby)."""
    _training(c, timeout_s)
    name, term = _active_scheduler(c)
    c.signal(name, signal.SIGSTOP)
    frozen = time.time()
    took_over = _await_takeover(c, term, timeout_s)
    c.takeovers.append(round(took_over - frozen, 1))
    time.sleep(c.workload.round_s)   # the successor plans a round while the old one is still frozen
    c.signal(name, signal.SIGCONT)
    c.wait(lambda r: name in c.step_downs, timeout_s=60, poll_s=0.5)   # crashes() sees the exit
    return time.time()


def tracker_kill_consolidating(c: Cluster, timeout_s: float) -> float:
    """SIGKILL the tracker right after a round's deadline, while it consolidates."""
    c.wait(lambda r: any(t > c.last_fault_end for t in progress_times(c.models(r))), timeout_s=timeout_s)

    def due(records: list[tuple[str, Event]]) -> bool:
        decided = {(m.job_id, m.round) for m in c.models(records)}
        now = time.time()
        return any(isinstance(e, Assignment) and e.job_id in c.job_ids and e.deadline <= now
                   and (e.job_id, e.round) not in decided for _, e in records)
    c.wait(due, timeout_s=timeout_s, poll_s=0.2)
    c.signal("tracker", signal.SIGKILL)
    time.sleep(2)
    c.start("tracker")
    return time.time()


def _server_outage(name: str, down_s: float) -> Callable[[Cluster, float], float]:
    """SIGKILL the server once the system made progress (mid-round), ``hadar infra restart``
    it ``down_s`` later; the fault ends when it answers again. The outage must find jobs
    running: one that comes after every job completed raises (a miss, not a pass)."""
    def scenario(c: Cluster, timeout_s: float) -> float:
        _first_progress(c, timeout_s)
        if c.completed(c.log()) == set(c.job_ids):
            raise RuntimeError(f"{name} outage: every job completed before it; run with a larger --scale")
        c.kill_server(name)
        time.sleep(down_s)
        c.restart_server(name)
        return time.time()
    return scenario


def junk(c: Cluster, timeout_s: float, count: int = 1000, seed: int = 0, *, wait: bool = True) -> float:
    """``count`` records across every topic: random bytes, msgpack that is no event, and
    well-formed events that are false (forged round numbers, keys, copies, rates); mid-round
    once the system made progress, or at once (``wait=False``)."""
    if wait:
        _first_progress(c, timeout_s)
    asyncio.run(_publish_junk(c, count, random.Random(seed)))
    return time.time()


async def _publish_junk(c: Cluster, count: int, rng: random.Random) -> None:
    import msgpack

    bus = KafkaBus(c.bootstrap, source="forger")
    await bus.start()
    try:
        job = c.job_ids[0]
        node = c.workload.agents[0][0]
        now = time.time()
        forged: list[Callable[[int], Event]] = [
            lambda i: RoundStarted(ts=now, source="forger", round=10**6 + i, policy="hadare", started_at=now,
                                   ends_at=now + 10),
            lambda i: CopyFinished(ts=now, source="forger", job_id=job, round=i % 5, copy=7, node_id=node,
                                   status="ok", steps_round=10**6,
                                   checkpoint=f"checkpoints/{job}/{i % 5}/9.safetensors"),
            lambda i: ModelConsolidated(ts=now, source="forger", job_id=job, round=i % 5,
                                        key=f"models/{job}/forged-{i}.safetensors", total_steps=10**6,
                                        copies=(CopyWeight(copy=0, steps=1, weight=1.0),)),
            lambda i: JobCompleted(ts=now, source="forger", job_id=job, final_key=f"models/{job}/forged.safetensors",
                                   total_steps=10**6, jct_s=1.0, completed_at=now),
            lambda i: NodeHeartbeat(ts=now, source="forger", node_id=f"ghost-{i}", seq=i),
            lambda i: ThroughputEstimate(ts=now, source="forger", job_id=job, basis="measured", workers=1,
                                         rates={"t4": 1e9}),
            lambda i: Progress(ts=now, source="forger", job_id=job, round=i % 5, copy=0, node_id=node,
                               gpu_type="t4", workers=1, steps_round=10**7, steps_total=10**7,
                               samples_per_s=1e12, loss=0.0),
        ]
        for i in range(count):
            kind = i % 3
            if kind == 0:
                topic = ALL_TOPICS[i % len(ALL_TOPICS)]
                await bus.write_raw(topic, job, rng.randbytes(rng.randint(0, 300)))
            elif kind == 1:
                topic = ALL_TOPICS[i % len(ALL_TOPICS)]
                body = {"type": rng.choice(["Assignment", "JobSubmitted", "Nope"]), "v": rng.randint(0, 9),
                        "id": "x" * rng.randint(0, 40), "junk": rng.random()}
                await bus.write_raw(topic, job, msgpack.packb(body))
            else:
                try:
                    event = forged[i % len(forged)](i)
                except Exception:
                    continue
                c.forged_ids.add(event.id)
                await bus.publish(event)
    finally:
        await bus.stop()


SCENARIOS: dict[str, Callable[..., float | None]] = {
    "baseline": baseline,
    "agent_kill": agent_kill,
    "agent_kill_restart": agent_kill_restart,
    "agent_stop": agent_stop,
    "scheduler_kill": _kill_restart("scheduler"),
    "tracker_kill": tracker_kill_consolidating,
    "profiler_kill": _kill_restart("profiler"),
    "kafka_outage": _server_outage("kafka", 20.0),
    "minio_outage": _server_outage("minio", 30.0),
    # Long outages (issue 13 item 4): under the watchdog's 120 s and the store's 90 s retry.
    "kafka_outage_75s": _server_outage("kafka", 75.0),
    "minio_outage_70s": _server_outage("minio", 70.0),
    "junk": junk,
    "junk_at_start": lambda c, timeout_s: junk(c, timeout_s, wait=False),
    # Two scheduler replicas (issue 28 item 3): these run with Workload.standby.
    "standby_kill": standby_kill,
    "standby_freeze": standby_freeze,
}
STANDBY_SCENARIOS = frozenset({"standby_kill", "standby_freeze"})


# Scenarios whose fault lasts long (a server down 20-30 s, then restarted) run jobs this many
# times longer (on top of --scale): with the default jobs a quiet machine finished both
# before MinIO came back, and the outage then tested nothing.
SCENARIO_SCALE: dict[str, float] = {"kafka_outage": 3.0, "minio_outage": 3.0, "kafka_outage_75s": 3.0,
                                     "minio_outage_70s": 3.0}


def scaled(workload: Workload, scale: float) -> Workload:
    """``workload`` with every job's iterations multiplied by ``scale`` (at least 1)."""
    return replace(workload, jobs=tuple((m, d, max(1, round(n * scale))) for m, d, n in workload.jobs))


def run_scenario(names: str | Sequence[str], workload: Workload, workdir: Path) -> dict[str, float | int | None]:
    """Run one scenario (or several faults one after the other, each once the system made
    progress after the previous one) in ``workdir`` and return its figures; ``recovery_s``
    is the longest recovery."""
    names = [names] if isinstance(names, str) else list(names)
    if STANDBY_SCENARIOS & set(names):
        workload = replace(workload, standby=True)
    with Cluster(workdir, workload) as c:
        c.start_all()
        c.wait_registered()
        c.phase("services_registered")
        c.submit()
        c.phase("submitted")
        ends = []
        for name in names:
            end = SCENARIOS[name](c, workload.timeout_s)
            c.phase(f"fault:{name}")   # waiting for progress, then the fault and its end
            if end is not None:
                c.last_fault_end = end
                ends.append(end)
        try:
            records = c.wait(lambda r: c.completed(r) == set(c.job_ids), timeout_s=workload.timeout_s)
        except TimeoutError:
            records = c.log()
        c.phase("jobs_completed")
        crashes = c.crashes()
        models = c.models(records)
        assert c.s3 is not None
        verified = asyncio.run(verify_models(c.s3, models, records, workdir / "verify"))
        c.phase("verified")
        lost = rounds_lost(records, c.job_ids, c.forged_ids)
        times = sorted([*progress_times(models), *(e.ts for e in c.completions(records))])
        recoveries = [min((t - end for t in times if t >= end), default=None) for end in ends]
        return {
            "jobs_completed": len(c.completed(records)), "jobs_total": len(c.job_ids),
            "models_verified": verified, "models_total": len(models),
            "events_lost": events_lost(records, c.job_ids, c.forged_ids),
            "service_crashes": sum(len(s.crashes) for s in c.services.values()),
            "rounds_lost_max": max(lost.values(), default=0),
            "recovery_s": (None if not ends or None in recoveries
                           else round(max(r for r in recoveries if r is not None), 1)),
            "faults": len(ends),
            # jobs already complete when the last fault ended: a fault after which no job was
            # left tested nothing (the workload is too small for the machine's speed at the time)
            "done_before_fault": sum(1 for e in c.completions(records) if ends and e.ts <= ends[-1]),
            "restart_failures": list(c.restart_failures),
            "round_numbering_faults": round_numbering_faults(records),   # a round twice or a number skipped
            "takeover_s": list(c.takeovers),   # fault start to the successor's first renewal
            "step_downs": list(c.step_downs),
            "crashed": sorted(crashes),
            "phases": c.phases,   # the same dict: the cluster's exit adds "stopped"
        }


def meets_targets(figures: dict) -> bool:
    """Every job completed, every model verified, nothing lost, no crash, at most one round
    lost per job per fault; and a fault that ended when every job was already done misses."""
    faults = figures.get("faults", 0)
    return (figures["jobs_completed"] == figures["jobs_total"] and figures["models_verified"] == figures["models_total"]
            and figures["models_total"] > 0 and figures["events_lost"] == 0 and figures["service_crashes"] == 0
            and figures["rounds_lost_max"] <= faults and figures.get("round_numbering_faults", 0) == 0
            and (faults == 0 or figures.get("done_before_fault", 0) < figures["jobs_total"]))


def table(results: dict[str, dict]) -> str:
    head = ("scenario", "jobs", "models ok", "events lost", "crashes", "rounds lost", "recovery s", "done before",
            "restart retries", "wall s")
    rows = [head]
    for name, f in results.items():
        rows.append((name, f"{f['jobs_completed']}/{f['jobs_total']}", f"{f['models_verified']}/{f['models_total']}",
                     str(f["events_lost"]), str(f["service_crashes"]), str(f["rounds_lost_max"]),
                     "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}", str(f.get("done_before_fault", "-")),
                     str(len(f.get("restart_failures", []))), f"{f.get('wall_s', 0):.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--out", default=None, help="keep each scenario's logs here (default: a temporary directory)")
    p.add_argument("--round-s", type=float, default=Workload.round_s)
    p.add_argument("--timeout-s", type=float, default=Workload.timeout_s, help="per scenario, for the jobs")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every job's iterations (outage scenarios: "
                   "x SCENARIO_SCALE more; a faster machine "
                   "finishes the default jobs before a fault)")
    args = p.parse_args(argv)
    workload = scaled(Workload(round_s=args.round_s, timeout_s=args.timeout_s), args.scale)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hadar-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    # The harness's own log (e.g. every junk record its log reads skip) goes to a file.
    configure_logging("faults", level="INFO", stream=open(out / "harness.log", "a", encoding="utf-8"))  # noqa: SIM115 - the harness logs there until it exits
    results: dict[str, dict] = {}
    for name in args.scenarios:
        began = time.monotonic()
        try:
            figures = run_scenario(name, scaled(workload, SCENARIO_SCALE.get(name, 1.0)), out / name)
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            figures = dict.fromkeys(FIELDS, 0) | {"recovery_s": None, "jobs_total": len(workload.jobs),
                                                 "error": f"{type(exc).__name__}: {exc}"[:300]}
        figures["wall_s"] = round(time.monotonic() - began, 1)
        results[name] = figures
        print(f"{name}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    print(table(results))
    print(f"logs in {out}")
    print(json.dumps({"scenarios": {n: {k: f.get(k) for k in FIELDS} for n, f in results.items()}}))
    return 0 if all(meets_targets(f) for f in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
