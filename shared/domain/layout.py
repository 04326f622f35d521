"""The object-store layout: the one place that knows where a job's objects live.

::

    checkpoints/{job}/{round}/{node}/{copy}.safetensors   a copy's weights at the end of a round (agent)
    models/{job}/{round}.safetensors         the round's consolidated model: weights only (tracker)
    models/{job}/{round}.optim.safetensors   its averaged optimizer state, for resuming (tracker)
    models/{job}/final.safetensors           the job's final model (tracker)
    snapshots/{owner}/{seq}.snapshot         a service's state snapshot (shared/persistence/snapshot.py)
    users/{user}/code/{digest}.tar           a user's code bundle (hadar submit; shared/domain/bundles.py)
    users/{user}/data/{digest}.tar           a user's dataset bundle (hadar data put)
    users/{user}/datasets/{name}.json        which dataset bundle a name stands for now (hadar data put)

Each object under ``models/`` names the job's user as its owner (:data:`OWNER_TAG`, written
with the object; :func:`model_owner`): with ``--secure`` a user may read a model only when it
names them (:func:`shared.security.principals.user_s3_policy`), and may tag nothing.

``node`` is the GPU node that ran the copy's rank 0 and wrote the file
(:data:`shared.wire.records.NODE_ID_RE`): with ``--secure`` each node's store login may write
only keys with its own node segment (:func:`shared.security.principals.node_s3_policy`), so a
node cannot plant a file where the tracker looks for another node's copy. ``user`` is a user
(:data:`shared.wire.records.USER_RE`), ``digest`` a bundle's SHA-256 in lowercase hex and
``name`` a dataset name (:data:`shared.wire.records.DATASET_RE`); bundles are named by
content, so a key never changes meaning. ``job`` is a job id
(:data:`shared.wire.records.JOB_ID_RE`); ``owner`` a service's consumer group id (1-63 of
letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit); ``seq``, ``round`` and
``copy`` are non-negative integers in decimal, without leading zeros. Every object is written
to a temporary name first and moved to its key only when complete (``ObjectStore.put_file``),
so a reader that finds a key finds a whole file.

Builders raise ``ValueError`` for parts that would not make a key of this layout; the
parsers return ``None`` for any key that is not exactly of it, so
``parse_checkpoint_key(checkpoint_key(j, r, c, node=n))`` gives back ``(j, r, n, c)`` and
nothing else parses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.wire.records import DATASET_RE, DIGEST_RE, JOB_ID_RE, NODE_ID_RE, USER_RE

__all__ = [
    "CheckpointKey", "ModelKey", "checkpoint_key", "node_checkpoint_pattern", "model_key", "final_key",
    "checkpoint_prefix", "model_prefix", "parse_checkpoint_key", "parse_model_key", "parse_final_key",
    "snapshot_key", "snapshot_prefix", "parse_snapshot_key", "optim_key", "optim_key_of", "parse_optim_key",
    "user_prefix", "code_bundle_key", "data_bundle_key", "dataset_key", "dataset_prefix",
    "OWNER_TAG", "model_owner",
]

CHECKPOINTS = "checkpoints"
MODELS = "models"
SUFFIX = ".safetensors"
FINAL = "final"
SNAPSHOTS = "snapshots"
SNAPSHOT_SUFFIX = ".snapshot"
USERS = "users"
BUNDLE_SUFFIX = ".tar"
OPTIM_SUFFIX = ".optim" + SUFFIX
_NUMBER_RE = re.compile(r"0|[1-9][0-9]*")
_OWNER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


@dataclass(frozen=True, kw_only=True)
class CheckpointKey:
    """The parts of a checkpoint key."""

    job_id: str
    round: int
    node: str
    copy: int


@dataclass(frozen=True, kw_only=True)
class ModelKey:
    """The parts of a round model's key."""

    job_id: str
    round: int


OWNER_TAG = "owner"   # the object tag that names the user an object belongs to


def model_owner(user: str) -> str | None:
    """The owner of the models of a job submitted by ``user``: ``user`` itself when it is a
    user name of the layout (every user of a secured cluster is), else None. A development
    cluster's free-text user (``JobSpec.user``) names no login, so nobody's policy matches it."""
    return user if USER_RE.fullmatch(user) is not None else None


def checkpoint_key(job_id: str, round_: int, copy: int, *, node: str) -> str:
    """Where ``copy``'s checkpoint of round ``round_`` of ``job_id``, written by ``node``, lives."""
    if not isinstance(node, str) or NODE_ID_RE.fullmatch(node) is None:
        raise ValueError(f"not a node id: {node!r}")
    return f"{checkpoint_prefix(job_id)}{_number(round_, 'round')}/{node}/{_number(copy, 'copy')}{SUFFIX}"


def node_checkpoint_pattern(node: str) -> str:
    """A store-policy pattern (``*`` spans any characters) that a layout key matches exactly
    when it is a checkpoint of ``node``: a node segment is the only one that can equal
    ``node`` after two further segments (job ids and node ids hold no ``/``, rounds are
    digits and a copy's segment ends in the suffix)."""
    if not isinstance(node, str) or NODE_ID_RE.fullmatch(node) is None:
        raise ValueError(f"not a node id: {node!r}")
    return f"{CHECKPOINTS}/*/*/{node}/"


def model_key(job_id: str, round_: int) -> str:
    """Where the consolidated model of round ``round_`` of ``job_id`` lives."""
    return f"{model_prefix(job_id)}{_number(round_, 'round')}{SUFFIX}"


def optim_key(job_id: str, round_: int) -> str:
    """Where the optimizer state of round ``round_``'s model of ``job_id`` lives (beside it)."""
    return f"{model_prefix(job_id)}{_number(round_, 'round')}{OPTIM_SUFFIX}"


