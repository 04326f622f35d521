"""Each GPU node's and user's own logins, made from the identity registry and the master
key (issue 26): the setup's half of :func:`shared.security.principals.login_of`.

* :func:`secure_kafka_logins` (as the Kafka super user): for every node and user enrolled in
  the registry, SCRAM user ``hadar-node-<id>`` / ``hadar-user-<name>`` with the password
  derived at its epoch (:func:`shared.security.identities.kafka_password`) and its ACLs
  (:func:`shared.security.principals.identity_kafka_acls`).
* :func:`secure_stores` (as the MinIO root): for every enrolled node and user, MinIO user
  and policy ``hadar-node-<id>`` / ``hadar-user-<name>`` with the store secret derived at
  its epoch (:func:`~shared.security.identities.store_secret`;
  :func:`~shared.security.principals.node_s3_policy`,
  :func:`~shared.security.principals.user_s3_policy`).

For every revoked identity both remove its login. ``only`` limits either to one identity
(an enrolment or a revocation).

Guarantees: idempotent (run again, an identity's secrets are those of its current epoch, so
a rotation takes effect and nothing else changes); a revoked identity can log in to neither
system once its call returns (a Kafka connection it already holds keeps working until it
reconnects; its records are refused anyway, by their seals). Nothing is stored: every
secret is derived again from the master key.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.settings import KafkaSecurity
from shared.security.acls import apply_acls
from shared.security.identities import KINDS, Registry, kafka_password, store_secret
from shared.security.principals import identity_kafka_acls, login_of, node_s3_policy, user_s3_policy
from shared.security.provision import (
    kafka_admin,
    minio_admin,
    put_minio_user,
    remove_minio_user,
    wait_for_logins,
)
from shared.security.scram import delete_users, upsert_users
from shared.store.settings import S3Settings

__all__ = ["Logins", "secure_kafka_logins", "secure_stores"]


@dataclass(frozen=True, kw_only=True)
class Logins:
    """What a call did: the identities given (or rotated to) their current logins, the
    revoked ones whose logins were removed."""

    enrolled: tuple[str, ...]
    removed: tuple[str, ...]

    def summary(self, what: str) -> str:
        return f"{len(self.enrolled)} {what} logins ({len(self.removed)} revoked removed)"


def _chosen(identities: list[str], only: str | None, kinds: tuple[str, ...]) -> list[str]:
    return [i for i in sorted(identities) if i.partition("/")[0] in kinds and only in (None, i)]


async def secure_kafka_logins(bootstrap: str, admin: KafkaSecurity, registry: Registry, master: bytes | None, *,
                              only: str | None = None, login_wait_s: float = 30.0) -> Logins:
    """Kafka logins of the registry's nodes and users (module docstring); waits until the new
    ones work. ``master`` may be None only when no enrolled identity is concerned (a
    revocation)."""
    enrolled = {i: kafka_password(_master(master), i, registry.epochs[i])
                for i in _chosen(list(registry.epochs), only, KINDS)}
    removed = _chosen(list(registry.retired), only, KINDS)
    async with kafka_admin(bootstrap, admin) as client:
        if enrolled:
            await upsert_users(client, {login_of(i): pw for i, pw in enrolled.items()}, mechanism=admin.mechanism)
            await apply_acls(client, [acl for i in enrolled for acl in identity_kafka_acls(i)])
        await delete_users(client, [login_of(i) for i in removed], mechanism=admin.mechanism)
    await wait_for_logins(bootstrap, admin, {login_of(i): pw for i, pw in enrolled.items()},
                          login_wait_s=login_wait_s)
    return Logins(enrolled=tuple(enrolled), removed=tuple(removed))


def secure_stores(root: S3Settings, registry: Registry, master: bytes | None, *,
                  only: str | None = None) -> Logins:
    """MinIO logins of the registry's nodes and users (module docstring). The bucket must
    exist (:func:`shared.security.provision.secure_minio`)."""
    admin = minio_admin(root)
    enrolled = _chosen(list(registry.epochs), only, KINDS)
    for identity in enrolled:
        kind, _, name = identity.partition("/")
        policy = node_s3_policy(name, root.bucket) if kind == "node" else user_s3_policy(name, root.bucket)
        put_minio_user(admin, login_of(identity), policy,
                       store_secret(_master(master), identity, registry.epochs[identity]))
    removed = _chosen(list(registry.retired), only, KINDS)
    for identity in removed:
        remove_minio_user(admin, login_of(identity))
    return Logins(enrolled=tuple(enrolled), removed=tuple(removed))


def _master(master: bytes | None) -> bytes:
    if master is None:
        raise ValueError("an enrolled identity's logins are derived from the master key")
    return master
