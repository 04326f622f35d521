"""What a crash or an outage costs: one fault at a time on real Kafka + MinIO (issues 13 and 28).

    PYTHONPATH=. python benchmarks/faults.py [--scenarios NAME ...] [--replicated] [--out DIR]

Each scenario starts its own Kafka and MinIO -- one broker and one drive, or for the
``replicated_*`` scenarios (``--replicated`` runs them all) three brokers and four drives as
``hadar infra up --brokers 3 --drives 4`` starts them (``benchmarks/fault_replicated.py``) --
and every service as its own process (``benchmarks/fault_harness.py``: scheduler, tracker,
profiler, emulated agents), submits a small workload, waits until it is mid-work (a round
consolidated and a job still running; some faults strike at a round's deadline, while the
tracker consolidates), injects one fault, and waits for every job to complete. Printed per
scenario: jobs completed/total, models verified/total (each round model against the
samples-weighted average of its stored replicas), events lost (results produced and never
consumed), acknowledged records lost (ids journaled at ack time by every producer, looked
up in the topics read back after the services stopped: ``benchmarks/fault_acks.py``),
service crashes, rounds lost (worst job), recovery time (end of the fault to the next model
that added steps), the standby's takeover time, and notes (writes resumed, acks while two
brokers were down, a miss). A fault that finds nothing to hit is a miss, with its reason,
never "0 jobs completed". The last line is one JSON object ``{"scenarios": {name: {...}}}``.

Targets: ``benchmarks/fault_report.py``. Exit code 1 if a scenario misses one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fault_acks import acked_lost, fencing_violations, read_acks, term_regressions
from benchmarks.fault_harness import (
    Cluster,
    Miss,
    Workload,
    events_lost,
    progress_times,
    round_numbering_faults,
    rounds_lost,
    verify_models,
)
from benchmarks.fault_junk import junk
from benchmarks.fault_replicated import REPLICATED_SCENARIOS, acks_between, first_ack_after, held_between
from benchmarks.fault_report import FIELDS, meets_targets, table
from benchmarks.fault_scenarios import (
    Scenario,
    agent_kill,
    agent_kill_restart,
    agent_stop,
    baseline,
    consolidating_when_struck,
    kill_restart,
    server_outage,
    standby_freeze,
    standby_kill,
    tracker_kill_consolidating,
)
from shared.runtime.logging import configure_logging
from shared.wire.events import LeaderRenewed

__all__ = ["SCENARIOS", "STANDBY_SCENARIOS", "REPLICATED", "SCENARIO_SCALE", "scaled", "run_scenario",
           "meets_targets", "table", "main"]

SCENARIOS: dict[str, Scenario] = {
    "baseline": baseline,
    "agent_kill": agent_kill,
    "agent_kill_restart": agent_kill_restart,
    "agent_stop": agent_stop,
    "scheduler_kill": kill_restart("scheduler"),
    "tracker_kill": tracker_kill_consolidating,
    "profiler_kill": kill_restart("profiler"),
    "kafka_outage": server_outage("kafka", 20.0),
    "minio_outage": server_outage("minio", 30.0),
    # Long outages (issue 13 item 4): under the watchdog's 120 s and the store's 90 s retry.
    "kafka_outage_75s": server_outage("kafka", 75.0),
    "minio_outage_70s": server_outage("minio", 70.0),
    "junk": junk,
    "junk_at_start": lambda c, timeout_s: junk(c, timeout_s, wait=False),
    # Two scheduler replicas (issue 28 item 3): these run with Workload.standby.
    "standby_kill": standby_kill,
    "standby_freeze": standby_freeze,
    # The replicated backbone (issue 28 item 5): these run with Workload.brokers=3, drives=4.
    **REPLICATED_SCENARIOS,
}
STANDBY_SCENARIOS = frozenset({"standby_kill", "standby_freeze", "replicated_standby_kill",
                               "replicated_standby_freeze"})
REPLICATED = frozenset(REPLICATED_SCENARIOS)

# Scenarios whose fault lasts long (a server down 20-30 s, then restarted) run jobs this many
# times longer (on top of --scale): with the default jobs a quiet machine finished both
# before MinIO came back, and the outage then tested nothing. Two brokers down: 20 s, then a
# broker's restart (6-40 s here) and its catching up before writes resume.
SCENARIO_SCALE: dict[str, float] = {"kafka_outage": 3.0, "minio_outage": 3.0, "kafka_outage_75s": 3.0,
                                     "minio_outage_70s": 3.0, "replicated_two_brokers_kill": 3.0,
                                     "tracker_kill": 1.5, "replicated_drive_lost": 3.0,
                                     # frozen past a lease and a round (45-60 s): both jobs were done by then
                                     "standby_freeze": 3.0, "replicated_standby_freeze": 3.0}


def scaled(workload: Workload, scale: float) -> Workload:
    """``workload`` with every job's iterations multiplied by ``scale`` (at least 1)."""
    return replace(workload, jobs=tuple((m, d, max(1, round(n * scale))) for m, d, n in workload.jobs))


