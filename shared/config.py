"""Typed settings for the two real parts every service talks to: Kafka and S3.

Settings come from the environment only (or are built by the caller from flags); secrets
are never read from code or files checked in, and never appear in ``repr`` or logs.

Environment variables:

* ``HADAR_BOOTSTRAP`` -- Kafka bootstrap servers, ``host:port[,host:port...]``.
* ``HADAR_S3_ENDPOINT`` -- S3 endpoint URL, ``http://host:port`` or ``https://host:port``.
* ``HADAR_S3_ACCESS_KEY`` / ``HADAR_S3_SECRET_KEY`` -- S3 credentials; or
  ``HADAR_S3_ACCESS_KEY_FILE`` / ``HADAR_S3_SECRET_KEY_FILE`` naming files that hold them
  (docker secrets).
* ``HADAR_S3_BUCKET`` -- bucket (default ``hadar``).

``hadar infra up`` prints exactly these lines for a development Kafka and MinIO.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from shared.errors import UsageError

__all__ = ["KafkaSettings", "S3Settings", "ConfigError", "kafka_from_env", "s3_from_env"]

DEFAULT_BUCKET = "hadar"


class ConfigError(UsageError):
    """A setting that is present but unusable; the message names the variable."""


@dataclass(frozen=True, kw_only=True)
class KafkaSettings:
    """Where the Kafka cluster is, and how many partitions new topics get."""

    bootstrap: str
    partitions: int = 3

    def __post_init__(self) -> None:
        if not self.bootstrap or any(not _is_host_port(part) for part in self.bootstrap.split(",")):
            raise ConfigError(f"kafka bootstrap must be host:port[,host:port...], got {self.bootstrap!r}")
        if self.partitions < 1:
            raise ConfigError(f"kafka partitions must be >= 1, got {self.partitions}")


@dataclass(frozen=True, kw_only=True)
class S3Settings:
    """An S3 endpoint URL, its credentials and the bucket to use. The secret is not in repr."""

    endpoint: str
    access_key: str
    secret_key: str = field(repr=False)
    bucket: str = DEFAULT_BUCKET

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ConfigError(f"s3 endpoint must be http(s)://host[:port], got {self.endpoint!r}")
        if not self.access_key or not self.secret_key:
            raise ConfigError("s3 access key and secret key must not be empty")
        if not self.bucket:
            raise ConfigError("s3 bucket must not be empty")

    @property
    def host_port(self) -> str:
        """``host:port`` of the endpoint, as the minio SDK wants it."""
        return urlsplit(self.endpoint).netloc

    @property
    def secure(self) -> bool:
        """Whether the endpoint uses TLS."""
        return urlsplit(self.endpoint).scheme == "https"


def kafka_from_env(env: Mapping[str, str] = os.environ) -> KafkaSettings | None:
    """Kafka settings from ``HADAR_BOOTSTRAP``; ``None`` when it is unset or empty."""
    bootstrap = env.get("HADAR_BOOTSTRAP", "").strip()
    if not bootstrap:
        return None
    return KafkaSettings(bootstrap=bootstrap)


def s3_from_env(env: Mapping[str, str] = os.environ) -> S3Settings | None:
    """S3 settings from ``HADAR_S3_*``; ``None`` when the endpoint is unset or empty.

    Raises :class:`ConfigError` when the endpoint is set but a credential is missing.
    """
    endpoint = env.get("HADAR_S3_ENDPOINT", "").strip()
    if not endpoint:
        return None
    access_key = _secret(env, "HADAR_S3_ACCESS_KEY", "HADAR_S3_ACCESS_KEY_FILE")
    secret_key = _secret(env, "HADAR_S3_SECRET_KEY", "HADAR_S3_SECRET_KEY_FILE")
    missing = [name for name, value in (("HADAR_S3_ACCESS_KEY", access_key),
                                        ("HADAR_S3_SECRET_KEY", secret_key)) if not value]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"HADAR_S3_ENDPOINT is set but {' and '.join(missing)} {verb} not")
    return S3Settings(
        endpoint=endpoint,
        access_key=access_key,
        secret_key=secret_key,
        bucket=env.get("HADAR_S3_BUCKET", "").strip() or DEFAULT_BUCKET,
    )


def _secret(env: Mapping[str, str], name: str, file_name: str) -> str:
    """``env[name]``, or else the content of the file ``env[file_name]`` (docker secrets)."""
    if env.get(name):
        return env[name]
    path = env.get(file_name, "")
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{file_name}={path!r} cannot be read: {exc.strerror}") from None


def _is_host_port(text: str) -> bool:
    host, sep, port = text.strip().rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
