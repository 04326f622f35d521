"""Round efficiency: the fraction of wall time a job kept on one GPU spends training.

The live path end to end in this process (MemoryBus, LocalStore): scheduler (HadarE),
tracker, profiler and one agent with one device (the CPU standing for a ``--emulate`` type,
unthrottled: it is its own emulation reference; or ``--device cuda``), one job that cannot
finish. For each round length in ``--round-s`` it runs ``--rounds`` rounds after a first one
(the worker's first start, reported apart) and measures, over those rounds:

* samples/s through the system: the copies' reported steps (CopyFinished) x batch size,
  over the wall time from the first measured RoundStarted to the RoundStarted after the
  last one -- each round's start-up, training, checkpoint, consolidation and planning;
* samples/s of a bare torch loop (same model, data, batch, optimizer, one thread), in a
  subprocess of its own for ``--bare-s`` before and after each round-length run, with
  nothing else of ours running (the mean of the two); or, with ``--beside``, running
  alongside the system over exactly the measured rounds, so that on a machine loaded by
  other work both see the same load (on a 2-core machine the two then share the cores);
* efficiency = the first over the second.

Then the start of a copy that *moves* to another device (a fresh or spare process loads
the previous round's model), against one kept on its device (the warm worker reloads in
place): the time from the round's RoundStarted to the copy's first training step, as the
agent measures it (``hadar_agent_copy_start_seconds``).

Usage::

    python benchmarks/round_efficiency.py [--rounds 10] [--round-s 60 15] [--bare-s 20]

Last output line: one JSON object with ``efficiency_60s`` and ``efficiency_15s`` (one key
per round length given), ``move_start_s`` and ``kept_start_s``. Goals: >= 0.95 at 60 s
rounds, >= 0.8 at 15 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.agent.daemon.discovery import (
    NodeDevices,
    cpu_devices,
    discover_in_subprocess,
    emulated_devices,
)
from services.agent.daemon.process import child_env
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from services.profiler.service import ProfilerConfig, ProfilerService
from services.scheduler.config import SchedulerConfig
from services.scheduler.live.service import SchedulerService
from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import MemoryBus
from shared.domain.layout import model_key
from shared.runtime.logging import configure_logging
from shared.store import LocalStore
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Hyperparameters,
    JobSpec,
    JobSubmitted,
    RoundStarted,
    ThroughputEstimate,
)
from shared.wire.topics import ALL_TOPICS, PLACEMENTS, PROGRESS, THROUGHPUT


def job_spec(args: argparse.Namespace, job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, user="bench", model=args.model, dataset=args.dataset, batch_size=args.batch_size,
                   workers=1, iterations=10**8, hyper=Hyperparameters(optimizer=args.optimizer, lr=args.lr))


class BareLoop:
    """The bare loop in its own process, reporting (time, steps) every 0.5 s."""

    def __init__(self, args: argparse.Namespace, devices: NodeDevices) -> None:
        self.args, self.devices = args, devices
        self.samples: list[tuple[float, int]] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        a = self.args
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).with_name("agent_overhead.py")), "--bare-loop", "--model", a.model,
            "--dataset", a.dataset, "--batch-size", str(a.batch_size), "--optimizer", a.optimizer,
            "--lr", str(a.lr), "--device", a.device, "--report-s", "0.5", stdout=asyncio.subprocess.PIPE,
            env=child_env({"CUDA_VISIBLE_DEVICES": self.devices.visible.get(self.devices.gpus[0].index, "")}))
        self._reader = asyncio.create_task(self._read())
        while not self.samples:
            await asyncio.sleep(0.1)

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        async for line in self._proc.stdout:
            t, steps = json.loads(line)
            self.samples.append((float(t), int(steps)))

    def rate(self, start: float, end: float) -> float:
        inside = [s for s in self.samples if start <= s[0] <= end]
        return (inside[-1][1] - inside[0][1]) * self.args.batch_size / (inside[-1][0] - inside[0][0])

    async def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            await self._proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


async def bare_rate(args: argparse.Namespace, devices: NodeDevices, seconds: float) -> float:
    """Samples/s of the bare loop over ``seconds`` after its first report (imports excluded)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).with_name("agent_overhead.py")), "--bare-loop", "--model", args.model,
        "--dataset", args.dataset, "--batch-size", str(args.batch_size), "--optimizer", args.optimizer,
        "--lr", str(args.lr), "--device", args.device, "--report-s", "0.5", stdout=asyncio.subprocess.PIPE,
        env=child_env({"CUDA_VISIBLE_DEVICES": devices.visible.get(devices.gpus[0].index, "")}))
    assert proc.stdout is not None
    try:
        first = json.loads(await proc.stdout.readline())
        last = first
        while last[0] - first[0] < seconds:
            last = json.loads(await proc.stdout.readline())
    finally:
        proc.kill()
        await proc.wait()
    return (last[1] - first[1]) * args.batch_size / (last[0] - first[0])


