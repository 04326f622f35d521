"""One-shot check of user code (issue 25) on a real GPU machine: run once on a lent H200.

    PYTHONPATH=. python3 deploy/gpu_check_usercode.py            # CUDA required
    PYTHONPATH=. python3 deploy/gpu_check_usercode.py --cpu      # the same checks on the CPU

With MemoryBus and a LocalStore in a temporary directory, the agent (its real worker
processes and sandboxed trainers) on the GPUs it discovers:

1. ``sandbox``: what this kernel offers the trainer's sandbox (Landlock ABI, seccomp table);
   with no Landlock the checks run with ``trainer_sandbox`` off and say so.
2. ``digits``: examples/user-code/digits, delivered as ``hadar submit`` would (code bundle,
   dataset bundle), trains 400 steps on the GPU in a sandboxed trainer and reaches its held-out
   accuracy; a second round from that round's replica runs in the same (warm) trainer process.
3. ``throughput``: the zoo's ``resnet`` on ``digits`` trained two ways by the same agent on the
   same GPU, batch 32 and 256: as a zoo job, and as user code (the zoo model's source copied
   into a bundle, trained through ``hadar_sdk``, data on the GPU like the zoo's). Steady
   samples/s from Progress; the ratio sdk/zoo (issue 25's goal: >= 0.95).

Not checked (one GPU): NCCL between two ranks of a copy, which needs two GPUs.
The last output line is one JSON object with every result (``ok``: all checks passed).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.user_code import model_source  # noqa: E402
from services.agent.daemon.discovery import cpu_devices, discover_in_subprocess  # noqa: E402
from services.agent.daemon.service import AgentConfig, AgentDaemon  # noqa: E402
from services.agent.protocol import StoreTarget  # noqa: E402
from services.agent.usercode.sandbox import landlock_abi  # noqa: E402
from services.agent.usercode.seccomp import SeccompError, table_for  # noqa: E402
from services.agent.worker.checkpoint import read_checkpoint  # noqa: E402
from services.cli.usercode import CodeRequest, deliver, upload_dataset  # noqa: E402
from shared.bus import MemoryBus  # noqa: E402
from shared.domain.layout import model_key  # noqa: E402
from shared.store import LocalStore  # noqa: E402
from shared.wire.events import Assignment, CopyFinished, Hyperparameters, JobSpec, Progress, UserCode  # noqa: E402
from shared.zoo.models import parse_model_name  # noqa: E402

EXAMPLE = ROOT / "examples" / "user-code" / "digits"
USER = "gpu-check"
_RESNET = parse_model_name("resnet")
RESNET_CONFIG = {"channels": 1, "classes": 10, "width": _RESNET.width, "depth": _RESNET.depth}   # digits: 1 x 8 x 8

GPU_SCRIPT = '''\
"""The zoo's resnet on digits through hadar_sdk, data on the device (deploy/gpu_check_usercode.py)."""

import numpy as np
import torch
import torch.nn.functional as F
from model import build

import hadar_sdk

with hadar_sdk.connect() as run:
    device = torch.device(run.device)
    x_all = torch.from_numpy(np.load(run.data_dir / "train-images.npy")).to(device)
    y_all = torch.from_numpy(np.load(run.data_dir / "train-labels.npy")).to(device)
    torch.manual_seed(run.seed)
    model = build(run.config).to(device)
    for rnd in run.rounds():
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        rnd.restore(model, opt)
        sampler = hadar_sdk.BatchSampler(len(y_all), run.batch_size, rnd.stream, device)
        model.train()
        for step in rnd.steps():
            index = sampler.indices(step)
            loss = F.cross_entropy(model(x_all[index]), y_all[index])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            rnd.report(samples=len(index), loss=loss.item())
        rnd.metric("cuda", float(torch.cuda.is_available()), of="final")
        rnd.save(model, opt)
