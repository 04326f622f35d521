"""Consolidation speed and memory: streaming average vs loading every replica whole.

Writes ``--replicas`` safetensors files of ``--size-mb`` MiB each (float tensors of at
most ``--tensor-mb`` MiB, a few small ones and an int64 counter) in a temp directory,
then, in this order:

* memcpy_gbps: single-core ``np.copyto`` of a 256 MiB array, bytes copied per second;
  best of ``--repeat`` measurements, each taken just before a timed streaming run;
* gbps: best of ``--repeat`` runs of the tracker's streaming consolidation (weighing +
  ``write_consolidated`` on local files), replica bytes read per second, wall clock including writing the output file
  (to the page cache: neither way is timed with an fsync);
* peak_extra_mb: its peak traced allocation (``tracemalloc``, a second run), next to
  ``largest_tensor_mb``; rss_extra_mb: its peak RSS growth over the timed run (sampled);
* gbps_per_cpu_s / memcpy_gbps_per_cpu_s: the same two rates per CPU-second of the
  working thread (``time.thread_time``), which other processes on a shared machine
  disturb much less than the wall clock;
* gbps_threads / gbps_threads_per_cpu_s: the same consolidation on ``--threads`` threads
  (default min(4, usable CPUs)), timed in the same repeats right after the one-thread run,
  per CPU-second of the whole process (``time.process_time``: every averaging thread);
  ``speedup`` = gbps_threads / gbps; ``identical``: its output is the one-thread output,
  byte for byte; ``peak_extra_mb_threads``: its peak traced allocation; ``cores_busy`` /
  ``cores_busy_threads``: the most cores each run got (CPU seconds over wall seconds), which
  says whether the threads found cores to run on at all on a shared machine;
* with ``--hogs K``, K processes spinning on the CPU run beside every timed run (started
  before the first memcpy, stopped at the end), so the loaded figure is measured the same
  way every time; ``load_avg``: the 1-minute load average when the timed runs start, and
  ``cpus``: the CPUs this process may use;
* naive_gbps / naive_peak_extra_mb: ``safetensors.numpy.load_file`` of every replica,
  a weighted sum per tensor, ``save_file`` -- the same bytes per second, and its peak RSS
  growth (sampled every 5 ms; its buffers come from Rust, invisible to tracemalloc);
* max_abs_diff: largest difference between the two outputs (a correctness check).

The files sit in the page cache, so both read at memory speed: the comparison is of the
averaging, not of the disk. Targets (one core): gbps >= 0.5 x memcpy_gbps, peak_extra_mb <=
3 x largest_tensor_mb. The multi-core figure is reported beside them, not as a target. Last
output line: one JSON object. Run: ``.venv/bin/python benchmarks/consolidate.py --replicas 8
--size-mb 1024 [--threads 2] [--hogs 2]``.
"""

from __future__ import annotations

import argparse
import filecmp
import gc
import json
import os
import shutil
import subprocess
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

from typing import Self

