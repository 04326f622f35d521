"""Multi-threaded averaging: the same bytes as one thread, and the GIL-free axpy it relies on."""

from __future__ import annotations

import ctypes
import io
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg.blas import daxpy, saxpy

from services.tracker.averaging.blas import axpy
from services.tracker.averaging.consolidate import (
    NoUsableReplica,
    Replica,
    WriteStats,
    consolidate_local,
    weigh_replicas,
    write_consolidated,
)
from services.tracker.averaging.safetensors_format import (
    FileRangeReader,
    encode_header,
    f32_to_bf16,
)
from tests.unit.replica_bytes import BytesReader

DTYPES = ("F16", "BF16", "F32", "F64", "I32")
_NUMPY = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I32": np.int32}


def _values(rng: np.random.Generator, dtype: str, count: int) -> bytes:
    values = rng.standard_normal(count) * rng.choice([1e-3, 1.0, 1e3])
    if dtype == "BF16":
        return f32_to_bf16(values.astype(np.float32), np.empty(count, np.uint16)).tobytes()
    if dtype == "I32":
        return rng.integers(-1000, 1000, count, dtype=np.int32).tobytes()
    return values.astype(_NUMPY[dtype]).tobytes()


def _replica_bytes(layout: list[tuple[str, str, tuple[int, ...]]], seed: int,
                   nan_in: set[str] = frozenset()) -> bytes:
    rng = np.random.default_rng(seed)
    header, _ = encode_header(layout, {"format": "np"})
    parts = [header]
    for name, dtype, shape in layout:
        count = int(np.prod(shape))
        data = bytearray(_values(rng, dtype, count))
        if name in nan_in and count:   # one NaN somewhere in this tensor
            at = int(rng.integers(count))
            nan = {"F16": np.float16, "F32": np.float32, "F64": np.float64}.get(dtype)
            raw = np.array(np.nan, dtype=nan).tobytes() if nan else np.uint16(0x7FC0).tobytes()
            data[at * len(raw):(at + 1) * len(raw)] = raw
        parts.append(bytes(data))
    return b"".join(parts)


def _average(readers: list, steps: list[int], mode: str, threads: int, chunk_bytes: int,
             window_bytes: int) -> tuple[bytes, WriteStats]:
    weighing = weigh_replicas([Replica(copy=i, steps=s, reader=r) for i, (r, s) in enumerate(zip(readers, steps))],
                              mode=mode)
    out = io.BytesIO()
    stats = write_consolidated(weighing, out, chunk_bytes=chunk_bytes, window_bytes=window_bytes, threads=threads)
    return out.getvalue(), stats


tensor = st.tuples(st.sampled_from(DTYPES),
                   st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
                   | st.integers(0, 3000).map(lambda n: (n,)))


@settings(max_examples=60, deadline=None)
@given(tensors=st.lists(tensor, min_size=1, max_size=4), steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=5),
       mode=st.sampled_from(["steps", "uniform"]), threads=st.integers(2, 5),
       chunk_bytes=st.sampled_from([8, 12, 24, 64, 100, 256, 4096]),
       window_bytes=st.sampled_from([8, 40, 200, 1 << 20]), mapped=st.booleans(),
       nans=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=3), seed=st.integers(0, 2**32 - 1))
