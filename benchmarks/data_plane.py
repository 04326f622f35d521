"""Measure this deployment's data plane (``shared/domain/data_plane.py``) and print it as JSON.

Each figure is measured with the live system's own code where it has one:

* ``store_upload_gbps`` / ``store_download_gbps``: the store's ``put_file`` / ``get_file`` of a
  ``--size-mb`` file against the MinIO in the environment (``HADAR_S3_*``, as ``hadar infra up``
  writes them), median of ``--repeat``; without it, a LocalStore in a temp directory (the
  ``source`` says which);
* ``consolidate_gbps``: the tracker's streaming average (``write_consolidated``, as
  ``benchmarks/consolidate.py`` times it) of two ``--size-mb`` replicas, replica bytes read per
  second, median;
* ``intra_node_gbps``: a ``torch.distributed`` broadcast (gloo, two processes here) of a
  ``--size-mb`` float tensor, median; on a GPU node NCCL over NVLink or PCIe is faster, so
  measure there with ``--backend nccl``;
* ``inter_node_gbps``: one machine cannot measure it: ``--inter-node-gbps`` (default 1.25,
  10 GbE), named in ``source``;
* ``store_request_s``: the median round trip of a 1 kB put and get, ``--requests`` of each;
* ``process_start_s`` / ``warm_start_s``: a real AgentDaemon moving one zoo copy to another
  device, then keeping it (``benchmarks/round_efficiency.py``'s ``move_start``: the agent's
  ``hadar_agent_copy_start_seconds``, from the round's start to the first step). Its loads
  there come from a local directory and the zoo model is small (under a millisecond): they are
  left in.

Usage::

    PYTHONPATH=. python benchmarks/data_plane.py [--size-mb 256] [--repeat 3] [--out FILE]

Last output line: the DataPlane as one JSON object (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import consolidate, round_efficiency
from shared.domain.data_plane import DataPlane
from shared.runtime.logging import configure_logging
from shared.store import LocalStore
from shared.store.settings import s3_from_env

MB = 1_000_000


async def store_rates(size_mb: int, repeat: int, requests: int, root: Path) -> tuple[float, float, float, str]:
    settings = s3_from_env()
    if settings is not None:
        from shared.store.minio import MinioStore

        store: Any = MinioStore(settings)
        where = f"MinIO at {settings.endpoint}"
    else:
        store, where = LocalStore(root / "store"), "a LocalStore (no HADAR_S3_* in the environment)"
    src, dst = root / "upload.bin", root / "download.bin"
    src.write_bytes(np.random.default_rng(0).bytes(size_mb * MB))
    key = f"bench/data-plane-{os.getpid()}-{int(time.time())}.bin"
    ups, downs, trips = [], [], []
    small = root / "small.bin"
    small.write_bytes(b"x" * 1000)
    await store.start()
    try:
        for _ in range(requests):
            t = time.perf_counter()
            await store.put_file(key, small)
            trips.append(time.perf_counter() - t)
            t = time.perf_counter()
            await store.get_file(key, dst)
            trips.append(time.perf_counter() - t)
        for _ in range(repeat):
            t = time.perf_counter()
            await store.put_file(key, src)
            ups.append(size_mb * MB / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            await store.get_file(key, dst)
            downs.append(size_mb * MB / (time.perf_counter() - t) / 1e9)
        await store.delete(key)
    finally:
        await store.stop()
    return statistics.median(ups), statistics.median(downs), statistics.median(trips), where


def consolidate_rate(size_mb: int, repeat: int, root: Path) -> float:
    tensors = consolidate.layout(max(1, size_mb * MB // consolidate.MIB), 64)
    inputs = []
    for i in range(2):
        path = root / f"replica-{i}.safetensors"
        consolidate.write_replica(path, tensors, seed=i)
        inputs.append((path, 100 + i))
    rates = []
    for _ in range(repeat):
        t = time.perf_counter()
        consolidate.streamed(inputs, root / "out.safetensors")
        rates.append(sum(p.stat().st_size for p, _ in inputs) / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def _broadcast_worker(rank: int, port: int, backend: str, size_mb: int, repeat: int, out: Any) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    tensor = torch.ones(size_mb * MB // 4, dtype=torch.float32, device=device)
    rates = []
    for _ in range(repeat + 1):   # the first one sets the connection up
        dist.barrier()
        t = time.perf_counter()
        dist.broadcast(tensor, src=0)
        if backend == "nccl":
            torch.cuda.synchronize(device)
        rates.append(size_mb * MB / (time.perf_counter() - t) / 1e9)
    if rank == 1:
        out.put(statistics.median(rates[1:]))
    dist.destroy_process_group()


def intra_node_rate(size_mb: int, repeat: int, backend: str) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = 29_500 + os.getpid() % 1000
    mp.start_processes(_broadcast_worker, args=(port, backend, size_mb, repeat, queue), nprocs=2,
                       start_method="spawn")
    return float(queue.get())


async def start_times() -> tuple[float, float]:
    args = argparse.Namespace(model="resnet", dataset="digits", batch_size=32, optimizer="sgd", lr=0.05,
                              move_steps=50)
    measured = await round_efficiency.move_start(args)
    return measured["move_start_s"], measured["kept_start_s"]

def measure(args: argparse.Namespace) -> DataPlane:
    with tempfile.TemporaryDirectory(prefix="hadar-bench-plane-") as tmp:
        root = Path(tmp)
        up, down, request, where = asyncio.run(store_rates(args.size_mb, args.repeat, args.requests, root))
        print(f"store: up {up:.3f} GB/s, down {down:.3f} GB/s, request {request * 1000:.1f} ms ({where})",
              file=sys.stderr)
        averaging = consolidate_rate(args.size_mb, args.repeat, root)
        print(f"consolidation: {averaging:.3f} GB/s", file=sys.stderr)
    intra = intra_node_rate(args.size_mb, args.repeat, args.backend)
    print(f"intra-node broadcast ({args.backend}): {intra:.3f} GB/s", file=sys.stderr)
    cold, warm = asyncio.run(start_times())
    print(f"copy start: cold {cold:.3f} s, warm {warm:.3f} s", file=sys.stderr)
    load = os.getloadavg()[0]
    return DataPlane(
        store_upload_gbps=round(up, 4), store_download_gbps=round(down, 4), consolidate_gbps=round(averaging, 4),
        intra_node_gbps=round(intra, 4), inter_node_gbps=args.inter_node_gbps, process_start_s=round(cold, 3),
        warm_start_s=round(warm, 3), store_request_s=round(request, 4),
        source=(f"benchmarks/data_plane.py --size-mb {args.size_mb} --repeat {args.repeat} --backend {args.backend} "
                f"on {os.uname().nodename} ({os.cpu_count()} CPUs, load {load:.1f}), "
                f"{time.strftime('%Y-%m-%d', time.gmtime())}; store: {where}; inter-node not measured "
                f"(one machine): {args.inter_node_gbps} GB/s given"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="checkpoint and tensor size measured, MB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20, help="small puts and gets timed")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--inter-node-gbps", type=float, default=1.25, help="not measurable on one machine")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.repeat < 1:
        parser.error("--size-mb and --repeat must be >= 1")
    with open(os.devnull, "w") as quiet:
        configure_logging("bench", level="WARNING", stream=quiet)   # the agent's own logs
        plane = measure(args)
    text = json.dumps(plane.to_json(), indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(plane.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
