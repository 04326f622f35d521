"""Secrets of a secured deployment and the per-principal env files that carry them.

:func:`load_or_create` keeps one state file (``secrets.json``, mode 0600) with a random
Kafka password per principal and a MinIO secret per principal that uses the store, so a
restarted broker or MinIO keeps the users it was set up with. :func:`env_lines` gives a
principal's ``HADAR_*`` lines (``set -a; . file`` loads them); :func:`write_env_files`
writes them to ``<dir>/<principal>.env`` (0600). Nothing here prints or logs a secret;
``repr`` of :class:`Secrets` shows none.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.security.files import read_json, write_private
from shared.security.principals import ADMIN, PRINCIPALS, s3_user

__all__ = ["Secrets", "load_or_create", "env_lines", "write_env_files", "MECHANISM"]

MECHANISM = "SCRAM-SHA-512"


@dataclass(frozen=True, kw_only=True)
class Secrets:
    """A password per principal (Kafka) and a secret key per store-using principal (MinIO)."""

    kafka: dict[str, str] = field(repr=False)
    s3: dict[str, str] = field(repr=False)

    def values(self) -> set[str]:
        """Every secret value (for tests that look for leaks)."""
        return {*self.kafka.values(), *self.s3.values()}


def load_or_create(path: Path, token: Callable[[int], str] = secrets.token_urlsafe) -> Secrets:
    """The secrets recorded in ``path``, or new ones written there (0600)."""
    recorded = read_json(path)
    if recorded is not None:
        # the str -> str maps this function wrote (read_json types values as object)
        return Secrets(kafka=dict(recorded["kafka"]), s3=dict(recorded["s3"]))  # type: ignore[call-overload]
    made = Secrets(kafka={name: token(24) for name in PRINCIPALS},
                   s3={name: token(30) for name, p in PRINCIPALS.items() if p.uses_s3})
    write_private(path, json.dumps({"kafka": made.kafka, "s3": made.s3}, indent=2) + "\n")
    return made


def env_lines(principal: str, found: Secrets, *, bootstrap: str, ca_file: Path, s3_endpoint: str,
              s3_root: tuple[str, str] | None = None, bucket: str = "") -> list[str]:
    """``HADAR_*`` lines for ``principal``: the broker, its Kafka login, and its S3 keys
    (the root's for admin, given as ``s3_root``). The agent gets neither login and the CLI no
    store login: each node's and user's own are in its credential (``HADAR_IDENTITY_FILE``)."""
    lines = [f"HADAR_BOOTSTRAP={bootstrap}", "HADAR_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
             f"HADAR_KAFKA_SASL_MECHANISM={MECHANISM}", f"HADAR_KAFKA_CA_FILE={ca_file}"]
    if principal == ADMIN or PRINCIPALS[principal].shared_login:   # nodes and users log in as themselves
        lines[3:3] = [f"HADAR_KAFKA_USERNAME={principal}", f"HADAR_KAFKA_PASSWORD={found.kafka[principal]}"]
    keys: tuple[str, str] | None = None
    if principal == ADMIN:
        keys = s3_root
    elif PRINCIPALS[principal].uses_s3:
        keys = (s3_user(PRINCIPALS[principal]), found.s3[principal])
    if keys is not None or (principal != ADMIN and PRINCIPALS[principal].store_per_identity):
        lines.append(f"HADAR_S3_ENDPOINT={s3_endpoint}")
        if keys is not None:
            lines += [f"HADAR_S3_ACCESS_KEY={keys[0]}", f"HADAR_S3_SECRET_KEY={keys[1]}"]
        if bucket:
            lines.append(f"HADAR_S3_BUCKET={bucket}")
    return lines


def write_env_files(directory: Path, found: Secrets, **where: Any) -> dict[str, Path]:
    """``<directory>/<principal>.env`` for every principal (0600); returns the paths."""
    written = {}
    for name in PRINCIPALS:
        path = directory / f"{name}.env"
        write_private(path, "\n".join(env_lines(name, found, **where)) + "\n")
        written[name] = path
    return written
