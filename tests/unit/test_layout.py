"""The object-store layout: keys build and parse back, and nothing else parses."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.domain.layout import (
    CheckpointKey,
    ModelKey,
    checkpoint_key,
    checkpoint_prefix,
    code_bundle_key,
    data_bundle_key,
    dataset_key,
    final_key,
    model_key,
    model_prefix,
    node_checkpoint_pattern,
    optim_key,
    optim_key_of,
    parse_checkpoint_key,
    parse_final_key,
    parse_model_key,
    parse_optim_key,
    user_prefix,
)
from shared.store import validate_key

job_ids = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True)
numbers = st.integers(min_value=0, max_value=2**63)
node_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True)


def test_the_layout_is_pinned() -> None:
    # Literal on purpose: stored objects outlive the code that wrote them.
    assert checkpoint_key("j1", 3, 0, node="n1") == "checkpoints/j1/3/n1/0.safetensors"
    assert model_key("j1", 3) == "models/j1/3.safetensors"
    assert final_key("j1") == "models/j1/final.safetensors"
    assert checkpoint_prefix("j1") == "checkpoints/j1/"
    assert model_prefix("j1") == "models/j1/"


@given(job_ids, numbers, node_ids, numbers)
def test_checkpoint_key_round_trips(job_id: str, round_: int, node: str, copy: int) -> None:
    key = checkpoint_key(job_id, round_, copy, node=node)
    assert validate_key(key) == key
    assert key.startswith(checkpoint_prefix(job_id))
    assert parse_checkpoint_key(key) == CheckpointKey(job_id=job_id, round=round_, node=node, copy=copy)
    assert parse_model_key(key) is None and parse_final_key(key) is None


@given(job_ids, numbers)
def test_model_key_round_trips(job_id: str, round_: int) -> None:
    key = model_key(job_id, round_)
    assert validate_key(key) == key
    assert key.startswith(model_prefix(job_id))
    assert parse_model_key(key) == ModelKey(job_id=job_id, round=round_)
    assert parse_checkpoint_key(key) is None and parse_final_key(key) is None


@given(job_ids)
def test_final_key_round_trips(job_id: str) -> None:
    key = final_key(job_id)
    assert validate_key(key) == key
    assert key.startswith(model_prefix(job_id))
    assert parse_final_key(key) == job_id
    assert parse_model_key(key) is None and parse_checkpoint_key(key) is None


@given(job_ids, job_ids)
def test_prefixes_never_cover_another_job(a: str, b: str) -> None:
    if a != b:
        assert not checkpoint_key(b, 0, 0, node="n1").startswith(checkpoint_prefix(a))
        assert not final_key(b).startswith(model_prefix(a))


@pytest.mark.parametrize("key", [
    "checkpoints/../0/n1/0.safetensors",        # a '..' job segment
    "checkpoints/j1/../n1/0.safetensors",
    "checkpoints/j1/0/../0.safetensors",        # a '..' node segment
    "checkpoints/j1/0/n1/../0.safetensors",     # extra segments
    "checkpoints/j1/0/n1/0/0.safetensors",
    "checkpoints/j1/0/0.safetensors",           # missing segment (the layout before node segments)
    "x/checkpoints/j1/0/n1/0.safetensors",
    "checkpoints/j1/0/n1/0.safetensors/",
    "/checkpoints/j1/0/n1/0.safetensors",
    "checkpoints/j1/r0/n1/0.safetensors",       # non-integer round / copy
    "checkpoints/j1/1.5/n1/0.safetensors",
    "checkpoints/j1/-1/n1/0.safetensors",
    "checkpoints/j1/+1/n1/0.safetensors",
    "checkpoints/j1/01/n1/0.safetensors",       # not canonical: would not build back to itself
    "checkpoints/j1/1_0/n1/0.safetensors",
    "checkpoints/j1/ 1/n1/0.safetensors",
    "checkpoints/j1/0/n1/x.safetensors",
    "checkpoints/j1/0/n1/.safetensors",
    "checkpoints/j1/0/n1/0.safetensor",         # wrong suffix
    "checkpoints/j1/0/n1/0",
    "checkpoints/J1/0/n1/0.safetensors",        # not a job id
    "checkpoints/.j1/0/n1/0.safetensors",
    "checkpoints/j1\n/0/n1/0.safetensors",
    "checkpoints//0/n1/0.safetensors",
    "checkpoints/j1/٣/n1/0.safetensors",        # a non-ASCII digit that int() would accept
    "checkpoints/j1/0//0.safetensors",          # not a node id
    "checkpoints/j1/0/.n1/0.safetensors",
    "checkpoints/j1/0/n1\n/0.safetensors",
    "checkpoints/j1/0/n 1/0.safetensors",
    "",
])
def test_bad_checkpoint_keys_do_not_parse(key: str) -> None:
    assert parse_checkpoint_key(key) is None


@pytest.mark.parametrize("key", [
    "models/../0.safetensors",
    "models/j1/../0.safetensors",
    "models/j1/0/0.safetensors",
    "models/j1.safetensors",
    "models/j1/r0.safetensors",
    "models/j1/-1.safetensors",
    "models/j1/00.safetensors",
    "models/j1/final.safetensors",              # the final model is not a round model
    "models/j1/0.safetensors.tmp",
    "models/j1/0",
    "checkpoints/j1/0/n1/0.safetensors",
    "models/Job/0.safetensors",
])
def test_bad_model_keys_do_not_parse(key: str) -> None:
    assert parse_model_key(key) is None


def _s3_matches(pattern: str, key: str) -> bool:
    """An S3/MinIO policy resource pattern against a key: ``*`` spans any characters, ``/`` too."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), key, flags=re.DOTALL) is not None


