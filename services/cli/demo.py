"""``hadar demo``: the whole system in one process, on a 5-node emulated lab cluster.

Every service runs (scheduler with HadarE rounds of a few seconds, tracker, profiler and
five agents emulating lab-5's GPUs on this CPU); a handful of small jobs from
``examples/jobs`` are submitted through the same path as ``hadar submit``; they train for
real and are weight-averaged every round. At the end it prints per-job results and a
simulated comparison of the same jobs under hadar, hadare and gavel, and writes
``summary.json`` and the final models under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

from services.cli.jobfile import JobFileError, load_job_file, parse_job
from services.cli.jobs import jobs_table, submit
from services.scheduler.cli import add_policy_args, policy_options
from services.scheduler.live.state import SchedulerState
from shared.errors import UsageError
from shared.runtime.connection import add_bus_args, kafka_settings, s3_settings
from shared.runtime.logging import configure_logging

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "jobs"
LAB_5 = (("lab-titanrtx", "titanrtx"), ("lab-t4", "t4"), ("lab-t400", "t400"),
         ("lab-rtx3090", "rtx3090"), ("lab-a2000", "a2000"))
COMPARED = ("hadar", "hadare", "gavel")
DEMO_PLANE = "data/data_plane/dev-vm-minio.json"   # in shared.domain's package data


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole system in one process on an emulated 5-GPU lab cluster")
    p.add_argument("--out", default="demo-out", help="output directory (summary.json, models, log)")
    add_bus_args(p)
    p.add_argument("--s3", dest="s3_endpoint", default=None,
                   help="S3 endpoint URL (credentials from HADAR_S3_ACCESS_KEY / HADAR_S3_SECRET_KEY)")
    add_policy_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed passed to the policy")
    p.add_argument("--round-s", type=float, default=15.0)
    p.add_argument("--timeout-s", type=float, default=270.0, help="give up waiting for the jobs after this")
    p.add_argument("--jobs", nargs="*", default=None, help="job files (default: examples/jobs/*.yaml)")
    p.add_argument("--record", default=None, help="write the event log to this file (for hadar replay --file)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    files = [Path(f) for f in args.jobs] if args.jobs else sorted(EXAMPLES.glob("*.yaml"))
    if not files:
        raise UsageError("--jobs: no job files")
    token = secrets.token_hex(2)
    specs = []
    try:
        for f in files:   # a run-unique id suffix: a persistent Kafka may hold earlier demos
            data = load_job_file(f)
            specs.append(parse_job({**data, "id": f"{data.get('id', f.stem)}-{token}"}))
    except JobFileError as exc:
        raise UsageError(str(exc)) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "demo.log", "w", encoding="utf-8") as log:
        configure_logging("demo", level="INFO", stream=log)
        summary = asyncio.run(run_demo(args, specs, out))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print_results(summary)
    print(f"\nwrote {out / 'summary.json'}; service logs in {out / 'demo.log'}")
    return 0 if all(j["completed"] for j in summary["jobs"]) else 1


def _make_ports(args: argparse.Namespace, out: Path):
    from services.agent.protocol import StoreTarget
    from shared.bus import Bus, KafkaBus, MemoryBus
    from shared.store import LocalStore, MinioStore

    bus: Bus
    if args.bootstrap:
        bus = KafkaBus.from_settings(kafka_settings(args), source="demo")
    else:
        bus = MemoryBus(source="demo")
    if args.s3_endpoint:
        settings = s3_settings(args)
        return bus, MinioStore(settings), StoreTarget.remote(settings)
    root = out / "store"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    return bus, LocalStore(root), StoreTarget.local(root)


async def run_demo(args: argparse.Namespace, specs, out: Path, nodes: tuple[tuple[str, str], ...] = LAB_5) -> dict:
    """The embedded system on ``nodes`` ((node id, emulated GPU type), one GPU each) until every job
    of ``specs`` completes or ``args.timeout_s``; the summary (and, with ``args.record``, the log)."""
    from services.embedded import EmbeddedConfig, EmbeddedSystem
    from shared.bus.eventlog import dump_bus

    bus, store, target = _make_ports(args, out)
    config = EmbeddedConfig(nodes=nodes, policy=args.policy, policy_options=policy_options(args),
                            round_s=args.round_s, seed=args.seed,
                            scheduler_group=f"hadar-demo-scheduler-{secrets.token_hex(3)}")
    system = EmbeddedSystem(config=config, bus=bus, store=store, store_target=target)
    await bus.start()
    started = time.monotonic()
    try:
        await system.start()
        print(f"hadar demo: {len(nodes)} emulated agents ({', '.join(t for _, t in nodes)}), "
              f"policy {args.policy}, rounds of {args.round_s:g} s")
        for spec in specs:
            await submit(bus, spec, source="demo")
        state = system.scheduler.state
        ids = [s.job_id for s in specs]
        while time.monotonic() - started < args.timeout_s:
            await asyncio.sleep(3.0)
            print(f"\n[{time.monotonic() - started:5.0f} s] round {state.last_round}")
            print(jobs_table(_only(state, ids), include_done=True))
            if all(state.jobs.get(i) is not None and state.jobs[i].completed_at is not None for i in ids):
                break
        await system.stop()
        if args.record:
            n = await dump_bus(bus, args.record)
            print(f"recorded {n} events to {args.record}")
        wall = time.monotonic() - started
        rates = await _published_rates(bus)
        return await _summarise(specs, state, rates, store, out, args, wall, nodes)
    finally:
        await bus.stop()


def _only(state: SchedulerState, ids: list[str]) -> SchedulerState:
    view = SchedulerState()
    view.jobs = {i: state.jobs[i] for i in ids if i in state.jobs}
    view.rounds, view.last_round = state.rounds, state.last_round
    return view


async def _published_rates(bus) -> dict[tuple[str, str, int], float]:
    """Every job's steps/s per (GPU type, workers) as the profiler last published them,
    folded by the scheduler's rule (``merge_rates``); the scheduler itself forgets a
    finished job's rates, so they are read back from the topic."""
    from services.scheduler.live.state import merge_rates
    from shared.wire.events import ThroughputEstimate
    from shared.wire.topics import THROUGHPUT

    rates: dict[tuple[str, str, int], tuple[str, float]] = {}
    async for delivery in bus.read(THROUGHPUT):
        if isinstance(delivery.event, ThroughputEstimate):
            merge_rates(rates, delivery.event)
    return {key: rate for key, (_, rate) in rates.items()}


