"""Hostile replicas: every malformed header or data rejects that replica alone, with a reason.

A replica is untrusted input (written by an agent, stored in an object store). Parsing it
must raise nothing but InvalidSafetensors, and a round holding a bad replica must still
consolidate the others -- exactly as if the bad one had never been there.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from replica_bytes import BytesReader, entry, safetensors_bytes
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as torch_save_file

from services.tracker.averaging.consolidate import (
    NoUsableReplica,
    Replica,
    consolidate_local,
    weigh_replicas,
    write_consolidated,
)
from services.tracker.averaging.safetensors_format import (
    FileRangeReader,
    InvalidSafetensors,
    read_header,
)

GOOD_HEADER = {"a": entry("F32", [2], [0, 8]), "b": entry("F32", [3], [8, 20])}


def with_a(**fields: object) -> dict[str, object]:
    """GOOD_HEADER with some of tensor ``a``'s fields replaced."""
    return {**GOOD_HEADER, "a": {**GOOD_HEADER["a"], **fields}}


def raw_header(text: str) -> bytes:
    return text.encode()


DIGITS_5000 = "9" * 5000
DEEP = 100_000

# name -> (header, data bytes). Each must be refused by read_header with InvalidSafetensors.
MALFORMED: dict[str, tuple[dict | bytes, bytes]] = {
    "dtype is a list": (with_a(dtype=["F32"]), bytes(20)),
    "dtype is a map": (with_a(dtype={"F32": 1}), bytes(20)),
    "dtype is null": (with_a(dtype=None), bytes(20)),
    "unknown dtype": (with_a(dtype="Q4"), bytes(20)),
    "deeply nested top level": (raw_header("[" * DEEP + "]" * DEEP), b""),
    "deeply nested shape": (raw_header('{"a":{"dtype":"F32","shape":' + "[" * DEEP + "]" * DEEP
                                       + ',"data_offsets":[0,0]}}'), b""),
    "deeply nested metadata": (raw_header('{"__metadata__":{"k":' + '{"k":' * DEEP + "1" + "}" * DEEP
                                          + "}}"), b""),
    "nesting one level too deep": (with_a(shape=[[2]]), bytes(20)),
    "5,000-digit integer in shape": (raw_header('{"a":{"dtype":"F32","shape":[' + DIGITS_5000
                                                + '],"data_offsets":[0,8]}}'), bytes(8)),
    "5,000-digit integer in offsets": (raw_header('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,'
                                                  + DIGITS_5000 + "]}}"), bytes(8)),
    "30-digit offset": (with_a(data_offsets=[0, 10**30]), bytes(20)),
    "float offsets": (with_a(data_offsets=[0.0, 8.0]), bytes(20)),
    "bool in shape": (with_a(shape=[True, 2]), bytes(20)),
    "negative dim": (with_a(shape=[-2]), bytes(20)),
    "NaN literal in shape": (raw_header('{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}'), bytes(8)),
    "Infinity literal in offsets": (raw_header('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,Infinity]}}'),
                                    bytes(8)),
    "overlapping offsets": ({"a": entry("F32", [2], [0, 8]), "b": entry("F32", [3], [4, 16])}, bytes(16)),
    "same offsets twice": ({"a": entry("F32", [2], [0, 8]), "b": entry("F32", [2], [0, 8])}, bytes(8)),
    "offsets past the file": ({"a": entry("F32", [2], [0, 8]), "b": entry("F32", [3], [8, 20])}, bytes(16)),
    "offsets reversed": (with_a(data_offsets=[8, 0]), bytes(20)),
    "gap between tensors": ({"a": entry("F32", [2], [0, 8]), "b": entry("F32", [3], [12, 24])}, bytes(24)),
    "gap before the first tensor": ({"a": entry("F32", [2], [4, 12]), "b": entry("F32", [3], [12, 24])},
                                    bytes(24)),
    "trailing bytes": (GOOD_HEADER, bytes(24)),
    "too many dims": ({"a": entry("F32", [1] * 100, [0, 4]), "b": entry("F32", [3], [4, 16])}, bytes(16)),
    "shape product overflows 64 bits (zero last)": (
        {"a": entry("F32", [2**32, 2**32, 0], [0, 0]), "b": entry("F32", [3], [0, 12])}, bytes(12)),
    "shape product wraps to zero in 64 bits": (with_a(shape=[2**32, 2**32], data_offsets=[0, 0]), bytes(12)),
    "shape product far past the file": (with_a(shape=[2**40, 2**40], data_offsets=[0, 8]), bytes(20)),
    "bytes disagree with the shape": (with_a(shape=[3]), bytes(20)),
    "entry is a list": ({**GOOD_HEADER, "a": [1, 2]}, bytes(20)),
    "entry has an extra key": (with_a(extra=1), bytes(20)),
    "entry lacks a key": ({**GOOD_HEADER, "a": {"dtype": "F32", "shape": [2]}}, bytes(20)),
    "empty tensor name": ({"": entry("F32", [2], [0, 8]), "b": entry("F32", [3], [8, 20])}, bytes(20)),
    "duplicate tensor name": (raw_header('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                         '"a":{"dtype":"F32","shape":[3],"data_offsets":[8,20]}}'), bytes(20)),
    "lone surrogate in a tensor name": (raw_header('{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
                                        bytes(8)),
    "lone surrogate in metadata": (raw_header('{"__metadata__":{"k":"\\udc00"},'
                                              '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'), bytes(8)),
    "metadata is a list": ({"__metadata__": ["x"], **GOOD_HEADER}, bytes(20)),
    "metadata is an empty list": ({"__metadata__": [], **GOOD_HEADER}, bytes(20)),
    "metadata value is a number": ({"__metadata__": {"k": 1}, **GOOD_HEADER}, bytes(20)),
    "header is a list": (raw_header("[1, 2]"), b""),
    "header is a string": (raw_header('"safetensors"'), b""),
    "header is not UTF-8": (b"\xff\xfe{}", b""),
    "header is not JSON": (raw_header("{'a': 1}"), b""),
    "header is empty": (b"", b""),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_header_raises_only_invalid_safetensors_with_a_one_line_reason(name: str) -> None:
    header, data = MALFORMED[name]
    with pytest.raises(InvalidSafetensors) as info:
        read_header(BytesReader(safetensors_bytes(header, data)))
    assert info.type is InvalidSafetensors
    reason = info.value.reason
    assert reason and "\n" not in reason and len(reason) <= 300
    reason.encode("utf-8")  # fit for an event's reason field


def test_header_length_over_the_cap_is_refused_before_reading_it() -> None:
    reader = BytesReader(struct.pack("<Q", 1 << 40), size=1 << 41)
    with pytest.raises(InvalidSafetensors, match="limit"):
        read_header(reader)


def test_a_header_at_the_depth_limit_still_parses() -> None:
    header = {"__metadata__": {"format": "pt"}, "a": entry("F32", [1, 2], [0, 8]), "b": entry("I64", [], [8, 16]),
              "z": entry("F32", [0, 5], [16, 16])}
    parsed = read_header(BytesReader(safetensors_bytes(header, bytes(16))))
    assert [(t.name, t.shape) for t in parsed.tensors] == [("a", (1, 2)), ("b", ()), ("z", (0, 5))]


def _good_replica(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(2).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    return safetensors_bytes(GOOD_HEADER, a.tobytes() + b.tobytes())


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_round_with_a_malformed_replica_averages_the_others(name: str) -> None:
    header, data = MALFORMED[name]
    goods = [_good_replica(1), _good_replica(2)]
    replicas = [Replica(copy=0, steps=10, reader=BytesReader(goods[0])),
                Replica(copy=1, steps=1000, reader=BytesReader(safetensors_bytes(header, data))),
                Replica(copy=2, steps=30, reader=BytesReader(goods[1]))]
    weighing = weigh_replicas(replicas)
    assert [r.copy for r in weighing.rejected] == [1]
    assert weighing.rejected[0].reason.startswith("not valid safetensors")
    assert [(r.copy, r.weight) for r in weighing.accepted] == [(0, 0.25), (2, 0.75)]


# ---------------------------------------------------------------- non-finite values


def _model(rng: np.random.Generator, counter: int) -> dict[str, np.ndarray]:
    return {
        "a.weight": rng.standard_normal((64, 33)).astype(np.float32),
        "b.half": rng.standard_normal(301).astype(np.float16),
        "c.double": rng.standard_normal(77),
        "d.count": np.array([counter], dtype=np.int64),
        "z.last": rng.standard_normal(1000).astype(np.float32),
    }


def _write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("tensor", ["a.weight", "b.half", "c.double", "z.last"])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_a_non_finite_replica_among_good_ones_is_left_out(tmp_path: Path, tensor: str, bad_value: float,
                                                          chunk_bytes: int) -> None:
    rng = np.random.default_rng(4)
    good = [_write(tmp_path / f"g{i}.safetensors", _model(rng, 10 + i)) for i in range(2)]
    tensors = _model(rng, 99)
    flat = tensors[tensor].reshape(-1)
    flat[len(flat) // 2] = bad_value
    bad = _write(tmp_path / "bad.safetensors", tensors)
    # Weight 1/1001 for the bad copy: once enough to turn the whole average into NaN.
    weighing, _ = consolidate_local([(good[0], 600), (bad, 1), (good[1], 400)], tmp_path / "out.safetensors",
                                chunk_bytes=chunk_bytes)
    assert [r.copy for r in weighing.accepted] == [0, 2] and [r.copy for r in weighing.rejected] == [1]
    assert "non-finite" in weighing.rejected[0].reason and tensor in weighing.rejected[0].reason
    assert [r.weight for r in weighing.accepted] == [0.6, 0.4] and weighing.round_steps == 1000
    _expected_plan, _ = consolidate_local([(good[0], 600), (good[1], 400)], tmp_path / "expected.safetensors",
                                         chunk_bytes=chunk_bytes)
    out, expected = load_file(str(tmp_path / "out.safetensors")), load_file(str(tmp_path / "expected.safetensors"))
    assert out.keys() == expected.keys()
    for name in out:
        np.testing.assert_array_equal(out[name], expected[name])
        assert out[name].dtype.kind != "f" or np.isfinite(out[name]).all()


def test_a_non_finite_bf16_replica_read_from_a_store_is_left_out(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    paths = []
    for i in range(3):
        tensors = {"w": torch.randn(5000, generator=gen).to(torch.bfloat16)}
        if i == 1:
            tensors["w"][4321] = float("nan")
        torch_save_file(tensors, str(tmp_path / f"c{i}.safetensors"))
        paths.append(tmp_path / f"c{i}.safetensors")
    replicas = [Replica(copy=i, steps=s, reader=BytesReader(p.read_bytes()))
                for i, (p, s) in enumerate(zip(paths, (1, 1, 2)))]
    buffer = io.BytesIO()
    stats = write_consolidated(weigh_replicas(replicas), buffer, chunk_bytes=256)
    assert [r.copy for r in stats.weighing.rejected] == [1]
    assert [r.weight for r in stats.weighing.accepted] == pytest.approx([1 / 3, 2 / 3])
    consolidate_local([(paths[0], 1), (paths[2], 2)], tmp_path / "expected.safetensors", chunk_bytes=256)
    out = read_header(BytesReader(buffer.getvalue()))
    expected_bytes = (tmp_path / "expected.safetensors").read_bytes()
    expected = read_header(BytesReader(expected_bytes))
    assert buffer.getvalue()[out.data_start:] == expected_bytes[expected.data_start:]


def test_every_replica_non_finite_means_no_usable_replica_and_no_output(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    inputs = []
    for i in range(2):
        tensors = _model(rng, i)
        tensors["z.last"][3] = np.nan
        inputs.append((_write(tmp_path / f"n{i}.safetensors", tensors), 5))
    with pytest.raises(NoUsableReplica) as info:
        consolidate_local(inputs, tmp_path / "out.safetensors")
    assert [r.copy for r in info.value.rejected] == [0, 1]
    assert all("non-finite" in r.reason for r in info.value.rejected)
    assert not (tmp_path / "out.safetensors").exists()
    assert list(tmp_path.glob(".out.safetensors.*")) == []


def test_a_non_finite_copy_of_weight_zero_is_never_read_and_never_matters(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    tensors = _model(rng, 1)
    tensors["a.weight"][:] = np.nan
    idle = _write(tmp_path / "idle.safetensors", tensors)
    good = _write(tmp_path / "good.safetensors", _model(rng, 2))
    weighing, _ = consolidate_local([(idle, 0), (good, 7)], tmp_path / "out.safetensors")
    assert [r.copy for r in weighing.accepted] == [0, 1] and weighing.rejected == ()
    np.testing.assert_array_equal(load_file(str(tmp_path / "out.safetensors"))["a.weight"],
                                  load_file(str(good))["a.weight"])


def test_file_reader_and_in_memory_reader_agree_on_a_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(safetensors_bytes(*MALFORMED["trailing bytes"]))
    with FileRangeReader(path) as reader, pytest.raises(InvalidSafetensors, match="trailing"):
        read_header(reader)