def run_scenario(names: str | Sequence[str], workload: Workload, workdir: Path) -> dict[str, Any]:
    """Run one scenario (or several faults one after the other, each once the workload is
    mid-work after the previous one) in ``workdir`` and return its figures; ``recovery_s``
    is the longest recovery. A fault that finds nothing to hit ends the faults there and sets
    ``miss`` to why; the figures are still those of the run."""
    names = [names] if isinstance(names, str) else list(names)
    if STANDBY_SCENARIOS & set(names):
        workload = replace(workload, standby=True)
    if REPLICATED & set(names):
        workload = replace(workload, brokers=3, drives=4)
    with Cluster(workdir, workload) as c:
        c.start_all()
        c.wait_registered()
        c.phase("services_registered")
        c.submit()
        c.phase("submitted")
        ends: list[float] = []
        miss = None
        for name in names:
            try:
                end = SCENARIOS[name](c, workload.timeout_s)
            except Miss as exc:
                miss = f"{name}: {exc}"
                c.phase(f"fault:{name}")
                break
            c.phase(f"fault:{name}")   # waiting for mid-work, then the fault and its end
            if end is not None:
                c.last_fault_end = end
                ends.append(end)
        try:
            records = c.wait(c.all_completed, timeout_s=workload.timeout_s)
        except TimeoutError:
            records = c.log()
        c.phase("jobs_completed")
        crashes = c.crashes()
        c.stop_services()   # every acknowledgement is journaled now: read the topics back after it
        final = c.log_records()
        records = [(r.topic, r.event) for r in final] or records
        acks = read_acks(c.acks_dir)
        c.phase("services_stopped")
        models = c.models(records)
        assert c.s3 is not None
        verified = asyncio.run(verify_models(c.s3, models, records, workdir / "verify"))
        c.phase("verified")
        lost = rounds_lost(records, c.job_ids, c.forged_ids)
        times = sorted([*progress_times(models), *(e.ts for e in c.completions(records))])
        recoveries = [min((t - end for t in times if t >= end), default=None) for end in ends]
        completions = [e.ts for e in c.completions(records)]
        if miss is None and len(completions) == len(c.job_ids) and c.strikes and max(completions) <= c.strikes[0]:
            miss = "every job completed before the fault struck"
        elif miss is None and len(completions) == len(c.job_ids) and ends and max(completions) <= ends[-1]:
            miss = "every job completed before the fault ended"
        notes = dict(c.notes)
        for note, since, partitions in c.watches:
            notes[note] = first_ack_after(acks, since, partitions)
        for note, start, stop in c.quiet:
            notes[note] = acks_between(acks, start, stop)
            notes["held_till_return"] = held_between(acks, start, stop)
        if "target" in notes:
            notes["consolidating"] = consolidating_when_struck(c, records)
            if miss is None and notes["consolidating"] is False:
                miss = f"{notes['target']} was decided before the fault struck"
        renewals = [(r.partition, r.offset, r.event.term) for r in final
                    if isinstance(r.event, LeaderRenewed) and r.event.role == "scheduler"]
        return {
            "jobs_completed": len(c.completed(records)), "jobs_total": len(c.job_ids),
            "models_verified": verified, "models_total": len(models),
            "events_lost": events_lost(records, c.job_ids, c.forged_ids),
            "acked_records_lost": acked_lost(acks, (r.event.id for r in final)) if final else None,
            "acks": len(acks),
            "service_crashes": sum(len(s.crashes) for s in c.services.values()),
            "rounds_lost_max": max(lost.values(), default=0),
            "recovery_s": (None if not ends or None in recoveries
                           else round(max(r for r in recoveries if r is not None), 1)),
            "faults": len(ends),
            "miss": miss,
            # jobs already complete when the last fault ended: a fault after which no job was
            # left tested nothing (the workload is too small for the machine's speed at the time)
            "done_before_fault": sum(1 for t in completions if ends and t <= ends[-1]),
            "restart_failures": list(c.restart_failures),
            "round_numbering_faults": round_numbering_faults(records),   # a round twice or a number skipped
            # a superseded scheduler's records after its successor's, and renewals of an older term after a newer
            "fencing_violations": (sum(fencing_violations(acks, old, new) for old, new in c.superseded)
                                   + term_regressions(renewals)),
            "takeover_s": list(c.takeovers),   # fault start to the successor's first renewal
            "round_s": workload.round_s,
            "step_downs": list(c.step_downs),
            "crashed": sorted(crashes),
            "notes": notes,
            "backbone": f"{workload.brokers} broker(s), {workload.drives} drive(s)",
            "phases": c.phases,   # the same dict: the cluster's exit adds "stopped"
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--scenarios", nargs="*", default=None, choices=list(SCENARIOS),
                   help="default: every scenario (with --replicated: every replicated one)")
    p.add_argument("--replicated", action="store_true", help="the replicated_* scenarios (3 brokers, 4 drives)")
    p.add_argument("--out", default=None, help="keep each scenario's logs here (default: a temporary directory)")
    p.add_argument("--round-s", type=float, default=Workload.round_s)
    p.add_argument("--timeout-s", type=float, default=Workload.timeout_s, help="per scenario, for the jobs")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every job's iterations (some scenarios: "
                   "x SCENARIO_SCALE more; a faster machine "
                   "finishes the default jobs before a fault)")
    args = p.parse_args(argv)
    chosen = args.scenarios or [n for n in SCENARIOS if not args.replicated or n in REPLICATED]
    workload = scaled(Workload(round_s=args.round_s, timeout_s=args.timeout_s), args.scale)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hadar-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    # The harness's own log (e.g. every junk record its log reads skip) goes to a file.
    configure_logging("faults", level="INFO", stream=open(out / "harness.log", "a", encoding="utf-8"))  # noqa: SIM115 - the harness logs there until it exits
    results: dict[str, dict] = {}
    for name in chosen:
        began = time.monotonic()
        load = os.getloadavg()
        try:
            figures = run_scenario(name, scaled(workload, SCENARIO_SCALE.get(name, 1.0)), out / name)
        except Exception as exc:   # no figures: an error, shown as such (never as 0 jobs completed)
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            figures = dict.fromkeys(FIELDS) | {"jobs_total": len(workload.jobs),
                                               "error": f"{type(exc).__name__}: {exc}"[:300]}
        figures["wall_s"] = round(time.monotonic() - began, 1)
        figures["loadavg"] = [round(x, 2) for x in (*load, *os.getloadavg())]   # 1/5/15 min, before and after
        results[name] = figures
        print(f"{name}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    print(table(results))
    print(f"logs in {out}")
    print(json.dumps({"scenarios": {n: {k: f.get(k) for k in FIELDS} for n, f in results.items()}}))
    return 0 if all(meets_targets(f) for f in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
