"""Consolidation speed and memory: streaming average vs loading every replica whole.

Writes ``--replicas`` safetensors files of ``--size-mb`` MiB each (float tensors of at
most ``--tensor-mb`` MiB, a few small ones and an int64 counter) in a temp directory,
then, in this order:

* memcpy_gbps: single-core ``np.copyto`` of a 256 MiB array, bytes copied per second;
  best of ``--repeat`` measurements, each taken just before a timed streaming run;
* gbps: best of ``--repeat`` runs of the tracker's streaming consolidation (plan + ``write_consolidated`` on local
  files), replica bytes read per second, wall clock including writing the output file
  (to the page cache: neither way is timed with an fsync);
* peak_extra_mb: its peak traced allocation (``tracemalloc``, a second run), next to
  ``largest_tensor_mb``; rss_extra_mb: its peak RSS growth over the timed run (sampled);
* gbps_per_cpu_s / memcpy_gbps_per_cpu_s: the same two rates per CPU-second of the
  working thread (``time.thread_time``), which other processes on a shared machine
  disturb much less than the wall clock;
* naive_gbps / naive_peak_extra_mb: ``safetensors.numpy.load_file`` of every replica,
  a weighted sum per tensor, ``save_file`` -- the same bytes per second, and its peak RSS
  growth (sampled every 5 ms; its buffers come from Rust, invisible to tracemalloc);
* max_abs_diff: largest difference between the two outputs (a correctness check).

The files sit in the page cache, so both read at memory speed: the comparison is of the
averaging, not of the disk. Targets: gbps >= 0.5 x memcpy_gbps, peak_extra_mb <= 3 x
largest_tensor_mb. Last output line: one JSON object.
Run: ``.venv/bin/python benchmarks/consolidate.py --replicas 8 --size-mb 1024``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.tracker.consolidate import (  # noqa: E402
    Replica, WriteStats, plan_consolidation, write_consolidated,
)
from services.tracker.safetensors_format import FileRangeReader, encode_header  # noqa: E402

MIB = 1 << 20


def layout(size_mb: int, tensor_mb: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """Float32 tensors of ``tensor_mb`` filling ``size_mb``, plus biases and a counter."""
    small = [(f"layer{i}.bias", "F32", (4096,)) for i in range(8)] + [("step", "I64", (1,))]
    small_bytes = 8 * 4096 * 4 + 8
    body = size_mb * MIB - small_bytes
    big, tensors = tensor_mb * MIB // 4, []
    remaining, i = body // 4, 0
    while remaining > 0:
        count = min(big, remaining)
        tensors.append((f"layer{i}.weight", "F32", (count,)))
        remaining -= count
        i += 1
    return tensors + small


def write_replica(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]], seed: int) -> None:
    """Stream a replica to disk: values differ per replica, generated one block at a time."""
    rng = np.random.default_rng(seed)
    block = rng.standard_normal(4 * MIB // 4, dtype=np.float32)
    header, _ = encode_header(tensors, {"format": "np"})
    with open(path, "wb") as out:
        out.write(header)
        for n, (_, dtype, shape) in enumerate(tensors):
            count = int(np.prod(shape))
            if dtype == "I64":
                out.write(np.full(count, seed, dtype=np.int64).tobytes())
                continue
            for start in range(0, count, block.size):
                part = block[: min(block.size, count - start)]
                out.write((part * np.float32(1 + 0.01 * n) + np.float32(seed)).tobytes())


def memcpy_gbps(seconds: float = 1.0) -> tuple[float, float]:
    """Single-core copy rate, GB/s: (by wall clock, by this thread's CPU time)."""
    src = np.ones(256 * MIB // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    copies, start, cpu_start = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        np.copyto(dst, src)
        copies += 1
    copied = copies * src.nbytes / 1e9
    return copied / (time.perf_counter() - start), copied / (time.thread_time() - cpu_start)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Samples RSS on a thread; ``extra`` is the peak growth over the value at start."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssPeak":
        gc.collect()
        self.base = self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def streamed(inputs: list[tuple[Path, int]], out: Path) -> WriteStats:
    """The tracker's consolidation of local files (as ``consolidate_local``, without its fsync:
    neither way is timed with a flush to disk)."""
    readers = [FileRangeReader(path) for path, _ in inputs]
    try:
        plan = plan_consolidation([Replica(copy=i, steps=steps, reader=reader)
                                   for i, (reader, (_, steps)) in enumerate(zip(readers, inputs))])
        with open(out, "wb") as f:
            return write_consolidated(plan, f)
    finally:
        for reader in readers:
            reader.close()


def naive(inputs: list[tuple[Path, int]], out: Path) -> None:
    replicas = [load_file(str(path)) for path, _ in inputs]
    total = sum(steps for _, steps in inputs)
    result = {}
    for name, first in replicas[0].items():
        if first.dtype.kind == "f":
            acc = np.zeros(first.shape, dtype=np.float32)
            for (_, steps), tensors in zip(inputs, replicas):
                acc += tensors[name] * np.float32(steps / total)
            result[name] = acc
        else:
            best = max(range(len(inputs)), key=lambda i: inputs[i][1])
            result[name] = replicas[best][name]
    save_file(result, str(out))


def max_abs_diff(a: Path, b: Path) -> float:
    worst = 0.0
    with safe_open(str(a), framework="np") as fa, safe_open(str(b), framework="np") as fb:
        for name in fa.keys():
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y), initial=0.0)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--size-mb", type=int, default=1024, help="MiB per replica")
    parser.add_argument("--tensor-mb", type=int, default=64, help="MiB of the largest tensors")
    parser.add_argument("--dir", default=None, help="where the replicas are written (a temp dir inside)")
    parser.add_argument("--repeat", type=int, default=3, help="timed streaming runs (best counts)")
    parser.add_argument("--skip-naive", action="store_true", help="do not run the load-everything baseline")
    args = parser.parse_args()
    if min(args.replicas, args.size_mb, args.tensor_mb, args.repeat) < 1:
        parser.error("--replicas, --size-mb, --tensor-mb and --repeat must be >= 1")

    work = Path(tempfile.mkdtemp(prefix="hadar-bench-consolidate-", dir=args.dir))
    try:
        tensors = layout(args.size_mb, args.tensor_mb)
        largest = max(int(np.prod(s)) * 4 for _, _, s in tensors)
        inputs = []
        start = time.perf_counter()
        for i in range(args.replicas):
            path = work / f"copy{i}.safetensors"
            write_replica(path, tensors, seed=i)
            inputs.append((path, 100 + 37 * i))
        print(f"wrote {args.replicas} x {args.size_mb} MiB in {time.perf_counter() - start:.1f} s "
              f"({len(tensors)} tensors, largest {largest / MIB:.0f} MiB) under {work}", file=sys.stderr)

        os.sync()  # the replicas' write-back must not compete with the timed runs
        streamed_out = work / "streamed.safetensors"
        memcpy = memcpy_cpu = gbps = gbps_cpu = 0.0
        rss_extra = 0
        for attempt in range(args.repeat):  # best of N for both, interleaved: the machine is shared
            copy_wall, copy_cpu = memcpy_gbps()
            with RssPeak() as rss:
                start, cpu_start = time.perf_counter(), time.thread_time()
                stats = streamed(inputs, streamed_out)
                seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu_start
            run_gbps, run_cpu = stats.bytes_read / seconds / 1e9, stats.bytes_read / cpu_seconds / 1e9
            memcpy, memcpy_cpu = max(memcpy, copy_wall), max(memcpy_cpu, copy_cpu)
            gbps, gbps_cpu = max(gbps, run_gbps), max(gbps_cpu, run_cpu)
            rss_extra = max(rss_extra, rss.extra)
            print(f"run {attempt + 1}: memcpy (1 core) {copy_wall:.2f} GB/s ({copy_cpu:.2f} per CPU s); "
                  f"streaming {stats.bytes_read / 1e9:.2f} GB in {seconds:.2f} s = {run_gbps:.2f} GB/s "
                  f"({run_cpu:.2f} per CPU s), RSS +{rss.extra / MIB:.1f} MiB", file=sys.stderr)
        tracemalloc.start()
        streamed(inputs, streamed_out)
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"streaming peak traced allocation: {traced_peak / MIB:.1f} MiB", file=sys.stderr)

        naive_gbps = naive_extra = diff = None
        if not args.skip_naive:
            naive_out = work / "naive.safetensors"
            with RssPeak() as naive_rss:
                start = time.perf_counter()
                naive(inputs, naive_out)
                naive_seconds = time.perf_counter() - start
            naive_gbps = stats.bytes_read / naive_seconds / 1e9
            naive_extra = round(naive_rss.extra / MIB, 1)
            diff = max_abs_diff(streamed_out, naive_out)
            print(f"naive: {naive_seconds:.2f} s = {naive_gbps:.2f} GB/s, RSS +{naive_extra} MiB, "
                  f"max |streamed - naive| = {diff:.3g}", file=sys.stderr)

        result = {
            "gbps": round(gbps, 3), "naive_gbps": None if naive_gbps is None else round(naive_gbps, 3),
            "memcpy_gbps": round(memcpy, 3), "peak_extra_mb": round(traced_peak / MIB, 2),
            "largest_tensor_mb": round(largest / MIB, 2), "rss_extra_mb": round(rss_extra / MIB, 1),
            "naive_peak_extra_mb": naive_extra, "max_abs_diff": diff,
            "gbps_per_cpu_s": round(gbps_cpu, 3), "memcpy_gbps_per_cpu_s": round(memcpy_cpu, 3),
            "replicas": args.replicas, "size_mb": args.size_mb,
            "targets_met": gbps >= 0.5 * memcpy and traced_peak <= 3 * largest,
        }
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