async def _summarise(specs, state: SchedulerState, rates: dict[tuple[str, str, int], float], store, out: Path,
                     args, wall_s: float, nodes: tuple[tuple[str, str], ...]) -> dict:
    models = out / "models"
    models.mkdir(exist_ok=True)
    jobs = []
    for spec in specs:
        record = state.jobs.get(spec.job_id)
        entry = {"job": spec.job_id, "model": spec.model, "dataset": spec.dataset, "iterations": spec.iterations,
                 "completed": bool(record and record.completed_at is not None)}
        if record is not None:
            entry["steps"] = record.steps_done
            entry["rounds_run"] = record.rounds_run
        if entry["completed"]:
            assert record is not None and record.completed_at is not None   # what "completed" says
            entry["jct_s"] = round(record.completed_at - record.submitted_at, 2)
            path = models / f"{spec.job_id}.safetensors"
            await store.get_file(record.final_key, path)
            entry["final_model"] = str(path)
            entry["metric"] = _held_out_metric(spec, path)
        jobs.append(entry)
    return {"policy": args.policy, "round_s": args.round_s, "wall_s": round(wall_s, 1),
            "rounds": state.last_round + 1, "live_utilization": state.allocation_utilization(),
            "jobs": jobs, "simulated": _simulate_same_jobs(specs, rates, args.round_s, args.policy, nodes)}


