"""Apply :mod:`shared.security.principals` to a running Kafka and MinIO: the one setup path
that ``hadar infra up --secure`` and the stack's init service (``hadar infra secure-init``)
both run.

:func:`secure_kafka`, as a super user: creates every topic, a SCRAM user per service
principal (their passwords given), and every ACL; then waits until each principal can log
in (SCRAM credentials reach the broker's cache shortly after they are written).
:func:`secure_minio`, as the root user: creates the bucket, a policy and a user per
principal that uses the store. :func:`secure_node_stores`, as the root user: a policy and a
user per enrolled GPU node (its secret derived from the master key at the node's epoch,
:func:`shared.security.identities.store_secret`), and no user for a revoked one. All are
idempotent: run again, they rotate the passwords they are given (a node's with its epoch)
and change nothing else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient
from minio import Minio
from minio.credentials import StaticProvider
from minio.error import MinioAdminException
from minio.minioadmin import MinioAdmin

from shared.bus.kafka import KafkaBus
from shared.bus.kafka_login import diagnose, security_options
from shared.bus.settings import KafkaSecurity
from shared.errors import HadarError
from shared.security.acls import apply_acls
from shared.security.identities import Registry, store_secret
from shared.security.principals import ADMIN, PRINCIPALS, node_s3_policy, node_s3_user, s3_policy, s3_user
from shared.security.scram import upsert_users
from shared.store.settings import S3Settings

__all__ = ["secure_kafka", "secure_minio", "secure_node_stores", "remove_node_store", "NodeStores", "SetupError"]


class SetupError(HadarError):
    """The secured setup could not be applied; the message says which step."""


async def secure_kafka(bootstrap: str, admin: KafkaSecurity, passwords: Mapping[str, str], *,
                       partitions: int = 3, replication_factor: int = 1, login_wait_s: float = 30.0) -> None:
    """Topics, SCRAM users (``passwords``: principal -> password, admin excluded) and ACLs."""
    bus = KafkaBus(bootstrap, security=admin, source="secure-init", partitions=partitions,
                   replication_factor=replication_factor)
    await bus.start()
    try:
        await bus.ensure_topics()
    finally:
        await bus.stop()
    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="hadar-secure-init",
                                 **security_options(admin))
    await client.start()
    try:
        users = {name: pw for name, pw in passwords.items() if name != ADMIN}
        await upsert_users(client, users, mechanism=admin.mechanism)
        await apply_acls(client)
    finally:
        await client.close()
    deadline = time.monotonic() + login_wait_s

    async def logs_in(name: str, password: str) -> None:
        login = KafkaSecurity(protocol=admin.protocol, mechanism=admin.mechanism, username=name,
                              password=password, ca_file=admin.ca_file)
        while (reason := await diagnose(bootstrap, login, timeout_s=5.0)) is not None:
            if time.monotonic() > deadline:
                raise SetupError(f"kafka user {name} cannot log in after setup: {reason}")
            await asyncio.sleep(0.2)

    await asyncio.gather(*(logs_in(name, password) for name, password in users.items()))


def secure_minio(root: S3Settings, secrets: Mapping[str, str]) -> None:
    """The bucket, and for each principal that uses the store a policy ``hadar-<name>`` and a
    user ``hadar-<name>`` (secret from ``secrets``) bound to it; no user for a principal that
    does not."""
    client = Minio(root.host_port, access_key=root.access_key, secret_key=root.secret_key, secure=root.secure)
    if not client.bucket_exists(root.bucket):
        client.make_bucket(root.bucket)
    admin = _admin(root)
    for principal in PRINCIPALS.values():
        if principal.uses_s3:
            _user_with_policy(admin, s3_user(principal), s3_policy(principal, root.bucket), secrets[principal.name])
        elif principal.name != ADMIN:   # e.g. the agent's shared login of old: nodes have their own now
            _remove_user(admin, s3_user(principal))


@dataclass(frozen=True, kw_only=True)
class NodeStores:
    """What :func:`secure_node_stores` did: the nodes given a login, the revoked ones removed."""

    enrolled: tuple[str, ...]
    removed: tuple[str, ...]


def secure_node_stores(root: S3Settings, registry: Registry, master: bytes, *,
                       only: str | None = None) -> NodeStores:
    """A store login per node enrolled in ``registry`` (policy and user ``hadar-node-<id>``,
    secret at the node's current epoch) and none for a revoked node; ``only``: just that node
    (an enrolment or a revocation). The bucket must exist (:func:`secure_minio`)."""
    admin = _admin(root)
    enrolled, removed = [], []
    for identity, epoch in sorted(registry.epochs.items()):
        node = identity.removeprefix("node/")
        if identity.startswith("node/") and only in (None, node):
            _user_with_policy(admin, node_s3_user(node), node_s3_policy(node, root.bucket),
                              store_secret(master, identity, epoch))
            enrolled.append(node)
    for identity in sorted(registry.retired):
        node = identity.removeprefix("node/")
        if identity.startswith("node/") and only in (None, node):
            _remove_node_store(admin, node)
            removed.append(node)
    return NodeStores(enrolled=tuple(enrolled), removed=tuple(removed))


def remove_node_store(root: S3Settings, node: str) -> None:
    """Remove node ``node``'s store login and policy (a revocation; none is fine)."""
    _remove_node_store(_admin(root), node)


def _remove_node_store(admin: MinioAdmin, node: str) -> None:
    _remove_user(admin, node_s3_user(node))


def _remove_user(admin: MinioAdmin, name: str) -> None:
    """Remove MinIO user ``name`` and its policy of the same name; either may be absent."""
    for drop in (admin.user_remove, admin.policy_remove):
        try:
            drop(name)
        except MinioAdminException as exc:
            text = str(exc).lower()
            if "does not exist" not in text and "not found" not in text:
                raise SetupError(f"minio user {name}: {exc}") from None


def _admin(root: S3Settings) -> MinioAdmin:
    return MinioAdmin(endpoint=root.host_port, credentials=StaticProvider(root.access_key, root.secret_key),
                      secure=root.secure)


def _user_with_policy(admin: MinioAdmin, name: str, policy: dict[str, object], secret: str) -> None:
    try:
        admin.policy_add(name, policy=policy)
        admin.user_add(name, secret)
        try:
            admin.attach_policy([name], user=name)
        except MinioAdminException as exc:
            if "already" not in str(exc).lower():
                raise
    except MinioAdminException as exc:
        raise SetupError(f"minio user {name}: {exc}") from None
