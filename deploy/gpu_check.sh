#!/usr/bin/env bash
# One-shot check of the agent on a real GPU machine (run once on a lent H200).
#
#   deploy/gpu_check.sh          # CUDA required: exits 1 with a JSON line if there is none
#   deploy/gpu_check.sh --cpu    # same checks on the CPU (gloo instead of nccl), for trying it anywhere
#
# Installs only the Python packages that are missing (timed), then, with MemoryBus and a
# local store in a temporary directory:
#   1. the agent discovers the GPU and trains one copy of resnet and one of transformer on it;
#   2. a copy with a rendezvous trains under DDP with the nccl backend (1 worker);
#   3. checkpoint round trip: a CUDA model's checkpoint reloads bit-exactly, and a copy
#      resumes from the resnet checkpoint with its step count carried on;
#   4. benchmarks/agent_overhead.py on the device: agent vs bare torch samples/s.
# The last output line is one JSON object with every result ("ok": all checks passed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
MODE="${1:-cuda}"
[ "$MODE" = "--cpu" ] && MODE=cpu
SECONDS=0

# ------------------------------------------------------------ packages (only what is missing)
declare -A PKG=([torch]=torch [safetensors]=safetensors [numpy]=numpy [msgpack]=msgpack
                [structlog]=structlog [aiokafka]=aiokafka [aiohttp]=aiohttp [minio]=minio
                [prometheus_client]=prometheus-client [yaml]=pyyaml [sklearn]=scikit-learn [scipy]=scipy)
missing=()
for mod in "${!PKG[@]}"; do
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("${PKG[$mod]}")
done
install_status="none needed"
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  t=$SECONDS
  if "$PY" -m pip install -q "${missing[@]}" >&2 \
     || "$PY" -m pip install -q --break-system-packages "${missing[@]}" >&2 \
     || "$PY" -m pip install -q --user --break-system-packages "${missing[@]}" >&2; then
    install_status="installed ${missing[*]}"
  else
    install_status="pip failed for ${missing[*]}"
  fi
  echo "install took $((SECONDS - t)) s" >&2
fi
install_s=$SECONDS

# ------------------------------------------------------------ the checks
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$MODE" "$install_s" "$install_status" <<'PYEOF'
import asyncio, json, os, subprocess, sys, tempfile, time, traceback
from pathlib import Path

mode, install_s, install_status = sys.argv[1], float(sys.argv[2]), sys.argv[3]
result = {"ok": False, "mode": mode, "install_s": round(install_s, 1), "install": install_status, "checks": {}}

def finish(code):
    print(json.dumps(result))
    sys.exit(code)

try:
    import torch
except Exception as exc:
    result["error"] = f"torch not importable: {exc}"
    finish(1)
result["torch"] = torch.__version__
if mode == "cuda" and not torch.cuda.is_available():
    result["error"] = "CUDA is not available (use --cpu to run the checks on the CPU)"
    finish(1)

from services.agent.worker.checkpoint import CheckpointMeta, read_checkpoint, restore, save_checkpoint
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.daemon.discovery import cpu_devices, discover_in_subprocess
from services.agent.daemon.runner import free_port
from services.agent.protocol import StoreTarget
from shared.bus import MemoryBus
from shared.wire.events import Assignment, CopyFinished, Hyperparameters, JobSpec, Progress
from shared.zoo import build_model, load_dataset, make_optimizer

def spec(job_id, model, dataset, batch=64):
    return JobSpec(job_id=job_id, user="gpu-check", model=model, dataset=dataset, batch_size=batch, workers=1,
                   iterations=10**9, hyper=Hyperparameters(optimizer="adam", lr=0.002, seed=1))