from services.tracker.averaging.consolidate import (
    Replica,
    WriteStats,
    weigh_replicas,
    write_consolidated,
)
from services.tracker.averaging.safetensors_format import FileRangeReader, encode_header

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

    def __enter__(self) -> Self:
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


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def start_hogs(count: int) -> list[subprocess.Popen]:
    """``count`` processes that keep a CPU busy until :func:`stop_hogs`."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def streamed(inputs: list[tuple[Path, int]], out: Path, threads: int = 1) -> WriteStats:
    """The tracker's consolidation of local files (as ``consolidate_local``, without its fsync:
    neither way is timed with a flush to disk)."""
    readers = [FileRangeReader(path) for path, _ in inputs]
    try:
        weighing = weigh_replicas([Replica(copy=i, steps=steps, reader=reader)
                                   for i, (reader, (_, steps)) in enumerate(zip(readers, inputs))])
        with open(out, "wb") as f:
            return write_consolidated(weighing, f, threads=threads)
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


def timed(inputs: list[tuple[Path, int]], out: Path, threads: int) -> tuple[WriteStats, float, float, float]:
    """One streaming run: (stats, wall s, CPU s of this thread, CPU s of the process)."""
    start, cpu_start, process_start = time.perf_counter(), time.thread_time(), time.process_time()
    stats = streamed(inputs, out, threads)
    return (stats, time.perf_counter() - start, time.thread_time() - cpu_start,
            time.process_time() - process_start)


def traced_peak(inputs: list[tuple[Path, int]], out: Path, threads: int) -> int:
    tracemalloc.start()
    streamed(inputs, out, threads)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--size-mb", type=int, default=1024, help="MiB per replica")
    parser.add_argument("--tensor-mb", type=int, default=64, help="MiB of the largest tensors")
    parser.add_argument("--dir", default=None, help="where the replicas are written (a temp dir inside)")
    parser.add_argument("--repeat", type=int, default=3, help="timed streaming runs (best counts)")
    parser.add_argument("--threads", type=int, default=min(4, usable_cpus()),
                        help="threads of the multi-core run, beside the one-thread run (default: min(4, CPUs); "
                             "1: no multi-core run)")
    parser.add_argument("--hogs", type=int, default=0, help="busy processes kept running beside the timed runs")
    parser.add_argument("--skip-naive", action="store_true", help="do not run the load-everything baseline")
    args = parser.parse_args()
    if min(args.replicas, args.size_mb, args.tensor_mb, args.repeat, args.threads) < 1 or args.hogs < 0:
        parser.error("--replicas, --size-mb, --tensor-mb, --repeat and --threads must be >= 1, --hogs >= 0")

    work = Path(tempfile.mkdtemp(prefix="hadar-bench-consolidate-", dir=args.dir))
    hogs: list[subprocess.Popen] = []
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
        streamed_out, threads_out = work / "streamed.safetensors", work / "threads.safetensors"
        multi = args.threads > 1
        load_avg = os.getloadavg()[0]
        hogs = start_hogs(args.hogs)
        memcpy = memcpy_cpu = gbps = gbps_cpu = gbps_threads = gbps_threads_cpu = 0.0
        rss_extra = 0
        busy: list[float] = []          # cores the one-thread run got (CPU s / wall s), per repeat
        busy_threads: list[float] = []  # cores the multi-thread run got
        for attempt in range(args.repeat):  # best of N for each, interleaved: the machine is shared
            copy_wall, copy_cpu = memcpy_gbps()
            with RssPeak() as rss:
                stats, seconds, cpu_seconds, _ = timed(inputs, streamed_out, 1)
            run_gbps, run_cpu = stats.bytes_read / seconds / 1e9, stats.bytes_read / cpu_seconds / 1e9
            memcpy, memcpy_cpu = max(memcpy, copy_wall), max(memcpy_cpu, copy_cpu)
            gbps, gbps_cpu = max(gbps, run_gbps), max(gbps_cpu, run_cpu)
            rss_extra = max(rss_extra, rss.extra)
            busy.append(cpu_seconds / seconds)
            line = (f"run {attempt + 1}: memcpy (1 core) {copy_wall:.2f} GB/s ({copy_cpu:.2f} per CPU s); "
                    f"1 thread {stats.bytes_read / 1e9:.2f} GB in {seconds:.2f} s = {run_gbps:.2f} GB/s "
                    f"({run_cpu:.2f} per CPU s), RSS +{rss.extra / MIB:.1f} MiB")
            if multi:
                stats_t, seconds_t, _, process_seconds = timed(inputs, threads_out, args.threads)
                run_t, run_t_cpu = stats_t.bytes_read / seconds_t / 1e9, stats_t.bytes_read / process_seconds / 1e9
                gbps_threads, gbps_threads_cpu = max(gbps_threads, run_t), max(gbps_threads_cpu, run_t_cpu)
                busy_threads.append(process_seconds / seconds_t)
                line += f"; {args.threads} threads {seconds_t:.2f} s = {run_t:.2f} GB/s ({run_t_cpu:.2f} per CPU s)"
            print(line, file=sys.stderr)
        stop_hogs(hogs)
        hogs = []
        identical = filecmp.cmp(streamed_out, threads_out, shallow=False) if multi else None
        peak = traced_peak(inputs, streamed_out, 1)
        peak_threads = traced_peak(inputs, threads_out, args.threads) if multi else None
        print(f"streaming peak traced allocation: {peak / MIB:.1f} MiB (1 thread)"
              + (f", {peak_threads / MIB:.1f} MiB ({args.threads} threads)" if multi else ""), file=sys.stderr)

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
            "memcpy_gbps": round(memcpy, 3), "peak_extra_mb": round(peak / MIB, 2),
            "largest_tensor_mb": round(largest / MIB, 2), "rss_extra_mb": round(rss_extra / MIB, 1),
            "naive_peak_extra_mb": naive_extra, "max_abs_diff": diff,
            "gbps_per_cpu_s": round(gbps_cpu, 3), "memcpy_gbps_per_cpu_s": round(memcpy_cpu, 3),
            "ratio_wall": round(gbps / memcpy, 3), "ratio_per_cpu_s": round(gbps_cpu / memcpy_cpu, 3),
            "threads": args.threads,
            "gbps_threads": round(gbps_threads, 3) if multi else None,
            "gbps_threads_per_cpu_s": round(gbps_threads_cpu, 3) if multi else None,
            "ratio_threads_wall": round(gbps_threads / memcpy, 3) if multi else None,
            "speedup": round(gbps_threads / gbps, 3) if multi else None,
            "identical": identical,
            "cores_busy": round(max(busy), 2),
            "cores_busy_threads": round(max(busy_threads), 2) if multi else None,
            "peak_extra_mb_threads": round(peak_threads / MIB, 2) if multi else None,
            "hogs": args.hogs, "load_avg": round(load_avg, 2), "cpus": usable_cpus(),
            "replicas": args.replicas, "size_mb": args.size_mb,
            "targets_met": gbps >= 0.5 * memcpy and peak <= 3 * largest,
        }
        print(json.dumps(result))
    finally:
        stop_hogs(hogs)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
