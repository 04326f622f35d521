"""``hadar infra up --secure``'s last step, and what ``up`` prints in either mode.

:func:`apply` runs :mod:`shared.security.provision` as the admin and the MinIO root on the
development servers and writes ``<run>/credentials/<principal>.env`` (0600: ``HADAR_*``
lines, ``set -a; . file`` loads them) plus one file per secret value
(``<principal>.kafka-password``, ``<principal>.s3-secret-key``, 0600) that ``*_FILE``
variables can name. The trusted services' and the admin's files also name the authorship
master key and identity registry (:func:`authorship_files`): secured development checks
who wrote each node's records, so an agent needs its node's credential
(``hadar identity enrol node N ...``, ``HADAR_IDENTITY_FILE``).

:func:`public_lines` is what ``up`` prints on stdout: shell-ready lines without any secret
value -- the secrets are named by ``*_FILE`` paths -- so ``eval "$(hadar infra up)"`` works
and nothing secret reaches a terminal, a CI log or a shell history. Plain mode prints the
MinIO root's keys as files; secured mode prints the broker's and the store's settings and the
local user's credential (``HADAR_IDENTITY_FILE``: their own Kafka and store logins).
"""

from __future__ import annotations

import asyncio
import getpass
from pathlib import Path

from devinfra.broker_auth import admin_security, prepare
from devinfra.common import InfraPaths
from devinfra.stack import DevServers
from shared.security.authorship import IDENTITY_ENV, KEY_ENV, VERIFYING_PRINCIPALS
from shared.security.credentials import MECHANISM, write_env_files
from shared.security.files import write_private
from shared.security.identities import (
    REGISTRY_ENV,
    Credential,
    Registry,
    enrol,
    new_master_key,
    read_master_key,
    user_identity,
)
from shared.security.logins import secure_kafka_logins, secure_stores
from shared.security.principals import ADMIN, PRINCIPALS
from shared.security.provision import secure_kafka, secure_minio
from shared.store.settings import S3Settings
from shared.wire.records import USER_RE

__all__ = ["apply", "authorship_files", "credentials_dir", "public_lines", "CLI_PRINCIPAL"]

CLI_PRINCIPAL = "cli"


def credentials_dir(paths: InfraPaths) -> Path:
    """``<run>/credentials``, created owner-only (0700)."""
    directory = paths.run / "credentials"
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    return directory


def apply(paths: InfraPaths, servers: DevServers) -> dict[str, Path]:
    """Set the secured servers up (idempotent) and write every principal's credential files."""
    broker = prepare(paths.run)
    root = S3Settings(endpoint=servers.minio.endpoint, access_key=servers.minio.access_key,
                      secret_key=servers.minio.secret_key)
    asyncio.run(secure_kafka(servers.kafka.bootstrap, admin_security(paths.run), broker.secrets.kafka))
    secure_minio(root, broker.secrets.s3)
    key, registry = authorship_files(paths)   # enrolled nodes' and users' own logins, after a restart too
    local_user_identity(paths)
    enrolled, master = Registry.read(registry), read_master_key(key)
    asyncio.run(secure_kafka_logins(servers.kafka.bootstrap, admin_security(paths.run), enrolled, master))
    secure_stores(root, enrolled, master)
    directory = credentials_dir(paths)
    for name, password in broker.secrets.kafka.items():
        if name == ADMIN or (name in PRINCIPALS and PRINCIPALS[name].shared_login):
            write_private(directory / f"{name}.kafka-password", password + "\n")
    for name, secret in broker.secrets.s3.items():
        if name in PRINCIPALS and PRINCIPALS[name].uses_s3:
            write_private(directory / f"{name}.s3-secret-key", secret + "\n")
    write_private(directory / f"{ADMIN}.s3-secret-key", servers.minio.secret_key + "\n")
    written = write_env_files(directory, broker.secrets, bootstrap=servers.kafka.bootstrap, ca_file=broker.ca_file,
                              s3_endpoint=servers.minio.endpoint,
                              s3_root=(servers.minio.access_key, servers.minio.secret_key))
    for name in (*VERIFYING_PRINCIPALS, ADMIN):
        with open(written[name], "a") as env:
            env.write(f"{KEY_ENV}={key}\n{REGISTRY_ENV}={registry}\n")
    with open(written["agent"], "a") as env:   # agents check users' seals (a cancellation), never a node's
        env.write(f"{REGISTRY_ENV}={registry}\n")
    with open(written[CLI_PRINCIPAL], "a") as env:
        env.write(f"{IDENTITY_ENV}={local_user_identity(paths)}\n")
    return written


def local_user_identity(paths: InfraPaths) -> Path:
    """The credential of the user running the development servers (``user/<login name>``,
    or ``user/dev`` if that is not a valid user name), enrolled once: a secured development
    cluster refuses a submission no user signed, so ``hadar submit`` needs one."""
    directory = credentials_dir(paths)
    path = directory / "user.identity"
    if not path.exists() or not Credential.read(path).kafka_password:   # one from before users had own logins
        try:
            login = getpass.getuser()
        except (OSError, KeyError):   # no login name in the environment nor the password database
            login = ""
        identity = user_identity(login if USER_RE.fullmatch(login) else "dev")
        key, registry = authorship_files(paths)
        credential = enrol(identity, master=read_master_key(key), registry_path=registry)
        write_private(path, credential.to_text())
    return path


def authorship_files(paths: InfraPaths) -> tuple[Path, Path]:
    """The master key and the identity registry of the development servers (made once,
    0600): the trusted services verify with them, ``hadar identity enrol`` issues node
    credentials from them. An agent gets only its node's credential (``HADAR_IDENTITY_FILE``)."""
    directory = credentials_dir(paths)
    key, registry = directory / "authorship-master-key", directory / "identities.json"
    if not key.exists():
        write_private(key, new_master_key().hex() + "\n")
    if not registry.exists():
        write_private(registry, Registry().to_text())
    return key, registry


def public_lines(paths: InfraPaths, servers: DevServers) -> list[str]:
    """Secret-free ``HADAR_*`` lines for stdout (see the module doc); writes the key files
    plain mode names."""
    directory = credentials_dir(paths)
    if not servers.secure:
        write_private(directory / "s3-access-key", servers.minio.access_key + "\n")
        write_private(directory / "s3-secret-key", servers.minio.secret_key + "\n")
        return [f"HADAR_BOOTSTRAP={servers.kafka.bootstrap}", f"HADAR_S3_ENDPOINT={servers.minio.endpoint}",
                f"HADAR_S3_ACCESS_KEY_FILE={directory / 's3-access-key'}",
                f"HADAR_S3_SECRET_KEY_FILE={directory / 's3-secret-key'}"]
    # the Kafka and store logins are the user's own, in their credential
    return [f"HADAR_BOOTSTRAP={servers.kafka.bootstrap}", "HADAR_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
            f"HADAR_KAFKA_SASL_MECHANISM={MECHANISM}", f"HADAR_KAFKA_CA_FILE={prepare(paths.run).ca_file}",
            f"HADAR_S3_ENDPOINT={servers.minio.endpoint}", f"{IDENTITY_ENV}={local_user_identity(paths)}",
            f"# every principal's settings: {directory}/<principal>.env (set -a; . FILE)"]
