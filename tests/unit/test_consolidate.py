"""Streaming consolidation: exact averages, integer tensors, dtypes, rejection, memory, CLI."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

from services.cli.main import main as hadar_main
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
    bf16_to_f32,
    encode_header,
    f32_to_bf16,
    read_header,
)


def _model(rng: np.random.Generator, step_counter: int) -> dict[str, np.ndarray]:
    return {
        "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "fc.weight": rng.standard_normal((64, 37)).astype(np.float32),
        "fc.bias": rng.standard_normal(37).astype(np.float32),
        "emb.half": rng.standard_normal((50, 7)).astype(np.float16),
        "head.double": rng.standard_normal(29),
        "bn.num_batches_tracked": np.array(step_counter, dtype=np.int64),
        "opt.step": np.array([step_counter, step_counter + 1], dtype=np.int32),
        "mask": rng.random(11) > 0.5,
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def _write_replicas(tmp_path: Path, steps: list[int], seed: int = 0) -> list[tuple[Path, int]]:
    rng = np.random.default_rng(seed)
    inputs = []
    for i, s in enumerate(steps):
        path = tmp_path / f"copy{i}.safetensors"
        save_file(_model(rng, step_counter=100 + i), str(path))
        inputs.append((path, s))
    return inputs


def _expected_average(inputs: list[tuple[Path, int]], weights: list[float]) -> dict[str, np.ndarray]:
    loaded = [load_file(str(p)) for p, _ in inputs]
    out = {}
    for name, first in loaded[0].items():
        if first.dtype.kind == "f":
            acc = sum(w * tensors[name].astype(np.float64) for w, tensors in zip(weights, loaded))
            out[name] = np.asarray(acc).astype(first.dtype)
    return out


@pytest.mark.parametrize("chunk_bytes", [64, 4096, 1 << 20])
def test_weighted_average_matches_an_independent_computation(tmp_path: Path, chunk_bytes: int) -> None:
    steps = [100, 300, 600]
    inputs = _write_replicas(tmp_path, steps)
    weighing, stats = consolidate_local(inputs, tmp_path / "out.safetensors", chunk_bytes=chunk_bytes)
    assert [r.weight for r in weighing.accepted] == pytest.approx([0.1, 0.3, 0.6])
    assert weighing.rejected == () and weighing.round_steps == 1000
    out = load_file(str(tmp_path / "out.safetensors"))
    expected = _expected_average(inputs, [0.1, 0.3, 0.6])
    for name in ("conv.weight", "fc.weight", "fc.bias"):
        assert out[name].dtype == np.float32
        np.testing.assert_allclose(out[name], expected[name], rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(out["emb.half"].astype(np.float32), expected["emb.half"].astype(np.float32),
                               rtol=1e-3, atol=1e-3)  # one f16 rounding step
    np.testing.assert_allclose(out["head.double"], expected["head.double"], rtol=1e-12)
    assert out["empty"].shape == (0, 4)
    assert stats.tensors == 9


def test_integer_and_bool_tensors_come_from_the_copy_with_most_steps(tmp_path: Path) -> None:
    inputs = _write_replicas(tmp_path, [50, 700, 200])
    consolidate_local(inputs, tmp_path / "out.safetensors")
    out = load_file(str(tmp_path / "out.safetensors"))
    source = load_file(str(inputs[1][0]))
    assert out["bn.num_batches_tracked"] == 101 and out["bn.num_batches_tracked"].dtype == np.int64
    np.testing.assert_array_equal(out["opt.step"], source["opt.step"])
    np.testing.assert_array_equal(out["mask"], source["mask"])


def test_uniform_mode_ignores_steps(tmp_path: Path) -> None:
    inputs = _write_replicas(tmp_path, [1, 5, 1000])
    weighing, _ = consolidate_local(inputs, tmp_path / "out.safetensors", mode="uniform")
    assert [r.weight for r in weighing.accepted] == pytest.approx([1 / 3] * 3)
    out = load_file(str(tmp_path / "out.safetensors"))
    expected = _expected_average(inputs, [1 / 3] * 3)
    np.testing.assert_allclose(out["fc.weight"], expected["fc.weight"], rtol=2e-6, atol=2e-7)


def test_zero_steps_everywhere_falls_back_to_uniform(tmp_path: Path) -> None:
    inputs = _write_replicas(tmp_path, [0, 0])
    weighing, _ = consolidate_local(inputs, tmp_path / "out.safetensors")
    assert [r.weight for r in weighing.accepted] == [0.5, 0.5]


class ReadOnlyReader:
    """A reader that cannot map: the path the tracker takes for objects in a store."""

    def __init__(self, path: Path) -> None:
        self._file = FileRangeReader(path)
        self.name = str(path)
        self.data_reads = 0

    def size(self) -> int:
        return self._file.size()

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset >= 8 + 1024:  # past the header of these small files
            self.data_reads += 1
        self._file.read_into(offset, out)


class CountingFileReader(FileRangeReader):
    maps = 0

    def map(self, offset: int, length: int) -> memoryview:
        self.maps += 1
        return super().map(offset, length)


def test_a_copy_with_zero_weight_is_not_read(tmp_path: Path) -> None:
    inputs = _write_replicas(tmp_path, [0, 10])
    idle_reader, idle_mapper = ReadOnlyReader(inputs[0][0]), CountingFileReader(inputs[0][0])
    for idle in (idle_reader, idle_mapper):
        replicas = [Replica(copy=0, steps=0, reader=idle),
                    Replica(copy=1, steps=10, reader=FileRangeReader(inputs[1][0]))]
        with open(tmp_path / "out.safetensors", "wb") as out:
            write_consolidated(weigh_replicas(replicas), out)
    assert idle_reader.data_reads == 0 and idle_mapper.maps == 0
    np.testing.assert_array_equal(load_file(str(tmp_path / "out.safetensors"))["fc.weight"],
                                  load_file(str(inputs[1][0]))["fc.weight"])


@pytest.mark.parametrize("chunk_bytes, window_bytes", [(64, 64), (4096, 1 << 20), (1 << 20, 1 << 20)])
def test_mapped_and_chunk_read_replicas_give_identical_bytes(tmp_path: Path, chunk_bytes: int,
                                                            window_bytes: int) -> None:
    inputs = _write_replicas(tmp_path, [7, 11, 2])
    outputs = []
    for name, make in (("mapped", CountingFileReader), ("read", ReadOnlyReader)):
        readers = [make(path) for path, _ in inputs]
        replicas = [Replica(copy=i, steps=s, reader=r) for i, (r, (_, s)) in enumerate(zip(readers, inputs))]
        with open(tmp_path / f"{name}.safetensors", "wb") as out:
            write_consolidated(weigh_replicas(replicas), out, chunk_bytes=chunk_bytes,
                               window_bytes=window_bytes)
        outputs.append((tmp_path / f"{name}.safetensors").read_bytes())
        if name == "mapped":
            assert all(r.maps > 0 for r in readers)
        else:
            assert all(r.data_reads > 0 for r in readers)
    assert outputs[0] == outputs[1]


def test_one_copy_is_returned_exactly(tmp_path: Path) -> None:
    inputs = _write_replicas(tmp_path, [42])
    consolidate_local(inputs, tmp_path / "out.safetensors")
    out, original = load_file(str(tmp_path / "out.safetensors")), load_file(str(inputs[0][0]))
    assert out.keys() == original.keys()
    for name in out:
        np.testing.assert_array_equal(out[name], original[name])


def test_output_is_deterministic_and_carries_metadata(tmp_path: Path) -> None:
    inputs = _write_replicas(tmp_path, [3, 9])
    consolidate_local(inputs, tmp_path / "a.safetensors", metadata={"job": "j1", "round": "4"})
    consolidate_local(inputs, tmp_path / "b.safetensors", metadata={"job": "j1", "round": "4"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    with safe_open(str(tmp_path / "a.safetensors"), framework="np") as f:
        meta = f.metadata()
    assert meta["job"] == "j1" and meta["round"] == "4" and meta["mode"] == "steps"
    assert json.loads(meta["copies"]) == [{"copy": 0, "steps": 3, "weight": 0.25},
                                          {"copy": 1, "steps": 9, "weight": 0.75}]


def test_bf16_and_f16_are_averaged_in_fp32_and_rounded_back(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    models = [{"b": torch.randn(3001, generator=gen).to(torch.bfloat16),
               "h": torch.randn(17, 5, generator=gen).to(torch.float16)} for _ in range(3)]
    inputs = []
    for i, tensors in enumerate(models):
        torch_save_file(tensors, str(tmp_path / f"c{i}.safetensors"))
        inputs.append((tmp_path / f"c{i}.safetensors", [1, 2, 5][i]))
    consolidate_local(inputs, tmp_path / "out.safetensors", chunk_bytes=256)
    out = torch_load_file(str(tmp_path / "out.safetensors"))
    weights = [0.125, 0.25, 0.625]
    for name, dtype in (("b", torch.bfloat16), ("h", torch.float16)):
        acc = torch.zeros_like(models[0][name], dtype=torch.float32)
        for w, tensors in zip(weights, models):
            acc += w * tensors[name].float()
        assert out[name].dtype == dtype
        assert torch.equal(out[name], acc.to(dtype))  # fp32 sum, one rounding: same as torch's


def test_bf16_rounding_matches_torch_including_specials() -> None:
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 1e3,
                             np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-40], np.float32),
                             rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    bits = f32_to_bf16(values, np.empty(values.size, np.uint16))
    reference = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(bits[finite], reference[finite])
    back = bf16_to_f32(bits, np.empty(values.size, np.float32))
    assert np.isnan(back[~finite]).all()


def _replica(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, str(path))
    return path


def test_mismatched_and_garbage_replicas_are_rejected_with_reasons(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    good = [_replica(tmp_path / f"good{i}.safetensors",
                     {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.ones(3, np.float32)})
            for i in range(3)]
    shape = _replica(tmp_path / "shape.safetensors", {"w": np.ones((3, 4), np.float32), "b": np.ones(3, np.float32)})
    dtype = _replica(tmp_path / "dtype.safetensors", {"w": np.ones((4, 3), np.float16), "b": np.ones(3, np.float32)})
    names = _replica(tmp_path / "names.safetensors", {"w": np.ones((4, 3), np.float32), "c": np.ones(3, np.float32)})
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file at all")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good[0].read_bytes()[:-5])
    inputs = [(good[0], 10), (shape, 10), (good[1], 20), (dtype, 10), (names, 99), (garbage, 5),
              (truncated, 5), (good[2], 30)]
    weighing, _ = consolidate_local(inputs, tmp_path / "out.safetensors")
    reasons = {r.copy: r.reason for r in weighing.rejected}
    assert sorted(reasons) == [1, 3, 4, 5, 6]
    assert "'w'" in reasons[1] and "shape [3, 4]" in reasons[1] and "expected [4, 3]" in reasons[1]
    assert "dtype F16" in reasons[3] and "expected F32" in reasons[3]
    assert "missing tensors ['b']" in reasons[4] and "unexpected tensors ['c']" in reasons[4]
    assert reasons[5].startswith("not valid safetensors") and "header length" in reasons[5]
    assert "past the file" in reasons[6]
    assert [r.copy for r in weighing.accepted] == [0, 2, 7]
    out = load_file(str(tmp_path / "out.safetensors"))
    expected = sum(w * load_file(str(p))["w"].astype(np.float64) for w, p in zip([1 / 6, 2 / 6, 3 / 6], good))
    np.testing.assert_allclose(out["w"], expected, rtol=2e-6, atol=2e-7)


def test_copies_that_did_no_step_do_not_outvote_the_layout_of_one_that_trained(tmp_path: Path) -> None:
    # Round 0 of a job forked three ways with Adam: two copies start too late to step, and a
    # copy that never stepped has no optimizer state yet (it is created at the first step),
    # so their files lack the "optim.*" tensors. They carry no work (weight 0); the copy that
    # trained must not be rejected for the layout they share, its steps lost.
    rng = np.random.default_rng(3)
    weights = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    trained = _replica(tmp_path / "trained.safetensors", {**weights, "optim.0.exp_avg": np.ones((4, 3), np.float32)})
    late = [_replica(tmp_path / f"late{i}.safetensors", dict(weights)) for i in range(2)]
    weighing, _ = consolidate_local([(late[0], 0), (trained, 40), (late[1], 0)], tmp_path / "out.safetensors")
    assert [r.copy for r in weighing.accepted] == [1] and weighing.round_steps == 40
    assert sorted(r.copy for r in weighing.rejected) == [0, 2]
    assert "missing tensors ['optim.0.exp_avg']" in weighing.rejected[0].reason
    # Among copies that did work the layout most share still wins: one odd copy is left out.
    odd = _replica(tmp_path / "odd.safetensors", {**weights, "extra": np.ones(2, np.float32)})
    weighing, _ = consolidate_local([(trained, 10), (odd, 50), (trained, 10)], tmp_path / "out2.safetensors")
    assert [r.copy for r in weighing.accepted] == [0, 2] and [r.copy for r in weighing.rejected] == [1]


def test_nothing_usable_raises_with_every_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 4) + b"[1,2")
    with pytest.raises(NoUsableReplica) as info:
        consolidate_local([(bad, 1)], tmp_path / "out.safetensors")
    assert info.value.rejected[0].copy == 0 and "not JSON" in info.value.rejected[0].reason
    assert not (tmp_path / "out.safetensors").exists()


def test_peak_memory_stays_within_a_few_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    largest = 2 << 20
    paths = []
    for i in range(6):
        tensors = {f"layer{j}.weight": rng.standard_normal(largest // 4, dtype=np.float32) for j in range(4)}
        tensors["small"] = rng.standard_normal(1000).astype(np.float32)
        paths.append((_replica(tmp_path / f"m{i}.safetensors", tensors), 10 + i))
    del tensors
    # Chunked, a chunk larger than any tensor, and readers that cannot map (store objects).
    for chunk_bytes, make in ((1 << 20, FileRangeReader), (64 << 20, FileRangeReader), (1 << 20, ReadOnlyReader),
                              (64 << 20, ReadOnlyReader)):
        replicas = [Replica(copy=i, steps=s, reader=make(p)) for i, (p, s) in enumerate(paths)]
        tracemalloc.start()
        try:
            with open(tmp_path / "out.safetensors", "wb") as out:
                write_consolidated(weigh_replicas(replicas), out, chunk_bytes=chunk_bytes)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # 6 replicas x 8 MiB = 48 MiB of input; memory must stay at a few tensors.
        assert peak < 3 * largest + (256 << 10), (chunk_bytes, make.__name__, peak)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(
    st.text(alphabet="abcdefgh._", min_size=1, max_size=8),
    st.tuples(st.sampled_from(["float32", "float16", "float64", "int64", "int8", "bool"]),
              st.lists(st.integers(0, 4), max_size=3)),
    min_size=1, max_size=6))
def test_header_parser_agrees_with_the_safetensors_library(tmp_path_factory: pytest.TempPathFactory,
                                                           spec: dict) -> None:
    path = tmp_path_factory.mktemp("h") / "f.safetensors"
    tensors = {name: np.zeros(shape, dtype=dtype) for name, (dtype, shape) in spec.items()}
    save_file(tensors, str(path), metadata={"k": "v"})
    with FileRangeReader(path) as reader:
        header = read_header(reader)
    dtype_names = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "int8": "I8", "bool": "BOOL"}
    assert {(t.name, t.dtype, t.shape) for t in header.tensors} == {
        (name, dtype_names[dtype], tuple(shape)) for name, (dtype, shape) in spec.items()}
    assert header.metadata == {"k": "v"}
    encoded, _ = encode_header([(t.name, t.dtype, t.shape) for t in header.tensors], {"m": "1"})
    assert (len(encoded) - 8) % 8 == 0
    body = b"".join(bytes(t.nbytes) for t in header.tensors)
    out = path.with_name("re.safetensors")
    out.write_bytes(encoded + body)
    assert set(load_file(str(out))) == set(spec)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_header_parser_refuses_garbage_with_one_error_type(tmp_path_factory: pytest.TempPathFactory,
                                                           data: bytes) -> None:
    path = tmp_path_factory.mktemp("g") / "g.safetensors"
    path.write_bytes(data)
    with FileRangeReader(path) as reader:
        try:
            read_header(reader)
        except InvalidSafetensors as exc:
            assert exc.reason and "\n" not in exc.reason


def test_header_rejects_overlapping_tensors(tmp_path: Path) -> None:
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    path = tmp_path / "overlap.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with FileRangeReader(path) as reader, pytest.raises(InvalidSafetensors, match="overlaps"):
        read_header(reader)


# ---------------------------------------------------------------- CLI


def test_cli_consolidate_happy_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs = _write_replicas(tmp_path, [1, 3])
    out = tmp_path / "avg.safetensors"
    code = hadar_main(["consolidate", "--out", str(out), f"{inputs[0][0]}:1", f"{inputs[1][0]}:3"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [c["weight"] for c in report["copies"]] == [0.25, 0.75]
    expected = _expected_average(inputs, [0.25, 0.75])
    np.testing.assert_allclose(load_file(str(out))["fc.weight"], expected["fc.weight"], rtol=2e-6, atol=2e-7)
    assert hadar_main(["consolidate", "--uniform", "--out", str(out), f"{inputs[0][0]}:1",
                       f"{inputs[1][0]}:3"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["mode"] == "uniform"


@pytest.mark.parametrize("make_args, message", [
    (lambda d: [f"{d}/copy0.safetensors"], "expected PATH:STEPS"),
    (lambda d: [f"{d}/copy0.safetensors:many"], "STEPS must be an integer"),
    (lambda d: [f"{d}/copy0.safetensors:-1"], "STEPS must be >= 0"),
    (lambda d: [f"{d}/absent.safetensors:3"], "no such file"),
    (lambda d: [f"{d}/junk.bin:3"], "no usable replica"),
])
def test_cli_consolidate_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         make_args, message: str) -> None:
    _write_replicas(tmp_path, [1])
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 3)
    code = hadar_main(["consolidate", "--out", str(tmp_path / "o.safetensors"), *make_args(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.safetensors").exists()