def _held_out_metric(spec, path: Path) -> dict:
    from services.agent.worker.checkpoint import read_checkpoint, restore
    from shared.zoo import build_model, dataset_info, evaluate, load_dataset

    tensors, _ = read_checkpoint(path)
    model = build_model(spec.model, dataset_info(spec.dataset), seed=spec.hyper.seed)
    restore(model, None, tensors)
    metric = evaluate(model, load_dataset(spec.dataset))
    return {"name": metric.name, "value": round(float(metric.value), 4)}


def _simulate_same_jobs(specs, rates: dict[tuple[str, str, int], float], round_s: float, live_policy: str,
                        nodes: tuple[tuple[str, str], ...]) -> dict:
    """The same jobs, all arriving at 0, on the same nodes in the simulator, at the rates the profiler
    published (measured, and for emulated GPUs extrapolated from the measurements), every move
    charged from the data plane measured on this project's dev machine (``DEMO_PLANE``); the
    live run's policy among them, with each job's JCT, to set beside the live one's."""
    from services.scheduler.core.cluster import Cluster, Node
    from services.scheduler.core.throughput import ThroughputModel
    from services.scheduler.policies import make_policy
    from services.scheduler.sim.results import compute_results
    from services.scheduler.sim.simulator import SimOptions, simulate
    from services.scheduler.sim.traces import TraceJob
    from shared.domain.data_plane import load_data_plane
    from shared.zoo import model_figures

    cluster = Cluster(name="demo", nodes=tuple(Node(node_id=node, gpus=(gpu_type,)) for node, gpu_type in nodes))
    throughput = ThroughputModel(rates=dict(rates))
    trace = [TraceJob(job_id=s.job_id, arrival_s=0.0, job_type=s.job_id, workers=s.workers,
                      total_steps=s.iterations) for s in specs]
    sizes = {s.job_id: model_figures(s.model, s.batch_size, s.dataset).param_bytes for s in specs}
    with resources.as_file(resources.files("shared.domain").joinpath(DEMO_PLANE)) as plane:
        options = SimOptions(round_s=round_s, data_plane=load_data_plane(plane))
    results: dict = {"charged": options.charges().describe(), "policies": {}}
    for name in dict.fromkeys((live_policy, *COMPARED)):
        result = simulate(policy=make_policy(name), cluster=cluster, jobs=trace, throughput=throughput,
                          options=options, model_bytes=sizes.__getitem__)
        m = compute_results(result, throughput)
        results["policies"][name] = {
            "ttd_s": m.ttd_s, "cru": m.cru, "jct_mean_s": m.jct_mean_s, "jobs_completed": m.jobs_completed,
            "jobs_total": m.jobs_total,
            "jct_s": {j.job_id: j.completion_s - j.arrival_s for j in result.jobs if j.completion_s is not None}}
    return results


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_results(summary: dict) -> None:
    print(f"\nResults ({summary['policy']}, {summary['rounds']} rounds, {summary['wall_s']} s wall, "
          f"GPU allocation {_fmt(summary['live_utilization'], '.0%')}):")
    print(f"{'JOB':28} {'JCT s':>7} {'STEPS':>6}  {'METRIC':18} FINAL MODEL")
    for j in summary["jobs"]:
        metric = j.get("metric")
        text = f"{metric['name']}={metric['value']:.4f}" if metric else "-"
        print(f"{j['job']:28} {_fmt(j.get('jct_s'), '7.1f')} {j.get('steps', 0):>6}  {text:18} "
              f"{j.get('final_model', 'not completed')}")
    print("\nSame jobs in the simulator (the same nodes at the profiler's rates, all arriving at t=0; charged: "
          f"{summary['simulated']['charged']}):")
    print(f"{'POLICY':8} {'TTD s':>8} {'CRU':>6} {'mean JCT s':>11} {'done':>6}")
    for name, m in summary["simulated"]["policies"].items():
        print(f"{name:8} {_fmt(m['ttd_s'], '8.1f')} {_fmt(m['cru'], '6.2f')} {_fmt(m['jct_mean_s'], '11.1f')} "
              f"{m['jobs_completed']:>3}/{m['jobs_total']}")
    sys.stdout.flush()
