"""Per-event CPU cost of the event codec: construct, encode and decode, per event type.

For each of Progress (the hot event: one per copy per report), Assignment (nested JobSpec
and tuples) and RoundStarted (tuples of records, a dict), times ``--iterations`` calls of

* ``construct``: ``cls(**fields)`` -- the validated constructor services call;
* ``encode``: :func:`shared.wire.events.encode` of one event;
* ``decode``: :func:`shared.wire.events.decode` of its bytes (validation included);
* ``round_trip``: encode then decode (the bus's codec cost per event, both ends);
* ``seal``: a node's bus sealing the encoded event (:mod:`shared.security.authorship`);
* ``open_sealed``: a trusted service's bus verifying and decoding the sealed record, so
  authorship costs ``seal + open_sealed - decode`` per event (printed as ``authorship``);

``--repeats`` times, and reports the median in microseconds per event of the thread's
CPU time (steadier than wall time on a loaded machine; ``*_wall_us`` is beside it). With
``--cpu N`` the process is pinned to that core first. Prints one line per event type
and, as its last line, one JSON object {"python": ..., "results": {type: {op: us}}}.
Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/codec.py [--iterations 20000]``.

On a machine too busy for stable times, count instructions instead: ``--only T --op O``
times one operation, so two runs under ``valgrind --tool=callgrind`` with different
``--iterations`` (``--repeats 1``) give instructions per call from the difference of
their totals divided by 1.1 x the difference of iterations (a tenth is warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.security.authorship import Sealer, Verifier
from shared.security.identities import Credential, Registry, derive_key
from shared.wire.events import (
    Assignment,
    Event,
    JobSpec,
    Progress,
    RoundStarted,
    Waiting,
    decode,
    encode,
)


def progress_fields() -> dict[str, Any]:
    return dict(ts=1_750_000_000.25, source="agent/node-7", job_id="resnet-17", round=42, copy=1,
                node_id="node-7", gpu_type="v100", workers=2, steps_round=380, steps_total=15_200,
                samples_per_s=1234.5, loss=0.731)


def assignment_fields() -> dict[str, Any]:
    spec = JobSpec(job_id="resnet-17", user="alice", model="resnet18", dataset="cifar10",
                   batch_size=128, workers=4, iterations=50_000, priority=2.0, deadline_s=3600.0)
    return dict(ts=1_750_000_000.25, source="scheduler", round=42, job=spec, copy=1, node_id="node-7",
                gpus=(0, 1, 2, 3), gpu_type="v100", world_size=8, ranks=(4, 5, 6, 7), step_budget=400,
                deadline=1_750_000_360.0, start_from="models/resnet-17/41.safetensors",
                rendezvous="10.0.0.7:29500")


def round_started_fields() -> dict[str, Any]:
    return dict(ts=1_750_000_000.25, source="scheduler", round=42, policy="hadare",
                started_at=1_750_000_000.0, ends_at=1_750_000_360.0,
                nodes=tuple(f"node-{i}" for i in range(16)), assignments=12,
                waiting=tuple(Waiting(job_id=f"job-{i}", code="no_gpu", detail="") for i in range(4)),
                decision_ms=3.2, inputs={f"hadar.progress:{p}": 1000 + p for p in range(6)},
                policy_options='{"alpha":0.5}', seed=7, round_s=360.0, heartbeat_s=5.0)


OPS = ["construct", "encode", "decode", "round_trip", "seal", "open_sealed"]
CASES: dict[str, tuple[type[Event], Callable[[], dict[str, Any]]]] = {
    "Progress": (Progress, progress_fields),
    "Assignment": (Assignment, assignment_fields),
    "RoundStarted": (RoundStarted, round_started_fields),
}


def _time(op: Callable[[], object], iterations: int) -> tuple[float, float]:
    """(cpu us, wall us) per call of ``op`` over ``iterations`` calls."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(iterations):
        op()
    return ((time.thread_time() - cpu) * 1e6 / iterations,
            (time.perf_counter() - wall) * 1e6 / iterations)


def measure(cls: type[Event], make: Callable[[], dict[str, Any]], iterations: int, repeats: int,
            only_ops: list[str] | None = None) -> dict[str, float]:
    fields = make()
    event = cls(**fields)
    wire = encode(event)
    assert decode(wire) == event
    master, identity = bytes(32), "node/node-7"
    sealer = Sealer(Credential(identity=identity, epoch=1, key=derive_key(master, identity, 1)))
    registry = Registry(epochs={identity: 1})
    verifier = Verifier(master, lambda: registry)
    sealed = sealer.seal(wire)
    assert verifier.open(sealed) == event
    ops: dict[str, Callable[[], object]] = {
        "construct": lambda: cls(**fields),
        "encode": lambda: encode(event),
        "decode": lambda: decode(wire),
        "round_trip": lambda: decode(encode(event)),
        "seal": lambda: sealer.seal(wire),
        "open_sealed": lambda: verifier.open(sealed),
    }
    out: dict[str, float] = {"bytes": len(wire)}
    for name, op in ops.items():
        if only_ops and name not in only_ops:
            continue
        _time(op, max(1, iterations // 10))  # warm-up
        runs = [_time(op, iterations) for _ in range(repeats)]
        out[name] = round(statistics.median(c for c, _ in runs), 2)
        out[f"{name}_wall_us"] = round(statistics.median(w for _, w in runs), 2)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=20_000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this core")
    parser.add_argument("--only", choices=list(CASES), action="append", help="event types to time")
    parser.add_argument("--op", choices=OPS, action="append", help="operations to time (default: all)")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.repeats < 1:
        parser.error("--iterations and --repeats must be >= 1")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    results: dict[str, dict[str, float]] = {}
    for name in args.only or list(CASES):
        cls, make = CASES[name]
        results[name] = measure(cls, make, args.iterations, args.repeats, args.op)
        r = results[name]
        times = "  ".join(f"{op} {r[op]:6.2f} us" for op in OPS if op in r)
        if all(op in r for op in ("seal", "open_sealed", "decode")):
            r["authorship"] = round(r["seal"] + r["open_sealed"] - r["decode"], 2)
            times += f"  authorship {r['authorship']:6.2f} us"
        print(f"{name:13s} {r['bytes']:4.0f} B  {times} (CPU, median)", flush=True)
    return {"python": platform.python_version(), "iterations": args.iterations, "repeats": args.repeats,
            "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2), "results": results}


if __name__ == "__main__":
    print(json.dumps(main()))
