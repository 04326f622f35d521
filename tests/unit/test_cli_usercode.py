"""A user's own code and data from the job file to the store (services/cli/usercode.py), on a
LocalStore: the fields are checked with one-line errors, a bundle is uploaded once per digest
and only after the job was accepted, a dataset name pins exact bytes, and the job's spec
names its code unambiguously."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.jobfile import JobFileError, parse_job
from services.cli.usercode import CodeFieldError, deliver, split_code_fields, upload_dataset
from services.profiler.estimate import anchored_rates, catalog_rates, job_figures_for
from shared.domain.bundles import sha256_file
from shared.domain.layout import code_bundle_key, data_bundle_key, dataset_key
from shared.errors import UsageError
from shared.store import LocalStore
from shared.wire.events import InvalidEvent, JobSpec, UserCode


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "proj"
    (folder / "pkg").mkdir(parents=True)
    (folder / "train.py").write_text("import hadar_sdk\n")
    (folder / "pkg" / "model.py").write_text("X = 1\n")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: main\n")
    return folder


@pytest.fixture
async def store(tmp_path: Path) -> LocalStore:
    local = LocalStore(tmp_path / "store")
    await local.start()
    return local


def fields(**extra: object) -> dict[str, object]:
    return {"model": "mynet", "workers": 1, "iterations": 100, "code": "proj", **extra}


def test_code_fields_are_split_off_and_checked(code_dir: Path) -> None:
    job, request = split_code_fields(fields(args="--width 64 --name 'a b'", config={"lr": 0.1}, data="digits",
                                            hint="resnet"), base=code_dir.parent)
    assert job == {"model": "mynet", "workers": 1, "iterations": 100}
    assert request is not None and request.folder == code_dir and request.entrypoint == "train.py"
    assert request.args == ("--width", "64", "--name", "a b") and json.loads(request.config) == {"lr": 0.1}
    assert split_code_fields({"model": "resnet", "dataset": "digits"}, base=code_dir) == (
        {"model": "resnet", "dataset": "digits"}, None)


@pytest.mark.parametrize(("extra", "field"), [
    ({"code": "missing"}, "code:"),
    ({"entrypoint": "nope.py"}, "entrypoint:"),
    ({"config": "[1, 2]"}, "config:"),
    ({"config": {"x": float("nan")}}, "config:"),
    ({"data": "../x"}, "data:"),
    ({"dataset": "digits"}, "dataset:"),
    ({"args": {"a": 1}}, "args:"),
])
def test_bad_code_fields_are_one_line_naming_the_field(code_dir: Path, extra: dict[str, object], field: str) -> None:
    with pytest.raises(CodeFieldError) as raised:
        split_code_fields(fields(**extra), base=code_dir.parent)
    assert str(raised.value).startswith(field) and "\n" not in str(raised.value)


def test_code_fields_without_code_are_refused(code_dir: Path) -> None:
    with pytest.raises(CodeFieldError, match=r"^entrypoint: only for a job with code"):
        split_code_fields({"model": "resnet", "entrypoint": "x.py"}, base=code_dir)


def test_an_unknown_model_points_at_bringing_your_own_code() -> None:
    with pytest.raises(JobFileError, match="code: DIR"):
        parse_job({"model": "mynet", "dataset": "mydata", "workers": 1, "iterations": 10})


async def test_a_bundle_is_uploaded_once_and_only_for_an_accepted_job(store: LocalStore, code_dir: Path) -> None:
    _, request = split_code_fields(fields(), base=code_dir.parent)
    assert request is not None

    async def refuse(code: UserCode) -> JobSpec:
        raise UsageError("workers: too many")

    with pytest.raises(UsageError):
        await deliver(store, request, "alice", refuse)
    assert await store.list("users/") == []   # nothing uploaded for a refused job

    async def accept(code: UserCode) -> JobSpec:
        return parse_job({"model": "mynet", "workers": 1, "iterations": 100, "user": "alice"}, code=code)

    spec, uploaded = await deliver(store, request, "alice", accept)
    again, uploaded_again = await deliver(store, request, "alice", accept)
    assert uploaded and not uploaded_again and spec.code == again.code
    assert spec.code is not None and spec.dataset == "-" and spec.code.data_digest == ""
    assert await store.list("users/") == [code_bundle_key("alice", spec.code.digest)]
    stored = Path(store.root) / code_bundle_key("alice", spec.code.digest)
    assert sha256_file(stored) == spec.code.digest and stored.stat().st_size == spec.code.size
    assert spec.job_type == f"mynet@{spec.code.digest[:12]} (batch size 32)"   # never a zoo type


async def test_a_dataset_name_pins_the_bytes_it_stood_for_at_submission(store: LocalStore, tmp_path: Path,
                                                                        code_dir: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("first")
    first = await upload_dataset(store, data, "alice", "corpus")
    (data / "a.txt").write_text("second")
    second = await upload_dataset(store, data, "alice", "corpus")
    assert first["digest"] != second["digest"] and second["uploaded"]
    assert json.loads(await store.get(dataset_key("alice", "corpus")))["digest"] == second["digest"]
    assert await store.exists(data_bundle_key("alice", first["digest"]))   # the old bytes stay for pinned jobs
    _, request = split_code_fields(fields(data="corpus"), base=code_dir.parent)
    assert request is not None

    async def accept(code: UserCode) -> JobSpec:
        return parse_job({"model": "mynet", "dataset": "corpus", "workers": 1, "iterations": 100, "user": "alice"},
                         code=code)

    spec, _ = await deliver(store, request, "alice", accept)
    assert spec.code is not None and (spec.code.data_digest, spec.code.data_size) == (second["digest"], second["size"])
    with pytest.raises(UsageError, match="no dataset 'other'"):
        _, missing = split_code_fields(fields(data="other"), base=code_dir.parent)
        assert missing is not None
        await deliver(store, missing, "alice", accept)


@pytest.mark.parametrize("user", ["Alice", "a b", "../x", ""])
async def test_a_user_who_cannot_own_a_prefix_is_refused(store: LocalStore, code_dir: Path, user: str) -> None:
    _, request = split_code_fields(fields(), base=code_dir.parent)
    assert request is not None

    async def accept(code: UserCode) -> JobSpec:
        raise AssertionError("not reached")

    with pytest.raises(UsageError, match=r"^user: "):
        await deliver(store, request, user, accept)


def test_a_job_with_code_must_name_a_user_that_owns_a_prefix() -> None:
    code = UserCode(digest="a" * 64, size=1, entrypoint="train.py")
    with pytest.raises(InvalidEvent, match=r"JobSpec\.user"):
        JobSpec(job_id="j", user="Alice Smith", model="m", dataset="-", batch_size=1, workers=1, iterations=1,
                code=code)
    with pytest.raises(InvalidEvent, match=r"JobSpec\.dataset"):
        JobSpec(job_id="j", user="alice", model="m", dataset="digits", batch_size=1, workers=1, iterations=1,
                code=code)
    for entrypoint in ("../x.py", "/abs.py", "a/../b.py", "train.sh"):
        with pytest.raises(InvalidEvent, match=r"UserCode\.entrypoint"):
            UserCode(digest="a" * 64, size=1, entrypoint=entrypoint)


def test_a_job_of_user_code_is_estimated_before_it_is_measured() -> None:
    code = UserCode(digest="b" * 64, size=1, entrypoint="train.py")
    spec = JobSpec(job_id="j", user="alice", model="resnet", dataset="-", batch_size=32, workers=1,
                   iterations=1, code=code)
    rates = catalog_rates(spec)
    assert rates and all(r > 0 for r in rates.values())   # never infeasible for lack of figures
    assert job_figures_for(spec).family == "provisional"   # not the zoo's resnet, whatever the label
    hinted = JobSpec(**{**spec.__dict__, "code": UserCode(digest="b" * 64, size=1, entrypoint="t.py", hint="lstm")})
    assert job_figures_for(hinted).family == "provisional:lstm"
    anchored = anchored_rates(rates, "t4", 2.0)   # one measurement re-anchors every other type
    assert "t4" not in anchored
    assert anchored["v100"] == pytest.approx(2.0 * rates["v100"] / rates["t4"])
