"""Each GPU node's own Kafka and MinIO logins, made from the identity registry and the
master key (issue 26): the setup's half of :func:`shared.security.principals.node_login`.

For every node enrolled in the registry, :func:`secure_node_kafka` (as the Kafka super
user) upserts SCRAM user ``hadar-node-<id>`` with the password derived at the node's epoch
(:func:`shared.security.identities.kafka_password`) and its ACLs
(:func:`shared.security.principals.node_kafka_acls`); :func:`secure_node_stores` (as the
MinIO root) puts MinIO user and policy ``hadar-node-<id>`` with the derived store secret
(:func:`~shared.security.identities.store_secret`,
:func:`~shared.security.principals.node_s3_policy`). For every revoked node both remove
the login. ``only`` limits either to one node (an enrolment or a revocation).

Guarantees: idempotent (run again, a node's secrets are those of its current epoch, so a
rotation takes effect and nothing else changes); a revoked node can log in to neither
system once its call returns (a Kafka connection it already holds keeps working until it
reconnects or re-authenticates; its records are refused anyway, by their seals). Nothing is
stored: every secret is derived again from the master key.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.settings import KafkaSecurity
from shared.security.acls import apply_acls
from shared.security.identities import Registry, kafka_password, store_secret
from shared.security.principals import node_kafka_acls, node_login, node_s3_policy
from shared.security.provision import (
    kafka_admin,
    minio_admin,
    put_minio_user,
    remove_minio_user,
    wait_for_logins,
)
from shared.security.scram import delete_users, upsert_users
from shared.store.settings import S3Settings

__all__ = ["NodeLogins", "secure_node_kafka", "secure_node_stores"]


@dataclass(frozen=True, kw_only=True)
class NodeLogins:
    """What a call did: the nodes given (or rotated to) their current logins, the revoked
    nodes whose logins were removed."""

    enrolled: tuple[str, ...]
    removed: tuple[str, ...]

    def summary(self, system: str) -> str:
        return f"{len(self.enrolled)} node {system} logins ({len(self.removed)} revoked removed)"


def _nodes(identities: list[str], only: str | None) -> list[str]:
    return [i.removeprefix("node/") for i in sorted(identities)
            if i.startswith("node/") and only in (None, i.removeprefix("node/"))]


async def secure_node_kafka(bootstrap: str, admin: KafkaSecurity, registry: Registry, master: bytes | None, *,
                            only: str | None = None, login_wait_s: float = 30.0) -> NodeLogins:
    """Kafka logins of the registry's nodes (module docstring); waits until the new ones work.
    ``master`` may be None only when no enrolled node is concerned (a revocation)."""
    enrolled = {node: kafka_password(_master(master), f"node/{node}", registry.epochs[f"node/{node}"])
                for node in _nodes(list(registry.epochs), only)}
    removed = _nodes(list(registry.retired), only)
    async with kafka_admin(bootstrap, admin) as client:
        if enrolled:
            await upsert_users(client, {node_login(n): pw for n, pw in enrolled.items()}, mechanism=admin.mechanism)
            await apply_acls(client, [acl for n in enrolled for acl in node_kafka_acls(n)])
        await delete_users(client, [node_login(n) for n in removed], mechanism=admin.mechanism)
    await wait_for_logins(bootstrap, admin, {node_login(n): pw for n, pw in enrolled.items()},
                          login_wait_s=login_wait_s)
    return NodeLogins(enrolled=tuple(enrolled), removed=tuple(removed))


def secure_node_stores(root: S3Settings, registry: Registry, master: bytes | None, *,
                       only: str | None = None) -> NodeLogins:
    """MinIO logins of the registry's nodes (module docstring). The bucket must exist
    (:func:`shared.security.provision.secure_minio`)."""
    admin = minio_admin(root)
    enrolled = _nodes(list(registry.epochs), only)
    for node in enrolled:
        identity = f"node/{node}"
        put_minio_user(admin, node_login(node), node_s3_policy(node, root.bucket),
                       store_secret(_master(master), identity, registry.epochs[identity]))
    removed = _nodes(list(registry.retired), only)
    for node in removed:
        remove_minio_user(admin, node_login(node))
    return NodeLogins(enrolled=tuple(enrolled), removed=tuple(removed))


def _master(master: bytes | None) -> bytes:
    if master is None:
        raise ValueError("an enrolled node's logins are derived from the master key")
    return master
