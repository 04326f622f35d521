"""A consolidated model's metadata: the bytes written, the round trip, one error for bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

from services.tracker.averaging.consolidate import (
    Rejected,
    Replica,
    weigh_replicas,
    write_consolidated,
)
from services.tracker.averaging.safetensors_format import FileRangeReader, read_header
from shared.domain.model_meta import (
    InvalidModelMetadata,
    ModelDescription,
    ModelMetadata,
)
from shared.wire.records import CopyWeight, Rejection

META = ModelMetadata(job="j1", round=3, total_steps=250, mode="steps",
                     copies=(CopyWeight(copy=0, steps=30, weight=0.75), CopyWeight(copy=2, steps=10, weight=0.25)),
                     rejected=(Rejection(copy=1, reason="copy failed: oom"),), missing=(3, 4),
                     format="hadar-checkpoint-1")

# What the tracker has written since its first version, byte for byte and in this order.
WRITTEN = {
    "format": "hadar-checkpoint-1",
    "mode": "steps",
    "round_steps": "40",
    "copies": '[{"copy":0,"steps":30,"weight":0.75},{"copy":2,"steps":10,"weight":0.25}]',
    "rejected": '[{"copy":1,"reason":"copy failed: oom"}]',
    "job": "j1",
    "round": "3",
    "total_steps": "250",
    "missing": "[3, 4]",
}


def test_to_metadata_writes_the_bytes_the_tracker_always_wrote() -> None:
    assert list(META.to_metadata().items()) == list(WRITTEN.items())
    assert META.round_steps == 40


def test_a_consolidated_file_carries_exactly_the_model_metadata(tmp_path: Path) -> None:
    replicas = []
    for copy, steps in ((0, 30), (2, 10)):
        path = tmp_path / f"{copy}.safetensors"
        save_file({"w": np.full(4, float(copy), np.float32)}, str(path), metadata={"format": "hadar-checkpoint-1"})
        replicas.append(Replica(copy=copy, steps=steps, reader=FileRangeReader(path)))
    weighing = weigh_replicas(replicas, rejected=[Rejected(copy=1, reason="copy failed: oom")], prior_worker_steps=210)
    meta = weighing.model_metadata(job="j1", round_=3, missing=(3, 4))
    assert meta == META
    out = tmp_path / "model.safetensors"
    with open(out, "wb") as f:
        write_consolidated(weighing, f, metadata=meta.to_metadata())
    header = read_header(FileRangeReader(out))
    assert header.metadata == WRITTEN   # the entries, not their order, are the contract
    assert ModelMetadata.from_metadata(header.metadata) == META


def test_optional_entries_may_be_absent_and_unknown_ones_are_ignored() -> None:
    meta = {k: v for k, v in WRITTEN.items() if k not in ("format", "rejected", "missing", "round_steps")}
    parsed = ModelMetadata.from_metadata({**meta, "made_by": "someone else"})
    assert parsed == ModelMetadata(job="j1", round=3, total_steps=250, mode="steps", copies=META.copies)


ids = st.lists(st.integers(min_value=0, max_value=2**63 - 1), unique=True, min_size=1, max_size=12)


@st.composite
def model_metadata(draw: st.DrawFn) -> ModelMetadata:
    copy_ids = draw(ids)
    n_copies = draw(st.integers(min_value=1, max_value=len(copy_ids)))
    n_rejected = draw(st.integers(min_value=0, max_value=len(copy_ids) - n_copies))
    steps = st.integers(min_value=0, max_value=2**40)
    copies = tuple(CopyWeight(copy=c, steps=draw(steps), weight=draw(st.floats(min_value=0.0, max_value=1.0)))
                   for c in copy_ids[:n_copies])
    rejected = tuple(Rejection(copy=c, reason=draw(st.text(st.characters(blacklist_categories=("Cs",)))))
                     for c in copy_ids[n_copies:n_copies + n_rejected])
    round_steps = sum(c.steps for c in copies)
    return ModelMetadata(
        job=draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True)),
        round=draw(st.integers(min_value=0, max_value=2**63 - 1)),
        total_steps=round_steps + draw(st.integers(min_value=0, max_value=2**62)),   # any count: job steps
        mode=draw(st.sampled_from(["steps", "uniform"])), copies=copies, rejected=rejected,
        missing=tuple(copy_ids[n_copies + n_rejected:]),
        format=draw(st.none() | st.text(st.characters(blacklist_categories=("Cs",)))))


@given(model_metadata())
def test_round_trip(meta: ModelMetadata) -> None:
    written = meta.to_metadata()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in written.items())
    assert ModelMetadata.from_metadata(written) == meta


def _with(**changes: Any) -> dict[str, Any]:
    meta: dict[str, Any] = dict(WRITTEN)
    for key, value in changes.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    return meta


@pytest.mark.parametrize("meta, names", [
    (_with(job=None), "job"),
    (_with(job="J1"), "job"),
    (_with(job="j1\n"), "job"),
    (_with(job="a/b"), "job"),
    (_with(round=None), "round"),
    (_with(round="x"), "round"),
    (_with(round="-1"), "round"),
    (_with(round="01"), "round"),
    (_with(round=" 3"), "round"),
    (_with(round="3_0"), "round"),
    (_with(round="9" * 5000), "round"),   # int() of this would raise its own ValueError
    (_with(round=str(2**63)), "round"),
    (_with(total_steps=None), "total_steps"),
    (_with(total_steps="2.5"), "total_steps"),
    (_with(mode=None), "mode"),
    (_with(mode="mean"), "mode"),
    (_with(round_steps="41"), "round_steps"),
    (_with(round_steps="forty"), "round_steps"),
    (_with(copies=None), "copies"),
    (_with(copies="[]"), "copies"),
    (_with(copies="0,1"), "copies"),
    (_with(copies='{"copy":0}'), "copies"),
    (_with(copies="[" * 100_000), "copies"),
    (_with(copies='[{"copy":0,"steps":40}]'), "copies"),
    (_with(copies='[{"copy":0,"steps":40,"weight":1.0,"extra":1}]'), "copies"),
    (_with(copies='[{"copy":"0","steps":40,"weight":1.0}]'), "copies.copy"),
    (_with(copies='[{"copy":true,"steps":40,"weight":1.0}]'), "copies.copy"),
    (_with(copies='[{"copy":0,"steps":-1,"weight":1.0}]'), "copies.steps"),
    (_with(copies='[{"copy":0,"steps":40.0,"weight":1.0}]'), "copies.steps"),
    (_with(copies='[{"copy":0,"steps":40,"weight":NaN}]'), "copies.weight"),
    (_with(copies='[{"copy":0,"steps":40,"weight":"1"}]'), "copies.weight"),
    (_with(copies='[{"copy":0,"steps":40,"weight":1.5}]'), "copies.weight"),
    (_with(copies='[{"copy":0,"steps":40,"weight":1e400}]'), "copies.weight"),
    (_with(copies='[{"copy":0,"steps":20,"weight":0.5},{"copy":0,"steps":20,"weight":0.5}]'), "twice"),
    (_with(rejected="nope"), "rejected"),
    (_with(rejected='[{"copy":1}]'), "rejected"),
    (_with(rejected='[{"copy":1,"reason":7}]'), "rejected.reason"),
    (_with(rejected='[{"copy":1,"reason":"\\ud800"}]'), "reason"),   # a lone surrogate is not text
    (_with(rejected='[{"copy":0,"reason":"also averaged?"}]'), "twice"),
    (_with(missing="3, 4"), "missing"),
    (_with(missing='["3"]'), "missing"),
    (_with(missing="[2]"), "twice"),
    (_with(missing="{}"), "missing"),
    ({**WRITTEN, "job": 1}, "job"),
    ({**WRITTEN, 7: "x"}, "7"),
    ([("job", "j1")], "mapping"),
])
def test_malformed_metadata_raises_the_one_error(meta: Any, names: str) -> None:
    with pytest.raises(InvalidModelMetadata, match=names):
        ModelMetadata.from_metadata(meta)


@given(st.dictionaries(st.sampled_from(sorted(WRITTEN)), st.text(max_size=40)))
def test_any_change_to_an_entry_parses_or_raises_the_one_error(changes: dict[str, str]) -> None:
    try:
        ModelMetadata.from_metadata({**WRITTEN, **changes})
    except InvalidModelMetadata:
        pass


@pytest.mark.parametrize("changes", [
    {"job": ".."}, {"round": -1}, {"round": True}, {"total_steps": 1.0}, {"mode": "mean"}, {"copies": ()},
    {"copies": [{"copy": 0, "steps": 1, "weight": 1.0}]}, {"missing": (-1,)}, {"missing": 3},
    {"rejected": (Rejection(copy=0, reason="dup"),)}, {"format": 1},
])
def test_an_invalid_model_metadata_cannot_be_built(changes: dict[str, Any]) -> None:
    fields = {"job": META.job, "round": META.round, "total_steps": META.total_steps, "mode": META.mode,
              "copies": META.copies, "rejected": META.rejected, "missing": META.missing, "format": META.format}
    with pytest.raises(InvalidModelMetadata):
        ModelMetadata(**{**fields, **changes})


def test_total_steps_are_job_steps_and_may_be_fewer_than_the_copies_own_steps() -> None:
    """Two copies on 1 of a W=2 job's workers, 30 and 10 steps: 20 job steps (issue 11)."""
    meta = ModelMetadata(job="j1", round=0, total_steps=20, mode="steps",
                         copies=(CopyWeight(copy=0, steps=30, weight=0.75), CopyWeight(copy=1, steps=10, weight=0.25)))
    assert ModelMetadata.from_metadata(meta.to_metadata()) == meta and meta.round_steps == 40