def optim_key_of(model: str) -> str | None:
    """The optimizer-state key beside round model key ``model``; None if ``model`` is not a
    round model's key (a checkpoint carries its optimizer state inside)."""
    parts = parse_model_key(model)
    return None if parts is None else optim_key(parts.job_id, parts.round)


def final_key(job_id: str) -> str:
    """Where the final model of ``job_id`` lives."""
    return f"{model_prefix(job_id)}{FINAL}{SUFFIX}"


def checkpoint_prefix(job_id: str) -> str:
    """The prefix of every checkpoint of ``job_id`` (ends in ``/``; no other job's key has it)."""
    return f"{CHECKPOINTS}/{_job(job_id)}/"


def model_prefix(job_id: str) -> str:
    """The prefix of every model of ``job_id``, final included (ends in ``/``; no other job's key has it)."""
    return f"{MODELS}/{_job(job_id)}/"


def parse_checkpoint_key(key: str) -> CheckpointKey | None:
    """The parts of a checkpoint key; None if ``key`` is not one."""
    parts = key.split("/")
    if len(parts) != 5 or parts[0] != CHECKPOINTS or not parts[4].endswith(SUFFIX):
        return None
    job_id, round_, node, copy = parts[1], parts[2], parts[3], parts[4][:-len(SUFFIX)]
    if not (_is_job(job_id) and _is_number(round_) and NODE_ID_RE.fullmatch(node) and _is_number(copy)):
        return None
    return CheckpointKey(job_id=job_id, round=int(round_), node=node, copy=int(copy))


def parse_model_key(key: str) -> ModelKey | None:
    """The parts of a round model's key; None if ``key`` is not one (a final key is not)."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != MODELS or not parts[2].endswith(SUFFIX):
        return None
    job_id, round_ = parts[1], parts[2][:-len(SUFFIX)]
    if not (_is_job(job_id) and _is_number(round_)):
        return None
    return ModelKey(job_id=job_id, round=int(round_))


def parse_optim_key(key: str) -> ModelKey | None:
    """The job and round of an optimizer-state key; None if ``key`` is not one."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != MODELS or not parts[2].endswith(OPTIM_SUFFIX):
        return None
    job_id, round_ = parts[1], parts[2][:-len(OPTIM_SUFFIX)]
    if not (_is_job(job_id) and _is_number(round_)):
        return None
    return ModelKey(job_id=job_id, round=int(round_))


def parse_final_key(key: str) -> str | None:
    """The job id of a final model's key; None if ``key`` is not one."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != MODELS or parts[2] != FINAL + SUFFIX or not _is_job(parts[1]):
        return None
    return parts[1]


def snapshot_prefix(owner: str) -> str:
    """The prefix of every snapshot of ``owner`` (ends in ``/``; no other owner's key has it)."""
    if not isinstance(owner, str) or _OWNER_RE.fullmatch(owner) is None:
        raise ValueError(f"not a snapshot owner: {owner!r}")
    return f"{SNAPSHOTS}/{owner}/"


def snapshot_key(owner: str, seq: int) -> str:
    """Where snapshot number ``seq`` of ``owner`` lives (a larger ``seq`` is newer)."""
    return f"{snapshot_prefix(owner)}{_number(seq, 'seq')}{SNAPSHOT_SUFFIX}"


def parse_snapshot_key(key: str) -> tuple[str, int] | None:
    """(owner, seq) of a snapshot key; None if ``key`` is not one."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != SNAPSHOTS or not parts[2].endswith(SNAPSHOT_SUFFIX):
        return None
    owner, seq = parts[1], parts[2][:-len(SNAPSHOT_SUFFIX)]
    if _OWNER_RE.fullmatch(owner) is None or not _is_number(seq):
        return None
    return owner, int(seq)


def user_prefix(user: str) -> str:
    """The prefix of every object ``user`` owns (ends in ``/``; no other user's key has it)."""
    if not isinstance(user, str) or USER_RE.fullmatch(user) is None:
        raise ValueError(f"not a user who owns objects: {user!r}")
    return f"{USERS}/{user}/"


def code_bundle_key(user: str, digest: str) -> str:
    """Where ``user``'s code bundle with SHA-256 ``digest`` lives."""
    return f"{user_prefix(user)}code/{_digest(digest)}{BUNDLE_SUFFIX}"


def data_bundle_key(user: str, digest: str) -> str:
    """Where ``user``'s dataset bundle with SHA-256 ``digest`` lives."""
    return f"{user_prefix(user)}data/{_digest(digest)}{BUNDLE_SUFFIX}"


def dataset_prefix(user: str) -> str:
    """The prefix of ``user``'s dataset names (ends in ``/``)."""
    return f"{user_prefix(user)}datasets/"


def dataset_key(user: str, name: str) -> str:
    """Where the record of which bundle ``user``'s dataset ``name`` stands for lives."""
    if not isinstance(name, str) or DATASET_RE.fullmatch(name) is None:
        raise ValueError(f"not a dataset name: {name!r}")
    return f"{dataset_prefix(user)}{name}.json"


def _digest(digest: str) -> str:
    if not isinstance(digest, str) or DIGEST_RE.fullmatch(digest) is None:
        raise ValueError(f"not a SHA-256 digest: {digest!r}")
    return digest


def _is_job(text: str) -> bool:
    return JOB_ID_RE.fullmatch(text) is not None   # fullmatch: the pattern's "$" admits a final "\n"


def _is_number(text: str) -> bool:
    return _NUMBER_RE.fullmatch(text) is not None


def _job(job_id: str) -> str:
    if not isinstance(job_id, str) or not _is_job(job_id):
        raise ValueError(f"not a job id: {job_id!r}")
    return job_id


def _number(value: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value