async def agent_checks(root):
    devices = await discover_in_subprocess() if mode == "cuda" else cpu_devices(1)
    result["devices"] = [[g.index, g.type, g.memory_gb] for g in devices.gpus]
    result["device_kind"] = devices.kind
    if mode == "cuda" and devices.kind != "cuda":
        raise RuntimeError(f"discovery found {devices.kind}, not cuda")
    gpu = devices.gpus[0]
    bus = MemoryBus(); await bus.start()
    agent = AgentDaemon(AgentConfig(node_id="gpu-check", progress_s=1.0, spare_workers=2), bus=bus,
                        store=StoreTarget.local(root), devices=devices)
    await agent.start()
    done, rates = {}, {}
    async def watch():
        async with bus.subscribe("hadar.progress", "gpu-check") as sub:
            async for d in sub:
                e = d.event; await d.ack()
                if isinstance(e, Progress):
                    rates.setdefault(e.job_id, []).append(e.samples_per_s)
                elif isinstance(e, CopyFinished):
                    done[(e.job_id, e.round)] = e
    watcher = asyncio.create_task(watch())
    def assign(job, round_, budget, seconds, start_from=None, rendezvous=None):
        return Assignment(ts=time.time(), source="gpu-check", round=round_, job=job, copy=0, node_id="gpu-check",
                          gpus=(gpu.index,), gpu_type=gpu.type, world_size=1, ranks=(0,), step_budget=budget,
                          deadline=time.time() + seconds, start_from=start_from, rendezvous=rendezvous)
    async def wait(keys, timeout=240):
        t = time.time()
        while not all(k in done for k in keys):
            if time.time() - t > timeout:
                raise TimeoutError(f"no CopyFinished for {[k for k in keys if k not in done]}")
            await asyncio.sleep(0.2)
    try:
        resnet = spec("gc-resnet", "resnet", "digits")
        transformer = spec("gc-transformer", "transformer", "synthetic-text")
        t = time.time()
        # one after the other: a node runs one copy per GPU, and a second on a busy GPU is refused
        await bus.publish(assign(resnet, 0, 10**9, 25))
        await wait([("gc-resnet", 0)])
        await bus.publish(assign(transformer, 0, 10**9, 25))
        await wait([("gc-resnet", 0), ("gc-transformer", 0)])
        for job in ("gc-resnet", "gc-transformer"):
            ev = done[(job, 0)]
            steady = sorted(rates.get(job, [0.0])[1:] or rates.get(job, [0.0]))
            _, meta = read_checkpoint(Path(root) / ev.checkpoint) if ev.checkpoint else (None, {})
            result["checks"][f"train_{job[3:]}"] = {
                "status": ev.status, "steps": ev.steps_round, "reason": ev.reason,
                "samples_s_median": round(steady[len(steady) // 2], 1), "gpu_type": meta.get("gpu_type"),
                "metric": [meta.get("metric_name"), meta.get("metric_value")]}
        result["train_s"] = round(time.time() - t, 1)
        # nccl (gloo on CPU) DDP with one worker: a rendezvous turns DDP on.
        ddp = spec("gc-ddp", "resnet", "digits")
        await bus.publish(assign(ddp, 0, 200, 120, rendezvous=f"127.0.0.1:{free_port()}"))
        await wait([("gc-ddp", 0)])
        ev = done[("gc-ddp", 0)]
        result["checks"]["ddp_1_worker"] = {"status": ev.status, "steps": ev.steps_round, "reason": ev.reason,
                                            "backend": "nccl" if mode == "cuda" else "gloo"}
        # Resume from the resnet checkpoint: step count carries on.
        first = done[("gc-resnet", 0)]
        await bus.publish(assign(resnet, 1, 50, 120, start_from=first.checkpoint))
        await wait([("gc-resnet", 1)])
        ev = done[("gc-resnet", 1)]
        _, meta = read_checkpoint(Path(root) / ev.checkpoint) if ev.checkpoint else (None, {"total_steps": "-1"})
        result["checks"]["resume"] = {"status": ev.status, "steps": ev.steps_round, "reason": ev.reason,
                                      "total_steps": int(meta["total_steps"]),
                                      "expected_total": first.steps_round + 50}
    finally:
        watcher.cancel()
        await agent.stop(); await bus.stop()

def checkpoint_round_trip(root):
    device = torch.device("cuda" if mode == "cuda" else "cpu")
    data = load_dataset("digits")
    net = build_model("resnet", data.info, seed=3).to(device)
    opt = make_optimizer("adam", net.parameters(), 0.01)
    x, y = data.train_x[:64].to(device), data.train_y[:64].to(device)
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(net(x), y); opt.zero_grad(); loss.backward(); opt.step()
    path = Path(root) / "rt.safetensors"
    meta = CheckpointMeta(job="rt", round=0, copy=0, steps=5, total_steps=5, gpu_type="x", model="resnet",
                          dataset="digits")
    save_checkpoint(path, net, opt, meta)
    tensors, _ = read_checkpoint(path)
    fresh = build_model("resnet", data.info, seed=4).to(device)
    fresh_opt = make_optimizer("adam", fresh.parameters(), 0.01)
    restore(fresh, fresh_opt, tensors)
    same = all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))
    on_device = all(p.device.type == device.type for p in fresh.parameters())
    result["checks"]["checkpoint_round_trip"] = {"status": "ok" if same and on_device else "failed",
                                                 "tensors": len(tensors)}

def overhead():
    args = [sys.executable, "benchmarks/agent_overhead.py", "--device", mode, "--phases", "6", "--phase-s", "3",
            "--warmup-s", "3", "--batch-size", "64"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    result["agent_overhead"] = json.loads(lines[-1]) if out.returncode == 0 and lines else {
        "error": (out.stderr or "")[-500:]}

with tempfile.TemporaryDirectory(prefix="hadar-gpu-check-") as root:
    steps = (("agent", lambda: asyncio.run(agent_checks(root))),
             ("round_trip", lambda: checkpoint_round_trip(root)), ("overhead", overhead))
    for name, step in steps:
        t = time.time()
        try:
            step()
        except Exception as exc:
            result["checks"][f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
        result[f"{name}_s"] = round(time.time() - t, 1)
if torch.cuda.is_available():
    result["gpu"] = torch.cuda.get_device_name(0)
checks = result["checks"]
result["ok"] = (not any(k.endswith("_error") for k in checks)
                and all(v.get("status") == "ok" for v in checks.values() if isinstance(v, dict))
                and checks.get("resume", {}).get("total_steps") == checks.get("resume", {}).get("expected_total")
                and "ratio" in result.get("agent_overhead", {}))
result["ratio"] = result.get("agent_overhead", {}).get("ratio")
finish(0 if result["ok"] else 1)
PYEOF
