"""Apply :mod:`shared.security.principals` to a running Kafka and MinIO: the one setup path
that ``hadar infra up --secure`` and the stack's init service (``hadar infra secure-init``)
both run.

:func:`secure_kafka`, as a super user: creates every topic, a SCRAM user per service
principal with a shared login (their passwords given), and every ACL; then waits until each principal can log
in (SCRAM credentials reach the broker's cache shortly after they are written).
:func:`secure_minio`, as the root user: creates the bucket, a policy and a user per
principal that uses the store. Both are idempotent: run again, they rotate the passwords
they are given and change nothing else; a principal without a shared login (the agent and
the CLI: each node and user has its own, :mod:`shared.security.logins`) has no user, and one
left from before is removed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

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
from shared.security.principals import ADMIN, PRINCIPALS, SERVICE_PRINCIPALS, SHARED_LOGINS, s3_policy, s3_user
from shared.security.scram import delete_users, upsert_users
from shared.store.settings import S3Settings

__all__ = ["secure_kafka", "secure_minio", "SetupError", "kafka_admin", "wait_for_logins", "minio_admin",
           "put_minio_user", "remove_minio_user"]


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
    users = {name: pw for name, pw in passwords.items() if name in SHARED_LOGINS}
    async with kafka_admin(bootstrap, admin) as client:
        await upsert_users(client, users, mechanism=admin.mechanism)
        # the agents' and users' shared logins of old: each node and user has its own now
        await delete_users(client, [n for n in SERVICE_PRINCIPALS if n not in SHARED_LOGINS],
                           mechanism=admin.mechanism)
        await apply_acls(client)
    await wait_for_logins(bootstrap, admin, users, login_wait_s=login_wait_s)


@asynccontextmanager
async def kafka_admin(bootstrap: str, admin: KafkaSecurity) -> AsyncIterator[AIOKafkaAdminClient]:
    """A started admin client of the super user ``admin``, closed on exit."""
    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="hadar-secure-init",
                                 **security_options(admin))
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def wait_for_logins(bootstrap: str, admin: KafkaSecurity, users: Mapping[str, str], *,
                          login_wait_s: float) -> None:
    """Until each of ``users`` (name -> password) can log in; SetupError past ``login_wait_s``."""
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
    admin = minio_admin(root)
    for principal in PRINCIPALS.values():
        if principal.uses_s3:
            put_minio_user(admin, s3_user(principal), s3_policy(principal, root.bucket), secrets[principal.name])
        elif principal.name != ADMIN:   # the agents' and users' shared logins of old: each has its own now
            remove_minio_user(admin, s3_user(principal))


def remove_minio_user(admin: MinioAdmin, name: str) -> None:
    """Remove MinIO user ``name`` and its policy of the same name; either may be absent."""
    for drop in (admin.user_remove, admin.policy_remove):
        try:
            drop(name)
        except MinioAdminException as exc:
            text = str(exc).lower()
            if "does not exist" not in text and "not found" not in text:
                raise SetupError(f"minio user {name}: {exc}") from None


def minio_admin(root: S3Settings) -> MinioAdmin:
    return MinioAdmin(endpoint=root.host_port, credentials=StaticProvider(root.access_key, root.secret_key),
                      secure=root.secure)


def put_minio_user(admin: MinioAdmin, name: str, policy: dict[str, object], secret: str) -> None:
    """Create or update MinIO policy and user ``name`` (secret ``secret``) bound to it."""
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
