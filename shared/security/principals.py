"""The one declarative table of Hadar's principals and what each may do.

Every principal (one per service, plus the CLI and an admin) has a Kafka user and --
where it touches the object store -- a MinIO user. The dev broker (``hadar infra up
--secure``), the stack's init service (``hadar infra secure-init``) and the tests all
derive their ACLs and policies from :data:`PRINCIPALS`; nothing else lists them.

Kafka (``User:<name>``):

* ``writes``: WRITE (+ DESCRIBE) on those topics; ``reads``: READ (+ DESCRIBE). Both are
  read off the topic table (:data:`shared.wire.topics.TOPICS`: the topics that name the
  principal as a writer or a reader), so the ACLs and the documented contract cannot differ.
* ``groups``: READ on consumer groups whose id starts with the prefix (PREFIXED), so an
  agent's ``hadar-agent-<node>`` works and nothing else does; the CLI gets no group.
* ``admin`` is a super user: it creates topics and ACLs. No service runs as admin.

MinIO (``hadar-<name>``): ``s3_read``/``s3_write`` are key prefixes of
:mod:`shared.domain.layout`; write includes delete (the tracker prunes old checkpoints and
models; scheduler, tracker and profiler prune their own state snapshots, which live under
``snapshots/<group id>/`` and so under their group prefix). The root user only sets this up.

GPU nodes share no login (the ``agent`` row has ``shared_login=False``: no Kafka or MinIO
user of that name exists). Each enrolled node has its own Kafka user and MinIO user
``hadar-node-<node id>`` (:func:`node_login`; secrets from its credential). Its Kafka ACLs
(:func:`node_kafka_acls`) are the agent row's topics and only its own consumer group
``hadar-agent-<node id>`` (LITERAL, so node n1 cannot join n10's); its store policy
(:func:`node_s3_policy`) reads models and users' bundles and reads and writes only the
checkpoints under its own node segment, so no node can put an object where the tracker looks
for another node's copy, and revoking a node removes both its logins.

Users share no login either (the ``cli`` row has ``shared_login=False``): each enrolled user
has Kafka user and MinIO user ``hadar-user-<name>`` (:func:`user_login`). Its ACLs
(:func:`user_kafka_acls`) are the cli row's topics, no group; its store policy
(:func:`user_s3_policy`) reads and writes only the user's own prefix, ``users/<name>/``
(code and data bundles, dataset names), and reads only the models of the user's own jobs
(those whose owner tag names the user).

Guarantee: :func:`kafka_acls`, :func:`node_kafka_acls`, :func:`user_kafka_acls`,
:func:`s3_policy`, :func:`node_s3_policy` and :func:`user_s3_policy` are pure functions of
this table and the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.domain.layout import CHECKPOINTS as _CHECKPOINTS
from shared.domain.layout import MODELS as _MODELS
from shared.domain.layout import OWNER_TAG, node_checkpoint_pattern, user_prefix
from shared.domain.layout import SNAPSHOTS as _SNAPSHOTS
from shared.domain.layout import USERS as _USERS
from shared.wire.topics import PRINCIPALS as TOPIC_PRINCIPALS
from shared.wire.topics import read_by, written_by

__all__ = [
    "Principal", "PRINCIPALS", "SERVICE_PRINCIPALS", "ADMIN", "KafkaAcl", "kafka_acls", "s3_policy",
    "s3_user", "CHECKPOINTS", "MODELS_PREFIX", "USERS_PREFIX", "node_login", "node_s3_policy", "NODE_LOGIN_PREFIX",
    "NODE_PRINCIPAL", "node_kafka_acls", "SHARED_LOGINS", "user_login", "user_s3_policy", "login_of",
    "USER_LOGIN_PREFIX", "USER_PRINCIPAL", "user_kafka_acls", "identity_kafka_acls",
]

CHECKPOINTS = f"{_CHECKPOINTS}/"
MODELS_PREFIX = f"{_MODELS}/"
USERS_PREFIX = f"{_USERS}/"   # users' code and data bundles (written by the CLI, read by agents)
ADMIN = "admin"
NODE_LOGIN_PREFIX = "hadar-node-"   # a node's Kafka user, MinIO user and policy: hadar-node-<node id>
NODE_PRINCIPAL = "agent"          # the principal GPU nodes run as; its logins are per node
USER_PRINCIPAL = "cli"            # the principal users run as; their logins are per user
USER_LOGIN_PREFIX = "hadar-user-"   # a user's Kafka user, MinIO user and policy: hadar-user-<name>


def _own_snapshots(group_prefix: str) -> tuple[str, ...]:
    return (f"{_SNAPSHOTS}/{group_prefix}",)


@dataclass(frozen=True, kw_only=True)
class Principal:
    """One identity on the bus and (optionally) the store."""

    name: str
    writes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    group_prefix: str = ""
    transactional_prefix: str = ""   # Kafka transactional ids it may use (fenced publishers)
    s3_read: tuple[str, ...] = ()
    s3_write: tuple[str, ...] = ()
    shared_login: bool = True   # False: no user of this name; each node or user logs in as itself
    store_per_identity: bool = False   # its members log in to the store as themselves (a node, a user)

    @property
    def uses_s3(self) -> bool:
        return bool(self.s3_read or self.s3_write)


PRINCIPALS: dict[str, Principal] = {p.name: p for p in (
    # Kafka topics come from the topic table: a principal writes and reads exactly the
    # topics that name it there. CLI reads never join a group (services/cli/follow.py).
    # users share no login: each one's are their own (user_kafka_acls, user_s3_policy)
    Principal(name="cli", writes=written_by("cli"), reads=read_by("cli"), shared_login=False,
              store_per_identity=True),
    Principal(name="scheduler", writes=written_by("scheduler"), reads=read_by("scheduler"),
              group_prefix="hadar-scheduler", transactional_prefix="hadar-scheduler",
              s3_read=_own_snapshots("hadar-scheduler"), s3_write=_own_snapshots("hadar-scheduler")),
    # an agent's store login is its node's own (node_s3_policy), never one shared by every node
    Principal(name="agent", writes=written_by("agent"), reads=read_by("agent"), group_prefix="hadar-agent",
              shared_login=False, store_per_identity=True),
    Principal(name="tracker", writes=written_by("tracker"), reads=read_by("tracker"),
              group_prefix="hadar-tracker", transactional_prefix="hadar-tracker",
              s3_read=(CHECKPOINTS, MODELS_PREFIX, *_own_snapshots("hadar-tracker")),
              s3_write=(CHECKPOINTS, MODELS_PREFIX, *_own_snapshots("hadar-tracker"))),
    Principal(name="profiler", writes=written_by("profiler"), reads=read_by("profiler"),
              group_prefix="hadar-profiler",
              s3_read=_own_snapshots("hadar-profiler"), s3_write=_own_snapshots("hadar-profiler")),
    Principal(name=ADMIN),
)}
SERVICE_PRINCIPALS: tuple[str, ...] = tuple(n for n in PRINCIPALS if n != ADMIN)
SHARED_LOGINS: tuple[str, ...] = tuple(n for n in SERVICE_PRINCIPALS if PRINCIPALS[n].shared_login)

# Kafka's enum codes (org.apache.kafka.common.acl / resource), as the wire carries them.
TOPIC, GROUP, TRANSACTIONAL_ID = 2, 3, 5
LITERAL, PREFIXED = 3, 4
READ, WRITE, DESCRIBE = 3, 4, 8
ALLOW = 3


@dataclass(frozen=True, kw_only=True)
class KafkaAcl:
    """One ALLOW binding: ``principal`` may ``operation`` on a resource, from any host."""

    resource_type: int
    resource_name: str
    pattern_type: int
    principal: str
    operation: int


def kafka_acls(principal: Principal) -> list[KafkaAcl]:
    """Every ALLOW binding ``principal`` gets (none for admin, a super user)."""
    if principal.name == ADMIN:
        return []
    user = f"User:{principal.name}"
    acls: list[KafkaAcl] = []
    for topic in sorted(principal.writes):
        acls += [KafkaAcl(resource_type=TOPIC, resource_name=topic, pattern_type=LITERAL, principal=user,
                          operation=op) for op in (WRITE, DESCRIBE)]
    for topic in sorted(principal.reads):
        acls += [KafkaAcl(resource_type=TOPIC, resource_name=topic, pattern_type=LITERAL, principal=user,
                          operation=op) for op in (READ, DESCRIBE)]
    if principal.group_prefix:
        acls.append(KafkaAcl(resource_type=GROUP, resource_name=principal.group_prefix, pattern_type=PREFIXED,
                             principal=user, operation=READ))
    if principal.transactional_prefix:
        acls += [KafkaAcl(resource_type=TRANSACTIONAL_ID, resource_name=principal.transactional_prefix,
                          pattern_type=PREFIXED, principal=user, operation=op) for op in (WRITE, DESCRIBE)]
    return acls


def s3_user(principal: Principal) -> str:
    """The MinIO access key of ``principal``."""
    return f"hadar-{principal.name}"


def s3_policy(principal: Principal, bucket: str) -> dict[str, Any]:
    """The MinIO (IAM) policy document of ``principal`` on ``bucket``."""
    return _policy(bucket, read=principal.s3_read, write=principal.s3_write)


def node_login(node_id: str) -> str:
    """The Kafka user and the MinIO user (access key) of GPU node ``node_id``."""
    return NODE_LOGIN_PREFIX + node_id


def user_login(user: str) -> str:
    """The Kafka user and the MinIO user (access key) of user ``user``."""
    return USER_LOGIN_PREFIX + user


def user_kafka_acls(user: str) -> list[KafkaAcl]:
    """The ALLOW bindings of user ``user``'s Kafka user: the cli row's topics, no group."""
    row = PRINCIPALS[USER_PRINCIPAL]
    return _as(f"User:{user_login(user)}", [a for a in kafka_acls(row) if a.resource_type == TOPIC])


def _as(principal: str, acls: list[KafkaAcl]) -> list[KafkaAcl]:
    return [KafkaAcl(resource_type=a.resource_type, resource_name=a.resource_name, pattern_type=a.pattern_type,
                     principal=principal, operation=a.operation) for a in acls]


def user_s3_policy(user: str, bucket: str) -> dict[str, Any]:
    """The MinIO policy of user ``user``: read and write only ``users/<user>/``, list models,
    and read only the models whose owner tag names ``user`` (its jobs': the tracker writes
    each model with it, shared.domain.layout.OWNER_TAG). It grants no tagging, so a user
    cannot make another's model theirs; a model with no owner no user reads."""
    own = user_prefix(user)
    policy = _policy(bucket, read=(own,), write=(own,), listable=(MODELS_PREFIX,))
    policy["Statement"].append({
        "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"arn:aws:s3:::{bucket}/{MODELS_PREFIX}*"],
        "Condition": {"StringEquals": {f"s3:ExistingObjectTag/{OWNER_TAG}": [user]}}})
    return policy


