"""``hadar infra certs`` and ``hadar infra secure-init``, for a secured stack.

``certs --dir DIR --host kafka``: a new CA (``ca.pem``, ``ca.key``) and a broker certificate
with its key (``server.pem``, PKCS#8 + chain, Kafka's PEM keystore) for the named hosts;
the files become the docker secrets ``hadar_kafka_ca`` and ``hadar_kafka_server_pem``.

``secure-init``: apply the principals' users, ACLs, topics and MinIO policies
to a running Kafka and MinIO -- the stack's one-shot init service runs it.

It connects as the Kafka admin (``HADAR_BOOTSTRAP``, ``HADAR_KAFKA_*`` of the admin
principal) and the MinIO root (``HADAR_S3_*``), and reads each principal's secrets from
``--secrets-dir`` (docker secrets: ``kafka-<principal>-password``,
``s3-<principal>-secret-key``). Run again after changing a secret file, it rotates that
credential. With ``HADAR_AUTHORSHIP_KEY_FILE`` and ``HADAR_AUTHORSHIP_REGISTRY`` it also gives
every enrolled GPU node and user its own Kafka and store logins and removes a revoked one's
(:mod:`shared.security.logins`). Prints what it did, never a secret; a failure is one line
and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from shared.bus.settings import KafkaSettings, kafka_from_env
from shared.errors import ConfigError, HadarError
from shared.security.authorship import KEY_ENV
from shared.security.identities import REGISTRY_ENV, Registry, read_master_key
from shared.security.logins import secure_kafka_logins, secure_stores
from shared.security.principals import ADMIN, PRINCIPALS, SHARED_LOGINS
from shared.security.provision import secure_kafka, secure_minio
from shared.store.settings import S3Settings, s3_from_env

__all__ = ["register_secure_init", "read_secrets"]


def register_secure_init(actions: argparse._SubParsersAction) -> None:
    certs = actions.add_parser("certs", help="make a CA and a Kafka broker certificate (PEM) for the stack")
    certs.add_argument("--dir", type=Path, required=True, help="where to write ca.pem, ca.key, server.pem")
    certs.add_argument("--host", action="append", default=None,
                       help="a name or IP clients use for the broker (repeat; default: kafka)")
    certs.add_argument("--days", type=int, default=365, help="validity in days")
    certs.set_defaults(func=_certs)
    init = actions.add_parser(
        "secure-init", help="create Kafka users, ACLs, topics and MinIO users for every principal",
        description="Connects as the Kafka admin (HADAR_BOOTSTRAP, HADAR_KAFKA_*) and the MinIO root "
                    "(HADAR_S3_*) and reads each principal's secrets from --secrets-dir.")
    init.add_argument("--secrets-dir", type=Path, default=Path("/run/secrets"),
                      help="directory of kafka-<principal>-password and s3-<principal>-secret-key files")
    init.add_argument("--partitions", type=int, default=3, help="partitions of new topics")
    init.add_argument("--replication-factor", type=int, default=1, help="replication factor of new topics")
    init.set_defaults(func=_secure_init)


def _certs(args: argparse.Namespace) -> int:
    import datetime as dt

    from shared.security.tls import make_tls
    files = make_tls(args.dir, hosts=tuple(args.host or ["kafka"]), now=dt.datetime.now(dt.UTC),
                     days=args.days)
    for path in (files.ca_cert, files.server_pem):
        print(path)
    return 0


def read_secrets(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(kafka passwords, s3 secret keys) of the service principals from ``directory`` (none for
    the agents or the CLI: each node and user has its own logins)."""
    kafka, s3 = {}, {}
    for name in SHARED_LOGINS:
        kafka[name] = _read(directory / f"kafka-{name}-password")
        if PRINCIPALS[name].uses_s3:
            s3[name] = _read(directory / f"s3-{name}-secret-key")
    return kafka, s3


def _read(path: Path) -> str:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--secrets-dir: {path} cannot be read: {exc.strerror}") from None
    if not value:
        raise ConfigError(f"--secrets-dir: {path} is empty")
    return value


def _secure_init(args: argparse.Namespace) -> int:
    try:
        kafka, s3 = kafka_from_env(), s3_from_env()
        if kafka is None or s3 is None:
            raise ConfigError("secure-init needs HADAR_BOOTSTRAP (with the admin's HADAR_KAFKA_*) and "
                              "HADAR_S3_ENDPOINT (with the root's keys)")
        if kafka.security.username != ADMIN:
            raise ConfigError(f"HADAR_KAFKA_USERNAME: secure-init runs as {ADMIN!r}, got "
                              f"{kafka.security.username!r}")
        passwords, secrets = read_secrets(args.secrets_dir)
        asyncio.run(secure_kafka(kafka.bootstrap, kafka.security, passwords, partitions=args.partitions,
                                 replication_factor=args.replication_factor, login_wait_s=60.0))
        secure_minio(s3, secrets)
        identities = _identity_logins(kafka, s3)
    except HadarError as exc:
        print(f"hadar infra secure-init: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    print(f"secure-init: {len(passwords)} kafka users with ACLs, {len(secrets)} minio users, "
          f"{identities}", file=sys.stderr)
    return 0


def _identity_logins(kafka: KafkaSettings, root: S3Settings) -> str:
    key_file, registry_file = os.environ.get(KEY_ENV, "").strip(), os.environ.get(REGISTRY_ENV, "").strip()
    if not key_file or not registry_file:
        return f"no node or user logins ({KEY_ENV} and {REGISTRY_ENV} unset)"
    registry, master = Registry.read(registry_file), read_master_key(key_file)
    on_kafka = asyncio.run(secure_kafka_logins(kafka.bootstrap, kafka.security, registry, master,
                                               login_wait_s=60.0))
    on_store = secure_stores(root, registry, master)
    return f"{on_kafka.summary('node and user kafka')}, {on_store.summary('node and user store')}"