@given(job_ids, numbers, node_ids, node_ids, numbers)
def test_a_nodes_policy_pattern_covers_its_own_checkpoints_and_no_other_nodes(
        job_id: str, round_: int, node: str, other: str, copy: int) -> None:
    pattern = node_checkpoint_pattern(node) + "*"
    assert _s3_matches(pattern, checkpoint_key(job_id, round_, copy, node=node))
    assert _s3_matches(pattern, checkpoint_key(job_id, round_, copy, node=other)) == (other == node)


@pytest.mark.parametrize("node", ["", "a/b", "*", ".n1", "n1\n"])
def test_a_bad_node_makes_no_key(node: str) -> None:
    with pytest.raises(ValueError):
        checkpoint_key("j1", 0, 0, node=node)
    with pytest.raises(ValueError):
        node_checkpoint_pattern(node)


@pytest.mark.parametrize("key", [
    "models/../final.safetensors", "models/j1/x/final.safetensors", "models/j1/final",
    "models/j1/0.safetensors", "models/j1/FINAL.safetensors", "checkpoints/j1/final.safetensors",
])
def test_bad_final_keys_do_not_parse(key: str) -> None:
    assert parse_final_key(key) is None


@pytest.mark.parametrize("build", [
    lambda: checkpoint_key("..", 0, 0, node="n1"),
    lambda: checkpoint_key("a/b", 0, 0, node="n1"),
    lambda: checkpoint_key("J1", 0, 0, node="n1"),
    lambda: checkpoint_key("j1\n", 0, 0, node="n1"),
    lambda: checkpoint_key("j1", -1, 0, node="n1"),
    lambda: checkpoint_key("j1", 0, -1, node="n1"),
    lambda: checkpoint_key("j1", True, 0, node="n1"),
    lambda: model_key("j1", 1.0),   # type: ignore[arg-type]
    lambda: model_key("", 0),
    lambda: final_key("../x"),
    lambda: checkpoint_prefix("a/"),
    lambda: model_prefix("."),
])
def test_builders_refuse_parts_outside_the_layout(build: Callable[[], str]) -> None:
    with pytest.raises(ValueError):
        build()


@given(job_ids, numbers)
def test_optim_key_lies_beside_its_model_and_parses_as_nothing_else(job_id: str, round_: int) -> None:
    key = optim_key(job_id, round_)
    assert validate_key(key) == key and key.startswith(model_prefix(job_id))
    assert optim_key_of(model_key(job_id, round_)) == key
    assert parse_optim_key(key) == ModelKey(job_id=job_id, round=round_)
    assert parse_model_key(key) is None and parse_final_key(key) is None and parse_checkpoint_key(key) is None
    assert parse_optim_key(model_key(job_id, round_)) is None
    assert optim_key_of(final_key(job_id)) is None
    assert optim_key_of(checkpoint_key(job_id, round_, 0, node="n1")) is None


def test_optim_key_is_pinned() -> None:
    assert optim_key("j1", 3) == "models/j1/3.optim.safetensors"


DIGEST = "0123456789abcdef" * 4


def test_user_objects_are_pinned_and_under_their_user() -> None:
    assert code_bundle_key("alice", DIGEST) == f"users/alice/code/{DIGEST}.tar"
    assert data_bundle_key("alice", DIGEST) == f"users/alice/data/{DIGEST}.tar"
    assert dataset_key("alice", "digits") == "users/alice/datasets/digits.json"
    for key in (code_bundle_key("alice", DIGEST), data_bundle_key("alice", DIGEST), dataset_key("alice", "d")):
        assert key.startswith(user_prefix("alice")) and not key.startswith(user_prefix("alic"))
        validate_key(key)


@pytest.mark.parametrize("build", [
    lambda: user_prefix("Alice"),
    lambda: user_prefix("../bob"),
    lambda: user_prefix("a/b"),
    lambda: code_bundle_key("alice", DIGEST.upper()),
    lambda: code_bundle_key("alice", DIGEST[:-1]),
    lambda: data_bundle_key("alice", "../" + DIGEST[3:]),
    lambda: dataset_key("alice", "../x"),
    lambda: dataset_key("alice", "x/y"),
])
def test_user_object_builders_refuse_parts_outside_the_layout(build: Callable[[], str]) -> None:
    with pytest.raises(ValueError):
        build()