def login_of(identity: str) -> str:
    """The login name of a node or user identity (``node/N`` -> ``hadar-node-N``)."""
    kind, _, name = identity.partition("/")
    return node_login(name) if kind == "node" else user_login(name)


def identity_kafka_acls(identity: str) -> list[KafkaAcl]:
    """The ALLOW bindings of a node's or a user's own Kafka user."""
    kind, _, name = identity.partition("/")
    return node_kafka_acls(name) if kind == "node" else user_kafka_acls(name)


def node_kafka_acls(node_id: str) -> list[KafkaAcl]:
    """The ALLOW bindings of node ``node_id``'s Kafka user: the agent row's topics, and its own
    consumer group only (``AgentConfig.group_id``: ``hadar-agent-<node id>``, LITERAL)."""
    row = PRINCIPALS[NODE_PRINCIPAL]
    user = f"User:{node_login(node_id)}"
    topics = _as(user, [a for a in kafka_acls(row) if a.resource_type == TOPIC])
    return [*topics, KafkaAcl(resource_type=GROUP, resource_name=f"{row.group_prefix}-{node_id}",
                              pattern_type=LITERAL, principal=user, operation=READ)]


def node_s3_policy(node_id: str, bucket: str) -> dict[str, Any]:
    """The MinIO policy of node ``node_id``: read models and users' bundles; read and write
    (and delete) only its own checkpoints (:func:`shared.domain.layout.node_checkpoint_pattern`)."""
    own = node_checkpoint_pattern(node_id)
    return _policy(bucket, read=(MODELS_PREFIX, USERS_PREFIX, own), write=(own,))


def _policy(bucket: str, *, read: tuple[str, ...], write: tuple[str, ...],
            listable: tuple[str, ...] = ()) -> dict[str, Any]:
    def objects(prefixes: tuple[str, ...]) -> list[str]:
        return [f"arn:aws:s3:::{bucket}/{p}*" for p in prefixes]

    listed = sorted({*read, *write, *listable})
    statements: list[dict[str, Any]] = [
        {"Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": [f"arn:aws:s3:::{bucket}"]},
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
         "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in listed]}}},
    ]
    if read:
        statements.append({"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": objects(read)})
    if write:
        statements.append({"Effect": "Allow", "Action": ["s3:PutObject", "s3:DeleteObject",
                                                         "s3:AbortMultipartUpload"],
                           "Resource": objects(write)})
    return {"Version": "2012-10-17", "Statement": statements}


if set(TOPIC_PRINCIPALS) != set(PRINCIPALS):   # the topic table and this one name the same principals
    raise ImportError(f"principals differ: topics {sorted(TOPIC_PRINCIPALS)}, security {sorted(PRINCIPALS)}")