async def rounds_run(args: argparse.Namespace, devices: NodeDevices, round_s: float,
                     beside: BareLoop | None = None) -> dict:
    """One system, one job, ``1 + --rounds`` rounds of ``round_s``; the measured rounds' numbers
    (and, with ``beside``, the bare loop's rate over the same wall-clock interval)."""
    bus = MemoryBus(source="bench")
    await bus.start()
    with tempfile.TemporaryDirectory(prefix="hadar-bench-rounds-") as root:
        store = LocalStore(Path(root))
        await bus.ensure_topics(ALL_TOPICS)
        await store.start()
        services = [
            ProfilerService(bus=bus, config=ProfilerConfig()),
            TrackerService(bus=bus, store=store, config=TrackerConfig(finish_timeout_s=30.0, tick_s=0.1)),
            AgentDaemon(AgentConfig(node_id="bench", progress_s=2.0, heartbeat_s=1.0, threads=1), bus=bus,
                        store=StoreTarget.local(root), devices=devices),
            SchedulerService(bus=bus, config=SchedulerConfig(round_s=round_s, heartbeat_s=1.0,
                                                             consolidation_wait_s=60.0)),
        ]
        starts: dict[int, float] = {}
        steps: dict[int, int] = {}
        waits: dict[int, list[str]] = {}
        sub = bus.subscribe([PLACEMENTS, PROGRESS], "bench-watch")
        await sub.start()

        async def watch() -> None:
            async for d in sub:
                await d.ack()
                if isinstance(d.event, RoundStarted):
                    starts[d.event.round] = d.event.started_at
                    if d.event.waiting:
                        waits[d.event.round] = [f"{w.code}: {w.detail}" for w in d.event.waiting]
                elif isinstance(d.event, CopyFinished) and d.event.status != "failed":
                    steps[d.event.round] = steps.get(d.event.round, 0) + d.event.steps_round

        watcher = asyncio.create_task(watch())
        try:
            for service in services[:-1]:
                await service.start()
            spec = job_spec(args, f"eff-{int(round_s)}")
            await bus.publish(JobSubmitted(ts=time.time(), source="bench", job=spec, submitted_at=time.time()))
            # the scheduler starts once the profiler's estimate is on the log (it reads it at start),
            # so round 0 already runs the job: the first round is the worker's first start, not a wait
            async with bus.subscribe([THROUGHPUT], "bench-estimate") as estimates:
                async for d in estimates:
                    await d.ack()
                    if isinstance(d.event, ThroughputEstimate):
                        break
            await services[-1].start()
            last = args.rounds + 1   # rounds 1..rounds are measured; round 0 is the first start
            deadline = time.monotonic() + (last + 1) * (round_s * 3 + 60)
            while last not in starts:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"round {last} did not start; rounds seen {sorted(starts)}")
                await asyncio.sleep(0.1)
            agent = services[2]
            assert isinstance(agent, AgentDaemon)
            spawned = {a: agent.registry.get_sample_value("hadar_agent_worker_slots_total",
                                                          {"node": "bench", "emulated": str(devices.emulated).lower(),
                                                           "action": a}) or 0
                       for a in ("spawn", "reuse", "respawn")}
        finally:
            for service in reversed(services):
                await service.stop()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await sub.stop()
            await store.stop()
            await bus.stop()
    wall = starts[last] - starts[1]
    measured = sum(steps.get(r, 0) for r in range(1, last))
    lengths = [starts[r + 1] - starts[r] for r in range(1, last)]
    return {"samples_per_s": measured * args.batch_size / wall, "wall_s": wall,
            "first_round_s": starts[1] - starts[0], "first_round_steps": steps.get(0, 0),
            "round_wall_s_median": statistics.median(lengths), "steps_per_round": [steps.get(r, 0) for r in
                                                                                  range(last)],
            "slots": spawned, "waiting": {r: w for r, w in waits.items() if r <= last},
            "bare_beside_samples_s": beside.rate(starts[1], starts[last]) if beside is not None else None}


