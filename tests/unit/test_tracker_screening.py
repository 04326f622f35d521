"""The tracker's screen of a round's replicas against its starting model
(services/tracker/averaging/screening.py): what is measured, what is rejected, and that the
replicas kept are averaged exactly by their samples."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from replica_bytes import BytesReader, entry, safetensors_bytes
from safetensors.numpy import load, save

from services.tracker.averaging.consolidate import (
    NoUsableReplica,
    Rejected,
    Replica,
    weigh_replicas,
    write_consolidated,
)
from services.tracker.averaging.safetensors_format import f32_to_bf16
from services.tracker.averaging.screening import StartUnusable, measure_updates, screen_replicas


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"fc.weight": rng.standard_normal((32, 16)).astype(np.float32),
            "fc.bias": rng.standard_normal(16).astype(np.float32),
            "emb.half": rng.standard_normal((20, 4)).astype(np.float16),
            "head.double": rng.standard_normal(9),
            "bn.num_batches_tracked": np.array(7, dtype=np.int64)}


def moved(start: dict[str, np.ndarray], rng: np.random.Generator, scale: float,
          optim: float | None = None) -> dict[str, np.ndarray]:
    """``start`` plus Gaussian noise of ``scale`` per element (optimizer state if ``optim``)."""
    out = {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
           for k, v in start.items()}
    if optim is not None:
        out["optim.state.0.momentum_buffer"] = np.full((32, 16), optim, dtype=np.float32)
    return out


def reader(tensors: dict[str, np.ndarray], name: str) -> BytesReader:
    return BytesReader(save(tensors), name=name)


def exact_norm(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(((a[k].astype(np.float64) - b[k].astype(np.float64)) ** 2).sum())
                         for k in b if b[k].dtype.kind == "f"))


def test_norms_are_measured_exactly_whatever_the_chunk_and_optimizer_state_is_ignored() -> None:
    rng = np.random.default_rng(1)
    start = model(rng)
    copies = [moved(start, rng, 0.01, optim=1e6), moved(start, rng, 0.02, optim=-1e6)]
    weighing = weigh_replicas([Replica(copy=0, steps=10, reader=reader(copies[0], "c0")),
                               Replica(copy=1, steps=10, reader=reader(copies[1], "c1"))])
    for chunk in (8, 24, 1 << 20):
        norm, updates, tensors, _ = measure_updates(weighing, reader(start, "start"), chunk_bytes=chunk)
        assert tensors == 4 and norm == pytest.approx(exact_norm(start, {k: 0 * v for k, v in start.items()}))
        assert [u.update_norm for u in updates] == pytest.approx([exact_norm(c, start) for c in copies], rel=1e-12)


def bf16(bits: np.ndarray) -> BytesReader:
    return BytesReader(safetensors_bytes({"w": entry("BF16", [bits.size], [0, 2 * bits.size])}, bits.tobytes()))


def test_bf16_tensors_are_compared() -> None:
    w = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    start = f32_to_bf16(w, np.empty(64, dtype=np.uint16))
    other = start.copy()
    other[0] += 1   # one ulp
    weighing = weigh_replicas([Replica(copy=0, steps=1, reader=bf16(other))])
    _, (update,), tensors, _ = measure_updates(weighing, bf16(start), chunk_bytes=64)
    assert tensors == 1 and 0 < update.update_norm < 0.1


def test_a_planted_replica_is_rejected_and_the_rest_are_averaged_by_their_samples() -> None:
    rng = np.random.default_rng(3)
    start = model(rng)
    honest = [moved(start, rng, 0.01) for _ in range(3)]
    planted = model(np.random.default_rng(99))   # another job's weights
    replicas = [Replica(copy=i, steps=s, reader=reader(t, f"c{i}"))
                for i, (s, t) in enumerate(zip([100, 70, 40, 100], [*honest, planted]))]
    weighing = weigh_replicas(replicas)
    screening = screen_replicas(weighing, reader(start, "start"), chunk_bytes=256)
    assert [(v.copy, v.rule) for v in screening.verdicts] == [(3, "out_of_line")]
    assert [r.copy for r in screening.rejections()] == [3]
    kept = weighing.without(screening.rejections())
    assert [(r.copy, r.weight) for r in kept.accepted] == [(0, 100 / 210), (1, 70 / 210), (2, 40 / 210)]
    assert kept.total_steps == 210 and [r.copy for r in kept.rejected] == [3]
    out = io.BytesIO()
    write_consolidated(kept, out)
    got = load(out.getvalue())
    expected = sum(s * t["fc.weight"].astype(np.float64) for s, t in zip([100, 70, 40], honest)) / 210
    np.testing.assert_allclose(got["fc.weight"], expected, rtol=2e-6, atol=2e-7)


def test_a_non_finite_replica_is_rejected_with_the_tensor_named() -> None:
    rng = np.random.default_rng(4)
    start = model(rng)
    bad = moved(start, rng, 0.01)
    bad["fc.bias"][3] = np.nan
    weighing = weigh_replicas([Replica(copy=0, steps=10, reader=reader(moved(start, rng, 0.01), "c0")),
                               Replica(copy=1, steps=10, reader=reader(bad, "c1"))])
    screening = screen_replicas(weighing, reader(start, "start"), chunk_bytes=64)
    assert [(v.copy, v.rule) for v in screening.verdicts] == [(1, "non_finite")]
    assert "'fc.bias'" in screening.verdicts[0].reason
    with pytest.raises(NoUsableReplica):   # every replica rejected: the round has no usable replica
        weighing.without([*screening.rejections(), Rejected(copy=0, reason="x")])


def test_a_starting_model_that_cannot_judge_is_reported() -> None:
    rng = np.random.default_rng(5)
    start = model(rng)
    weighing = weigh_replicas([Replica(copy=0, steps=10, reader=reader(moved(start, rng, 0.01), "c0"))])
    with pytest.raises(StartUnusable, match="not valid safetensors"):
        screen_replicas(weighing, BytesReader(b"garbage!" * 4, name="start"), chunk_bytes=64)
    with pytest.raises(StartUnusable, match="no floating tensor in common"):
        screen_replicas(weighing, reader({"other": np.zeros(3, dtype=np.float32)}, "start"), chunk_bytes=64)
    broken = dict(start)
    broken["fc.bias"] = np.full(16, np.inf, dtype=np.float32)
    with pytest.raises(StartUnusable, match="NaN or inf"):
        screen_replicas(weighing, reader(broken, "start"), chunk_bytes=64)


def test_replicas_of_weight_zero_are_not_read() -> None:
    rng = np.random.default_rng(6)
    start = model(rng)
    idle = reader(moved(start, rng, 5.0), "idle")
    weighing = weigh_replicas([Replica(copy=0, steps=10, reader=reader(moved(start, rng, 0.01), "c0")),
                               Replica(copy=1, steps=0, reader=idle)])
    reads = idle.reads
    screening = screen_replicas(weighing, reader(start, "start"), chunk_bytes=64)
    assert [u.copy for u in screening.updates] == [0] and screening.verdicts == () and idle.reads == reads
