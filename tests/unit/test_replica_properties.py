"""Properties over random corruptions of a valid replica.

* Parsing a corrupted file raises nothing but InvalidSafetensors, and whatever it accepts
  is a well-formed layout (contiguous tensors, inside the file, known dtypes, few dims).
* A round with one corrupted replica gives exactly the steps-weighted average of the
  valid ones: byte for byte what consolidating the valid ones alone gives.
"""

from __future__ import annotations

import io
import json
import math
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replica_bytes import BytesReader, safetensors_bytes

from services.tracker.averaging.consolidate import (
    NoUsableReplica,
    Replica,
    weigh_replicas,
    write_consolidated,
)
from services.tracker.averaging.safetensors_format import (
    DTYPE_SIZES,
    FLOAT_DTYPES,
    MAX_DIMS,
    Header,
    InvalidSafetensors,
    bf16_to_f32,
    encode_header,
    read_header,
)

LAYOUT = [("w", "F32", (6, 5)), ("h", "F16", (7,)), ("b", "BF16", (9,)), ("d", "F64", (3,)),
          ("n", "I64", (2,)), ("e", "F32", (0, 3))]


def valid_replica(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    header, _ = encode_header(LAYOUT, {"format": "pt"})
    parts = [rng.standard_normal(30).astype(np.float32).tobytes(),
             rng.standard_normal(7).astype(np.float16).tobytes(),
             (rng.standard_normal(9).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes(),
             rng.standard_normal(3).tobytes(), np.array([seed, 7], np.int64).tobytes(), b""]
    return header + b"".join(parts)


BASE = valid_replica(0)
HEADER_END = 8 + struct.unpack("<Q", BASE[:8])[0]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=6) | st.sampled_from(["F32", "F16", "BF16", "I64", "F8_E4M3", "__metadata__"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def with_length(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@st.composite
def byte_mutations(draw: st.DrawFn, base: bytes = BASE) -> bytes:
    """Bytes of the length prefix or the header overwritten, inserted or deleted."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["overwrite", "insert", "delete"]))
        pos = draw(st.integers(0, HEADER_END - 1))
        if kind == "overwrite":
            data[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"[", b"{", b"9" * 40, b"-"]))
        elif len(data) > pos + 1:
            del data[pos:pos + draw(st.integers(1, 8))]
    if draw(st.booleans()):  # keep the prefix consistent so the JSON itself is what is tested
        header_len = len(data) - (len(base) - HEADER_END) - 8
        if header_len >= 0:
            data[:8] = struct.pack("<Q", header_len)
    return bytes(data)


@st.composite
def json_mutations(draw: st.DrawFn, base: bytes = BASE) -> bytes:
    """One field of the header (an entry, its dtype, shape or offsets, or metadata) replaced."""
    header = json.loads(base[8:HEADER_END])
    key = draw(st.sampled_from(sorted(header)))
    if key != "__metadata__" and draw(st.booleans()):
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[key][field] = draw(json_values | st.lists(st.integers(-3, 2**64 + 3), max_size=40))
    else:
        header[key] = draw(json_values)
    data = base[HEADER_END:]
    if draw(st.booleans()):
        data = data + draw(st.binary(min_size=1, max_size=8))
    return with_length(json.dumps(header).encode(), data)


@st.composite
def data_mutations(draw: st.DrawFn, base: bytes = BASE) -> bytes:
    """A non-finite value written over an element of a floating tensor, or the file cut short."""
    if draw(st.booleans()):
        return base[:draw(st.integers(0, len(base) - 1))]
    header = read_header(BytesReader(base))
    tensor = draw(st.sampled_from([t for t in header.tensors if t.dtype in FLOAT_DTYPES and t.numel]))
    index = draw(st.integers(0, tensor.numel - 1))
    value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    size = DTYPE_SIZES[tensor.dtype]
    if tensor.dtype == "BF16":
        raw = (np.array([value], np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = np.array([value], FLOAT_DTYPES[tensor.dtype]).tobytes()
    at = tensor.begin + index * size
    return base[:at] + raw + base[at + size:]


corruptions = st.one_of(byte_mutations(), json_mutations(), data_mutations())


def check_well_formed(header: Header, size: int) -> None:
    position = header.data_start
    for t in header.tensors:  # file order: contiguous, known dtype, bytes = shape x itemsize
        assert t.begin == position and t.dtype in DTYPE_SIZES and len(t.shape) <= MAX_DIMS
        assert t.nbytes == math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        t.name.encode("utf-8")
        position = t.end
    assert position == size
    for k, v in header.metadata.items():
        (k + v).encode("utf-8")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(byte_mutations(), json_mutations()))
def test_a_mutated_header_parses_or_raises_invalid_safetensors_only(data: bytes) -> None:
    try:
        header = read_header(BytesReader(data))
    except InvalidSafetensors as exc:
        assert exc.reason and "\n" not in exc.reason
        exc.reason.encode("utf-8")
    else:
        check_well_formed(header, len(data))


def tensors_of(data: bytes) -> dict[str, np.ndarray]:
    """Every floating tensor of a consolidated file, as float64 (bf16 widened exactly)."""
    header = read_header(BytesReader(data))
    out = {}
    for t in header.tensors:
        raw = np.frombuffer(data, FLOAT_DTYPES.get(t.dtype, np.uint8), offset=t.begin,
                            count=t.numel if t.dtype in FLOAT_DTYPES else t.nbytes)
        if t.dtype == "BF16":
            raw = bf16_to_f32(raw, np.empty(t.numel, np.float32))
        out[t.name] = raw.astype(np.float64) if t.dtype in FLOAT_DTYPES else raw
    return out


def consolidate_bytes(replicas: list[Replica], chunk_bytes: int):
    buffer = io.BytesIO()
    stats = write_consolidated(weigh_replicas(replicas), buffer, chunk_bytes=chunk_bytes)
    return stats.weighing, buffer.getvalue()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted=corruptions, steps=st.lists(st.integers(1, 1000), min_size=4, max_size=4),
       position=st.integers(0, 3), chunk_bytes=st.sampled_from([8, 64, 4096]))
def test_a_round_with_one_corrupted_replica_is_the_exact_average_of_the_valid_ones(
        corrupted: bytes, steps: list[int], position: int, chunk_bytes: int) -> None:
    valid = [valid_replica(seed) for seed in (1, 2, 3)]
    files = valid[:position] + [corrupted] + valid[position:]
    replicas = [Replica(copy=i, steps=s, reader=BytesReader(f)) for i, (f, s) in enumerate(zip(files, steps))]
    weighing, out = consolidate_bytes(replicas, chunk_bytes)
    good = [r for r in replicas if r.copy != position]
    expected_plan, expected = consolidate_bytes(good, chunk_bytes)
    if [r.copy for r in weighing.rejected] == [position]:
        # Left out: byte-identical tensor data to a round that never had it.
        assert [(r.copy, r.weight) for r in weighing.accepted] == [(r.copy, r.weight) for r in expected_plan.accepted]
        got, want = read_header(BytesReader(out)), read_header(BytesReader(expected))
        assert out[got.data_start:] == expected[want.data_start:]
    else:
        # Kept: the mutation left a valid replica of the same layout (e.g. a different but
        # consistent order, or harmless whitespace); it is averaged like the others.
        assert weighing.rejected == () and len(weighing.accepted) == 4
        header = read_header(BytesReader(corrupted))
        check_well_formed(header, len(corrupted))
        inputs = [tensors_of(f) for f in files]
        assert all(np.isfinite(v).all() for tensors in inputs for v in tensors.values() if v.dtype == np.float64)
        total = sum(steps)
        for name, value in tensors_of(out).items():
            if value.dtype == np.float64 and name != "e":
                want_avg = sum(s / total * t[name] for s, t in zip(steps, inputs))
                np.testing.assert_allclose(value, want_avg, rtol=1e-2, atol=1e-2)


def test_nothing_valid_at_all_is_no_usable_replica() -> None:
    replicas = [Replica(copy=0, steps=1, reader=BytesReader(b"\x00" * 7)),
                Replica(copy=1, steps=1, reader=BytesReader(safetensors_bytes(b"{", b"")))]
    try:
        weigh_replicas(replicas)
    except NoUsableReplica as exc:
        assert [r.copy for r in exc.rejected] == [0, 1]
    else:  # pragma: no cover - the assertion below reports it
        raise AssertionError("expected NoUsableReplica")