async def move_start(args: argparse.Namespace) -> dict:
    """Start of a copy that moves to another device vs. one kept: RoundStarted -> first step."""
    bus = MemoryBus(source="bench")
    await bus.start()
    with tempfile.TemporaryDirectory(prefix="hadar-bench-move-") as root:
        store = LocalStore(Path(root))
        await store.start()
        agent = AgentDaemon(AgentConfig(node_id="mover", progress_s=2.0, threads=1, spare_workers=1), bus=bus,
                            store=StoreTarget.local(root), devices=cpu_devices(2))
        await agent.start()
        sub = bus.subscribe([PROGRESS], "bench-move")
        await sub.start()
        spec = job_spec(args, "mover")
        out = {}
        try:
            start_from = None
            for r, (gpu, name) in enumerate(((0, "first"), (1, "moved"), (1, "kept"))):
                now = time.time()
                await bus.publish(RoundStarted(ts=now, source="bench", round=r, policy="hadare", started_at=now,
                                            ends_at=now + 30))
                await bus.publish(Assignment(ts=now, source="bench", round=r, job=spec, copy=0, node_id="mover",
                                          gpus=(gpu,), gpu_type="cpu", world_size=1, ranks=(0,),
                                          step_budget=args.move_steps, deadline=now + 120, start_from=start_from))
                async for d in sub:
                    await d.ack()
                    if isinstance(d.event, CopyFinished) and d.event.round == r:
                        break
                assert d.event.status == "ok", d.event.reason
                await store.put(model_key("mover", r), await store.get(d.event.checkpoint or ""))
                start_from = model_key("mover", r)
                for warm in ("true", "false"):
                    labels = {"node": "mover", "emulated": "false", "warm": warm}
                    total = agent.registry.get_sample_value("hadar_agent_copy_start_seconds_sum", labels) or 0.0
                    out.setdefault(name, {})[warm] = total
        finally:
            await sub.stop()
            await agent.stop()
            await store.stop()
            await bus.stop()
    # the histogram sums grow round by round: each round's value is the difference
    moved = out["moved"]["false"] - out["first"]["false"]
    kept = out["kept"]["true"] - out["moved"]["true"]
    return {"move_start_s": round(moved, 3), "kept_start_s": round(kept, 3)}


async def main_async(args: argparse.Namespace, devices: NodeDevices) -> dict:
    result: dict = {"rounds": args.rounds, "model": args.model, "dataset": args.dataset,
                    "batch_size": args.batch_size, "device": args.device}
    for round_s in args.round_s:
        if args.beside:
            bare_loop = BareLoop(args, devices)
            await bare_loop.start()
            try:
                run = await rounds_run(args, devices, round_s, bare_loop)
            finally:
                await bare_loop.stop()
            before = after = bare = run["bare_beside_samples_s"]
        else:
            before = await bare_rate(args, devices, args.bare_s)
            run = await rounds_run(args, devices, round_s)
            after = await bare_rate(args, devices, args.bare_s)
            bare = (before + after) / 2
        efficiency = run["samples_per_s"] / bare
        key = f"{round_s:g}s"
        result[f"efficiency_{key}"] = round(efficiency, 4)
        result[f"detail_{key}"] = {"system_samples_s": round(run["samples_per_s"], 1),
                                   "bare_samples_s_before": round(before, 1), "bare_samples_s_after": round(after, 1),
                                   **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items()
                                      if k != "samples_per_s"}}
        print(f"rounds of {key}: efficiency {efficiency:.3f} (system {run['samples_per_s']:.1f} samples/s, "
              f"bare {before:.1f} / {after:.1f})", file=sys.stderr)
    result.update(await move_start(args))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds measured (after the first)")
    parser.add_argument("--round-s", type=float, nargs="+", default=[60.0, 15.0], help="round lengths to run")
    parser.add_argument("--bare-s", type=float, default=20.0, help="seconds of each bare-loop measurement")
    parser.add_argument("--beside", action="store_true",
                        help="run the bare loop beside the system, over the same rounds (a machine shared with "
                             "other work: both see the same load), instead of before and after")
    parser.add_argument("--move-steps", type=int, default=50, help="steps per round of the move measurement")
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--emulate", default="v100", help="on the CPU: the GPU type the device stands for")
    parser.add_argument("--log", default=None, help="service log file (default: discarded)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.round_s) <= 0:
        parser.error("--rounds must be >= 1 and --round-s > 0")
    with open(args.log or "/dev/null", "w", encoding="utf-8") as log:
        configure_logging("bench", level="INFO", stream=log)
        # on the CPU: one emulated device of its own reference type, so it is not throttled (slowdown 1)
        # and the profiler has a catalog type to estimate for
        devices = (asyncio.run(discover_in_subprocess()) if args.device == "cuda"
                   else emulated_devices(((args.emulate, 1),), args.emulate))
        if args.device == "cuda" and devices.kind != "cuda":
            print("--device cuda: no CUDA device found", file=sys.stderr)
            return 2
        result = asyncio.run(main_async(args, devices))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