DESCRIBED = ModelDescription(model="resnet-w16-d2", dataset="digits", width=16, depth=2,
                             zoo='{"depth":2,"family":"resnet","width":16}', library="hadar 0.1.0", samples=12_800)


def test_a_description_is_written_after_the_old_entries_and_read_back() -> None:
    meta = ModelMetadata(**{**META.__dict__, "description": DESCRIBED})
    written = meta.to_metadata()
    assert list(written)[:len(WRITTEN)] == list(WRITTEN) and {k: written[k] for k in WRITTEN} == WRITTEN
    assert {k: written[k] for k in ("model", "dataset", "width", "depth", "library", "samples")} == {
        "model": "resnet-w16-d2", "dataset": "digits", "width": "16", "depth": "2", "library": "hadar 0.1.0",
        "samples": "12800"}
    assert ModelMetadata.from_metadata(written) == meta
    assert ModelMetadata.from_metadata(WRITTEN).description is None   # a model from before descriptions


@pytest.mark.parametrize("entry, value", [("width", "-1"), ("samples", "x"), ("zoo", "[1]"), ("zoo", "{"),
                                          ("model", ""), ("dataset", None)])
def test_a_malformed_description_raises_the_one_error(entry: str, value: str | None) -> None:
    written = ModelMetadata(**{**META.__dict__, "description": DESCRIBED}).to_metadata()
    if value is None:
        del written[entry]
    else:
        written[entry] = value
    with pytest.raises(InvalidModelMetadata, match=entry):
        ModelMetadata.from_metadata(written)
