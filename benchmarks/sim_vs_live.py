"""The simulator against the live system on one small workload: each job's JCT both ways.

Runs the live system (``hadar demo``'s embedded services: scheduler, tracker, profiler and one
emulated agent per node, on the in-memory bus -- the whole log of this run alone, which a shared
broker's topics, compacted and holding earlier runs, are not -- and on the MinIO of
``HADAR_S3_*`` when set, else a local directory) on ``--jobs`` until they complete, records the event
log, and simulates the same workload from it (``services/scheduler/sim/from_log.py``: the nodes
that registered, each job arriving when the profiler first rated it, the mean measured rates,
the rounds' policy and length) four ways: under the live policy or replaying its recorded
placements, each with the flat default charges or the measured data plane ``--data-plane``.
Prints each job's live and simulated JCT and the ratio of the means; last line one JSON object.

    PYTHONPATH=. python benchmarks/sim_vs_live.py [--nodes t4,a2000] [--policy hadare]
        [--round-s 15] [--jobs examples/jobs/*.yaml] [--data-plane FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cli.demo import LAB_5, run_demo
from services.cli.jobfile import load_job_file, parse_job
from services.scheduler.sim.from_log import JobComparison, compare, live_workload
from services.scheduler.sim.simulator import SimOptions
from shared.bus.eventlog import read_log
from shared.domain.data_plane import load_data_plane
from shared.runtime.logging import configure_logging
from shared.store.settings import s3_from_env

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLANE = ROOT / "shared" / "domain" / "data" / "data_plane" / "dev-vm-minio.json"


def mean_ratio(rows: tuple[JobComparison, ...]) -> float | None:
    """Mean simulated JCT over mean live JCT, over jobs both completed (None if none did)."""
    both = [(r.live_jct_s, r.simulated_jct_s) for r in rows
            if r.live_jct_s is not None and r.simulated_jct_s is not None]
    if not both:
        return None
    return statistics.fmean(s for _, s in both) / statistics.fmean(live for live, _ in both)


def comparisons(log: Path, plane_path: Path, since: float) -> dict[str, Any]:
    """The four simulations of the run recorded from ``since`` (module docstring), keyed
    "<policy|replay>/<flat|plane>"."""
    workload = live_workload((r.event for r in read_log(log)), since=since)
    plane = load_data_plane(plane_path)
    out: dict[str, Any] = {"policy": workload.policy, "round_s": workload.round_s,
                           "nodes": {n.node_id: list(n.gpus) for n in workload.cluster.nodes}, "runs": {}}
    for replay in (False, True):
        for label, options in (("flat", SimOptions()), ("plane", SimOptions(data_plane=plane))):
            rows = compare(workload, options, replay=replay)
            out["runs"][f"{'replay' if replay else 'policy'}/{label}"] = {
                "jobs": {r.job_id: {"live_jct_s": r.live_jct_s, "simulated_jct_s": r.simulated_jct_s} for r in rows},
                "mean_ratio": mean_ratio(rows)}
    return out


async def live_run(args: argparse.Namespace, out: Path) -> tuple[Path, float]:
    token = secrets.token_hex(2)
    specs = [parse_job({**load_job_file(f), "id": f"{Path(f).stem}-{token}"}) for f in args.jobs]
    nodes = tuple((f"n{i}-{t}", t) for i, t in enumerate(args.nodes.split(","))) if args.nodes else LAB_5
    log = out / "events.log"
    settings = s3_from_env()
    demo_args = argparse.Namespace(bootstrap=None,
                                   s3_endpoint=settings.endpoint if settings else None, policy=args.policy,
                                   policy_option=[], seed=0, round_s=args.round_s,
                                   timeout_s=args.timeout_s, record=str(log))
    since = time.time()
    summary = await run_demo(demo_args, specs, out, nodes=nodes)
    if not all(j["completed"] for j in summary["jobs"]):
        raise SystemExit(f"the live run did not complete every job in {args.timeout_s} s")
    return log, since


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", default="", help="emulated GPU types, one node each (default: lab-5)")
    parser.add_argument("--policy", default="hadare")
    parser.add_argument("--round-s", type=float, default=15.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--jobs", nargs="+", default=[str(p) for p in sorted((ROOT / "examples/jobs").glob("*.yaml"))])
    parser.add_argument("--data-plane", type=Path, default=DEFAULT_PLANE)
    parser.add_argument("--out", type=Path, default=None, help="keep the run here (default: a temp directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hadar-sim-vs-live-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "services.log", "w", encoding="utf-8") as services_log:
            configure_logging("bench", level="INFO", stream=services_log)
            log, since = asyncio.run(live_run(args, out))
        result = comparisons(log, args.data_plane, since)
    for name, run in result["runs"].items():
        print(f"{name:13} mean JCT simulated / live: {run['mean_ratio']:.3f}")
        for job, r in run["jobs"].items():
            sim = "-" if r["simulated_jct_s"] is None else f"{r['simulated_jct_s']:.1f}"
            print(f"    {job:28} live {r['live_jct_s']:.1f} s  simulated {sim} s")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
