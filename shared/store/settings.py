"""Where the object store is and its credentials: :class:`S3Settings`.

Environment variables: ``HADAR_S3_ENDPOINT`` (``http://host:port`` or ``https://host:port``),
``HADAR_S3_ACCESS_KEY`` / ``HADAR_S3_SECRET_KEY`` (or ``HADAR_S3_ACCESS_KEY_FILE`` /
``HADAR_S3_SECRET_KEY_FILE`` naming files that hold them: docker secrets) and
``HADAR_S3_BUCKET`` (default ``hadar``). The secret never appears in ``repr`` or logs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shared.errors import ConfigError
from shared.secrets import read_secret

__all__ = ["S3Settings", "s3_from_env", "DEFAULT_BUCKET"]

DEFAULT_BUCKET = "hadar"


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


def s3_from_env(env: Mapping[str, str] = os.environ) -> S3Settings | None:
    """S3 settings from ``HADAR_S3_*``; ``None`` when the endpoint is unset or empty.

    Raises :class:`ConfigError` when the endpoint is set but a credential is missing.
    """
    endpoint = env.get("HADAR_S3_ENDPOINT", "").strip()
    if not endpoint:
        return None
    access_key = read_secret(env, "HADAR_S3_ACCESS_KEY", "HADAR_S3_ACCESS_KEY_FILE")
    secret_key = read_secret(env, "HADAR_S3_SECRET_KEY", "HADAR_S3_SECRET_KEY_FILE")
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