def test_threads_give_the_one_thread_bytes(tensors: list[tuple[str, tuple[int, ...]]], steps: list[int], mode: str,
                                           threads: int, chunk_bytes: int, window_bytes: int, mapped: bool,
                                           nans: list[tuple[int, int]], seed: int) -> None:
    """Any layout (float and int dtypes, empty tensors), 1-5 replicas, any weights, NaNs in
    any replicas and tensors, chunks and windows of any size, mapped or read replicas: N
    threads write exactly the one-thread bytes and reject the same copies for the same reasons."""
    layout = [(f"t{i}", dtype, shape) for i, (dtype, shape) in enumerate(tensors)]
    nan_in = {(copy, f"t{t}") for copy, t in nans}
    blobs = [_replica_bytes(layout, seed + i, {name for copy, name in nan_in if copy == i})
             for i in range(len(steps))]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"copy{i}.safetensors" for i in range(len(blobs))]
        for path, blob in zip(paths, blobs):
            path.write_bytes(blob)
        results = []
        for n in (1, threads):
            readers = [FileRangeReader(p) for p in paths] if mapped else [BytesReader(b) for b in blobs]
            try:
                results.append(_average(readers, steps, mode, n, chunk_bytes, window_bytes))
            except NoUsableReplica as exc:   # every replica held NaN: both must say so alike
                results.append((str(exc), exc.rejected))
            finally:
                for reader in readers:
                    getattr(reader, "close", lambda: None)()
    (one, one_stats), (many, many_stats) = results
    assert many == one
    if isinstance(one_stats, WriteStats):
        assert many_stats.weighing.copy_weights() == one_stats.weighing.copy_weights()
        assert many_stats.weighing.rejections() == one_stats.weighing.rejections()
        assert many_stats.bytes_written == one_stats.bytes_written
        if not one_stats.weighing.rejected:
            assert many_stats.bytes_read == one_stats.bytes_read


def test_threads_give_the_one_thread_file_at_default_chunks(tmp_path: Path) -> None:
    """Tensors of several 1 MiB chunks and 16 MiB windows: the sizes the tracker uses."""
    layout = [("w", "F32", (5 << 20,)), ("h", "BF16", (3 << 20,)), ("n", "I32", (7,)), ("d", "F64", (1 << 19,))]
    inputs = []
    for i in range(3):
        path = tmp_path / f"copy{i}.safetensors"
        path.write_bytes(_replica_bytes(layout, i))
        inputs.append((path, 10 + 7 * i))
    consolidate_local(inputs, tmp_path / "one.safetensors", threads=1)
    consolidate_local(inputs, tmp_path / "four.safetensors", threads=4)
    assert (tmp_path / "four.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_threads_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "copy.safetensors"
    path.write_bytes(_replica_bytes([("w", "F32", (4,))], 0))
    with pytest.raises(ValueError, match="threads"):
        consolidate_local([(path, 1)], tmp_path / "out.safetensors", threads=0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), a=st.floats(-1e3, 1e3), double=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_axpy_is_scipys_kernel_bit_for_bit(n: int, a: float, double: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dtype = np.float64 if double else np.float32
    x, y = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    expected = (daxpy if double else saxpy)(x, y.copy(), a=a)
    axpy(x, y, a)
    assert y.tobytes() == expected.tobytes()


def test_axpy_refuses_mismatched_arrays() -> None:
    with pytest.raises(ValueError):
        axpy(np.ones(3, np.float32), np.ones(3, np.float64), 1.0)
    with pytest.raises(ValueError):
        axpy(np.ones(4, np.float32), np.ones(3, np.float32), 1.0)
    with pytest.raises(ValueError):
        axpy(np.ones(6, np.float32)[::2], np.ones(3, np.float32), 1.0)


def test_axpy_kernels_are_called_without_the_gil() -> None:
    """ctypes drops the GIL around a foreign call unless the prototype says PYTHONAPI: that
    is what lets the averaging threads run at once (benchmarks/consolidate.py measures it)."""
    from services.tracker.averaging import blas

    for kernel, _ in blas._KERNELS.values():
        assert not kernel._flags_ & ctypes._FUNCFLAG_PYTHONAPI


def test_cli_consolidate_threads_writes_the_same_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.main import main as hadar_main

    layout = [("w", "F32", (70_000,)), ("h", "F16", (999,))]
    args = []
    for i in range(3):
        path = tmp_path / f"copy{i}.safetensors"
        path.write_bytes(_replica_bytes(layout, i))
        args.append(f"{path}:{i + 1}")
    assert hadar_main(["consolidate", "--threads", "1", "--out", str(tmp_path / "one.safetensors"), *args]) == 0
    assert hadar_main(["consolidate", "--threads", "3", "--out", str(tmp_path / "three.safetensors"), *args]) == 0
    assert (tmp_path / "three.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    capsys.readouterr()
    assert hadar_main(["consolidate", "--threads", "0", "--out", str(tmp_path / "x.safetensors"), *args]) == 2
    assert "--threads" in capsys.readouterr().err
