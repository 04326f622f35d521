"""Agent overhead: samples/s of a job copy trained through the agent vs. a bare torch loop.

Through the agent: a real :class:`AgentDaemon` (MemoryBus, LocalStore) in this process
gets one Assignment and trains it in its worker subprocess (one torch thread). Bare: the
same model, dataset, batch size, optimizer and thread count in a plain ``for`` loop in
one subprocess of its own. Both are started, warmed up, and then take turns: in each
phase one of the two processes runs and the other is stopped (SIGSTOP), so both see the
same machine, however busy it is with other work. Rates are read within each phase:

* agent -- from the Progress events the daemon publishes (its own timestamps and
  ``steps_total``): the steps between the first and last event of the phase over the time
  between them, so everything the agent does on the way (worker loop, pipe, daemon
  relay, bus) counts;
* bare -- from the bare process's own step counter, reported the same way.

Each side's median over its phases is reported, and, as a check on drift, the median of
each agent phase's rate over the mean of the bare phases around it. Usage::

    python benchmarks/agent_overhead.py [--phases 12] [--phase-s 3] [--model resnet] [--device cuda]

Last output line: one JSON object ``{"agent_samples_s": a, "bare_samples_s": b, "ratio":
a/b, ...}``. Target: ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
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
)
from services.agent.daemon.process import child_env
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from shared.bus import MemoryBus
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Hyperparameters,
    JobSpec,
    Progress,
)
from shared.wire.topics import PROGRESS
from shared.zoo import validate_job

Sample = tuple[float, int]   # (unix time, total steps)


def bare_loop(args: argparse.Namespace) -> None:
    """The baseline: a plain training loop printing (time, steps) every ``report_s``."""
    import torch

    from shared.zoo import build_model, load_dataset, loss_function, make_optimizer

    torch.set_num_threads(1)
    device = torch.device(args.device)
    data = load_dataset(args.dataset)
    model = build_model(args.model, data.info, seed=0).to(device)
    opt = make_optimizer(args.optimizer, model.parameters(), args.lr)
    loss_fn = loss_function(data.info.task)
    x_all, y_all = data.train_x.to(device), data.train_y.to(device)
    gen = torch.Generator().manual_seed(0)
    steps, last = 0, time.time()
    while True:
        index = torch.randint(len(x_all), (args.batch_size,), generator=gen).to(device)
        loss = loss_fn(model(x_all[index]), y_all[index])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        now = time.time()
        if now - last >= args.report_s:
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(json.dumps([time.time(), steps]), flush=True)
            last = now


def phase_rate(samples: list[Sample], start: float, end: float, batch_size: int) -> float | None:
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) * batch_size / (inside[-1][0] - inside[0][0])


async def wait_for(samples: list[Sample], n: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while len(samples) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no progress within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def measure(args: argparse.Namespace, devices: NodeDevices) -> tuple[list[float], list[float]]:
    spec = JobSpec(job_id="bench", user="bench", model=args.model, dataset=args.dataset, batch_size=args.batch_size,
                   workers=1, iterations=10**9, hyper=Hyperparameters(optimizer=args.optimizer, lr=args.lr))
    validate_job(spec)
    bus = MemoryBus()
    await bus.start()
    agent_samples: list[Sample] = []
    bare_samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="hadar-bench-") as root:
        agent = AgentDaemon(AgentConfig(node_id="bench", progress_s=args.report_s, threads=1), bus=bus,
                            store=StoreTarget.local(root), devices=devices)
        await agent.start()
        sub = bus.subscribe(PROGRESS, "bench")
        await sub.start()

        async def collect_agent() -> None:
            async for delivery in sub:
                await delivery.ack()
                if isinstance(delivery.event, Progress):
                    agent_samples.append((delivery.event.ts, delivery.event.steps_total))
                elif isinstance(delivery.event, CopyFinished):
                    raise RuntimeError(f"copy ended early: {delivery.event.status} {delivery.event.reason}")

        collector = asyncio.create_task(collect_agent())
        total_s = args.warmup_s + args.phases * args.phase_s
        await bus.publish(Assignment(ts=time.time(), source="bench", round=0, job=spec, copy=0, node_id="bench",
                                  gpus=(devices.gpus[0].index,), gpu_type=devices.gpus[0].type, world_size=1,
                                  ranks=(0,), step_budget=10**9, deadline=time.time() + total_s + 300))
        bare = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--bare-loop", "--model", args.model, "--dataset", args.dataset,
            "--batch-size", str(args.batch_size), "--optimizer", args.optimizer, "--lr", str(args.lr),
            "--device", args.device, "--report-s", str(args.report_s), stdout=asyncio.subprocess.PIPE,
            env=child_env({"CUDA_VISIBLE_DEVICES": devices.visible.get(devices.gpus[0].index, "")}))

        async def collect_bare() -> None:
            assert bare.stdout is not None
            async for line in bare.stdout:
                t, steps = json.loads(line)
                bare_samples.append((float(t), int(steps)))

        bare_reader = asyncio.create_task(collect_bare())
        worker_pid = 0
        agent_rates: list[float] = []
        bare_rates: list[float] = []
        try:
            await wait_for(agent_samples, 1, 300, "agent")
            await wait_for(bare_samples, 1, 300, "bare loop")
            await asyncio.sleep(args.warmup_s)   # both run: imports of the agent's next spare finish
            worker_pid = next(iter(agent.runs.values())).workers[0].pid
            for phase in range(args.phases):
                run, stop = (worker_pid, bare.pid) if phase % 2 == 0 else (bare.pid, worker_pid)
                signal_pid(stop, signal.SIGSTOP)
                signal_pid(run, signal.SIGCONT)
                start = time.time()
                await asyncio.sleep(args.phase_s)
                end = time.time()
                samples = agent_samples if phase % 2 == 0 else bare_samples
                rate = phase_rate(samples, start + args.report_s, end, args.batch_size)
                if rate is not None:
                    (agent_rates if phase % 2 == 0 else bare_rates).append(rate)
                    print(f"phase {phase} {'agent' if phase % 2 == 0 else 'bare'}: {rate:.1f} samples/s",
                          file=sys.stderr)
        finally:
            for pid in (worker_pid, bare.pid):
                if pid:
                    signal_pid(pid, signal.SIGCONT)
            bare.kill()
            await bare.wait()
            bare_reader.cancel()
            collector.cancel()
            await asyncio.gather(bare_reader, collector, return_exceptions=True)
            await sub.stop()
            await agent.stop()
            await bus.stop()
    return agent_rates, bare_rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--phases", type=int, default=12, help="alternating phases (agent first)")
    parser.add_argument("--phase-s", type=float, default=3.0)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--report-s", type=float, default=0.25, help="progress period of both sides")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bare-loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_loop:
        bare_loop(args)
        return 0
    devices = asyncio.run(discover_in_subprocess()) if args.device == "cuda" else cpu_devices(1)
    if args.device == "cuda" and devices.kind != "cuda":
        print("--device cuda: no CUDA device found", file=sys.stderr)
        return 2
    agent, bare = asyncio.run(measure(args, devices))
    if not agent or not bare:
        print("no complete phase measured", file=sys.stderr)
        return 1
    a, b = statistics.median(agent), statistics.median(bare)
    # Agent phase i ran between bare phases i - 1 and i.
    neighbours = [bare[max(0, i - 1):i + 1] for i in range(len(agent))]
    paired = [rate / statistics.mean(n) for rate, n in zip(agent, neighbours) if n]
    print(json.dumps({"agent_samples_s": round(a, 1), "bare_samples_s": round(b, 1), "ratio": round(a / b, 4),
                      "model": args.model, "dataset": args.dataset, "batch_size": args.batch_size,
                      "device": args.device, "gpu_type": devices.gpus[0].type,
                      "paired_ratio_median": round(statistics.median(paired), 4) if paired else None,
                      "agent_phases": [round(v, 1) for v in agent], "bare_phases": [round(v, 1) for v in bare]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
