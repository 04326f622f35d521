"""The bus and the object store as the user running ``hadar``: with their own logins (Kafka
and MinIO user ``hadar-user-<name>``, which may submit and cancel jobs, read every topic
without a group, and write only ``users/<name>/``) from their credential
(``HADAR_IDENTITY_FILE``) when the environment names no other (:mod:`shared.security.own_logins`)."""

from __future__ import annotations

import argparse
import getpass
import os

from shared.bus import Bus
from shared.errors import ConfigError, UsageError
from shared.runtime.connection import make_bus, make_store
from shared.security.authorship import IDENTITY_ENV
from shared.security.identities import Credential
from shared.security.own_logins import own_login_env
from shared.store import ObjectStore

__all__ = ["user_store", "user_bus", "store_user"]


def user_store(args: argparse.Namespace) -> ObjectStore:
    return make_store(args, _env())


def user_bus(args: argparse.Namespace, *, source: str) -> Bus:
    return make_bus(args, source=source, env=_env())


def _env() -> dict[str, str]:
    try:
        return own_login_env(os.environ)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def store_user(named: str | None) -> str:
    """Whose ``users/<name>/`` prefix a command acts on: ``named`` (``--user``), else the user
    of the credential ``HADAR_IDENTITY_FILE`` names, else the login name."""
    if named:
        return named
    path = os.environ.get(IDENTITY_ENV, "").strip()
    if path:
        try:
            identity = Credential.read(path).identity
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if identity.startswith("user/"):
            return identity.removeprefix("user/")
    return getpass.getuser()