'''


def sandbox_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"kernel": subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout.strip(),
                             "landlock_abi": landlock_abi()}
    try:
        facts["seccomp_table"] = type(table_for()).__name__ and True
    except SeccompError as exc:
        facts["seccomp_table"] = f"none: {exc}"
    facts["nvidia_devices"] = sorted(str(p) for p in Path("/dev").glob("nvidia*"))
    return facts


def export_digits(folder: Path) -> Path:
    subprocess.run([sys.executable, str(EXAMPLE / "export.py"), str(folder)], check=True, capture_output=True,
                   timeout=300)
    return folder


async def submit(root: Path, job_id: str, *, folder: Path, data: str, config: dict[str, Any], model: str,
                 batch_size: int) -> JobSpec:
    store = LocalStore(root)
    await store.start()
    try:
        request = CodeRequest(folder=folder, entrypoint="train.py", args=(), hint="resnet", data=data,
                              config=json.dumps(config, sort_keys=True))

        async def accept(code: UserCode) -> JobSpec:
            return JobSpec(job_id=job_id, user=USER, model=model, dataset=data, batch_size=batch_size, workers=1,
                           iterations=10**9, code=code)

        spec, _ = await deliver(store, request, USER, accept)
        return spec
    finally:
        await store.stop()


async def upload(root: Path, folder: Path, name: str) -> None:
    store = LocalStore(root)
    await store.start()
    try:
        await upload_dataset(store, folder, USER, name)
    finally:
        await store.stop()


def steady(rates: list[float]) -> float:
    """The median of the Progress rates after the first (start-up) one."""
    values = sorted(rates[1:] or rates)
    return values[len(values) // 2] if values else 0.0


async def agent_checks(mode: str, root: Path, result: dict[str, Any]) -> None:
    devices = await discover_in_subprocess() if mode == "cuda" else cpu_devices(1)
    result["devices"] = [[g.index, g.type, g.memory_gb] for g in devices.gpus]
    if mode == "cuda" and devices.kind != "cuda":
        raise RuntimeError(f"discovery found {devices.kind}, not cuda")
    gpu = devices.gpus[0]
    sandboxed = result["sandbox"]["landlock_abi"] > 0
    result["sandbox"]["trainer_sandbox"] = sandboxed
    data = export_digits(root / "export")
    await upload(root, data, "digits")
    bench_code = root / "bench-code"
    bench_code.mkdir()
    (bench_code / "model.py").write_text(model_source())
    (bench_code / "train.py").write_text(GPU_SCRIPT)

    bus = MemoryBus()
    await bus.start()
    agent = AgentDaemon(AgentConfig(node_id="gpu-check", progress_s=1.0, spare_workers=0,  # type: ignore[call-arg]
                                    cache_dir=str(root / "cache"), trainer_sandbox=sandboxed),
                        bus=bus, store=StoreTarget.local(root), devices=devices)
    await agent.start()
    done: dict[tuple[str, int], CopyFinished] = {}
    rates: dict[tuple[str, int], list[float]] = {}

    async def watch() -> None:
        async with bus.subscribe("hadar.progress", "gpu-check") as sub:
            async for d in sub:
                e = d.event
                await d.ack()
                if isinstance(e, Progress):
                    rates.setdefault((e.job_id, e.round), []).append(e.samples_per_s)
                elif isinstance(e, CopyFinished):
                    done[(e.job_id, e.round)] = e

    watcher = asyncio.create_task(watch())

    rounds = iter(range(10**6))   # the agent takes each round once, in order, across jobs

    async def train(spec: JobSpec, budget: int, *, start_from: str | None = None,
                    seconds: float = 300) -> tuple[int, CopyFinished]:
        round_ = next(rounds)
        await bus.publish(Assignment(ts=time.time(), source="gpu-check", round=round_, job=spec, copy=0,
                                  node_id="gpu-check", gpus=(gpu.index,), gpu_type=gpu.type, world_size=1,
                                  ranks=(0,), step_budget=budget, deadline=time.time() + seconds,
                                  start_from=start_from))
        began = time.time()
        while (spec.job_id, round_) not in done:
            if time.time() - began > seconds + 30:
                raise TimeoutError(f"no CopyFinished for {spec.job_id} round {round_}")
            await asyncio.sleep(0.2)
        return round_, done[(spec.job_id, round_)]

    try:
        # 2. the digits example, then a warm second round from its replica
        spec = await submit(root, "gc-digits", folder=EXAMPLE, data="digits", model="digits-cnn", batch_size=32,
                            config={"lr": 0.05, "total_steps": 600, "channels": 16})
        round0, first = await train(spec, 400)
        pid = agent.slots.process(0)
        checks = result["checks"]
        checks["digits_round0"] = {"status": first.status, "steps": first.steps_round, "reason": first.reason,
                                   "accuracy": first.final_metric, "samples_s": round(steady(rates.get(
                                       ("gc-digits", round0), [0.0])), 1), "log_tail": first.log_tail[-600:]}
        if first.status == "ok" and first.checkpoint:
            tensors, meta = read_checkpoint(root / first.checkpoint)
            checks["digits_round0"]["gpu_type"] = meta.get("gpu_type")
            from safetensors.torch import save_file
            weights = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
            (root / "models" / "gc-digits").mkdir(parents=True, exist_ok=True)
            save_file(weights, str(root / model_key("gc-digits", round0)), metadata={"total_steps": "400"})
            _, second = await train(spec, 200, start_from=model_key("gc-digits", round0))
            later = agent.slots.process(0)
            checks["digits_round1_warm"] = {
                "status": second.status, "steps": second.steps_round, "reason": second.reason,
                "start_accuracy": second.start_metric, "accuracy": second.final_metric,
                "same_worker": pid is not None and later is not None and pid.pid == later.pid}
        # 3. the same model, zoo vs SDK, two batch sizes, alternating
        for batch in (32, 256):
            zoo = JobSpec(job_id=f"gc-zoo-{batch}", user=USER, model="resnet", dataset="digits", batch_size=batch,
                          workers=1, iterations=10**9, hyper=Hyperparameters(optimizer="sgd", lr=0.05, seed=1))
            sdk = await submit(root, f"gc-sdk-{batch}", folder=bench_code, data="digits", model="resnet-sdk",
                               batch_size=batch, config=RESNET_CONFIG)
            got: dict[str, list[float]] = {"zoo": [], "sdk": []}
            for repeat in range(2):
                for way, job in (("zoo", zoo), ("sdk", sdk)) if repeat % 2 == 0 else (("sdk", sdk), ("zoo", zoo)):
                    round_, ev = await train(job, 10**9, seconds=20)
                    if ev.status not in ("ok", "preempted"):
                        raise RuntimeError(f"{job.job_id} round {round_}: {ev.status} {ev.reason} {ev.log_tail[-400:]}")
                    got[way].append(steady(rates.get((job.job_id, round_), [0.0])))
            zoo_rate, sdk_rate = sorted(got["zoo"])[-1], sorted(got["sdk"])[-1]
            checks[f"throughput_b{batch}"] = {"status": "ok", "zoo_samples_s": [round(v, 1) for v in got["zoo"]],
                                              "sdk_samples_s": [round(v, 1) for v in got["sdk"]],
                                              "sdk_ratio": round(sdk_rate / zoo_rate, 3) if zoo_rate else None}
    finally:
        watcher.cancel()
        await agent.stop()
        await bus.stop()


def main() -> int:
    mode = "cpu" if "--cpu" in sys.argv[1:] else "cuda"
    result: dict[str, Any] = {"ok": False, "mode": mode, "torch": torch.__version__, "checks": {}}
    if mode == "cuda" and not torch.cuda.is_available():
        result["error"] = "CUDA is not available (use --cpu to run the checks on the CPU)"
        print(json.dumps(result))
        return 1
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
    result["sandbox"] = sandbox_facts()
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="hadar-gpu-uc-") as tmp:
        try:
            asyncio.run(agent_checks(mode, Path(tmp), result))
        except Exception as exc:
            result["checks"]["error"] = f"{type(exc).__name__}: {exc}"[:600]
            traceback.print_exc()
    result["seconds"] = round(time.time() - began, 1)
    checks = result["checks"]
    result["ok"] = ("error" not in checks and all(v.get("status") == "ok" for v in checks.values())
                   and (checks.get("digits_round0", {}).get("accuracy") or 0) >= 0.9
                   and checks.get("digits_round1_warm", {}).get("same_worker") is True)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
