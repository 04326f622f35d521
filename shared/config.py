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
* ``HADAR_KAFKA_SECURITY_PROTOCOL`` -- ``PLAINTEXT`` (default), ``SSL``, ``SASL_PLAINTEXT``
  or ``SASL_SSL``; ``HADAR_KAFKA_SASL_MECHANISM`` -- ``SCRAM-SHA-512`` (default),
  ``SCRAM-SHA-256`` or ``PLAIN``; ``HADAR_KAFKA_USERNAME`` / ``HADAR_KAFKA_PASSWORD`` (or
  ``*_FILE`` naming a docker secret); ``HADAR_KAFKA_CA_FILE`` (PEM CAs to trust; default:
  the system's), ``HADAR_KAFKA_CERT_FILE`` / ``HADAR_KAFKA_KEY_FILE`` (PEM client
  certificate and key, for brokers that ask for one).

``hadar infra up`` writes these lines for a development Kafka and MinIO to an env file
(owner-only) and prints only the non-secret ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from shared.errors import UsageError

__all__ = [
    "KafkaSettings", "KafkaSecurity", "S3Settings", "ConfigError", "kafka_from_env", "kafka_security_from_env",
    "s3_from_env", "SECURITY_PROTOCOLS", "SASL_MECHANISMS",
]

DEFAULT_BUCKET = "hadar"
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")


class ConfigError(UsageError):
    """A setting that is present but unusable; the message names the variable."""


@dataclass(frozen=True, kw_only=True)
class KafkaSecurity:
    """How a client authenticates to Kafka and which certificates it trusts.

    Guarantees: a SASL protocol has a username and a password; a TLS protocol's files are
    named only with TLS; a client key comes with a client certificate. Each error is one
    line naming the environment variable (``HADAR_KAFKA_...``) that sets the value. The
    password is not in repr.
    """

    protocol: str = "PLAINTEXT"
    mechanism: str = "SCRAM-SHA-512"
    username: str = ""
    password: str = field(default="", repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in SECURITY_PROTOCOLS:
            raise ConfigError(f"HADAR_KAFKA_SECURITY_PROTOCOL: expected one of {', '.join(SECURITY_PROTOCOLS)}, "
                              f"got {self.protocol!r}")
        if self.mechanism not in SASL_MECHANISMS:
            raise ConfigError(f"HADAR_KAFKA_SASL_MECHANISM: expected one of {', '.join(SASL_MECHANISMS)}, "
                              f"got {self.mechanism!r}")
        if self.sasl:
            if not self.username:
                raise ConfigError(f"HADAR_KAFKA_USERNAME: required with security protocol {self.protocol}")
            if not self.password:
                raise ConfigError(f"HADAR_KAFKA_PASSWORD: required with security protocol {self.protocol} "
                                  "(or HADAR_KAFKA_PASSWORD_FILE naming a file that holds it)")
        if not self.tls:
            for name, value in (("CA_FILE", self.ca_file), ("CERT_FILE", self.cert_file),
                                ("KEY_FILE", self.key_file)):
                if value:
                    raise ConfigError(f"HADAR_KAFKA_{name}: only used with SSL or SASL_SSL, "
                                      f"but the security protocol is {self.protocol}")
        if self.key_file and not self.cert_file:
            raise ConfigError("HADAR_KAFKA_KEY_FILE: given without HADAR_KAFKA_CERT_FILE")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol.endswith("SSL")

    def describe(self) -> str:
        """A one-line, secret-free description: ``SASL_SSL as scheduler (SCRAM-SHA-512)``."""
        if self.sasl:
            return f"{self.protocol} as {self.username} ({self.mechanism})"
        return self.protocol


@dataclass(frozen=True, kw_only=True)
class KafkaSettings:
    """Where the Kafka cluster is, how to authenticate, and how many partitions new topics get."""

    bootstrap: str
    partitions: int = 3
    security: KafkaSecurity = field(default_factory=KafkaSecurity)

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
    """Kafka settings from ``HADAR_BOOTSTRAP`` and ``HADAR_KAFKA_*``; ``None`` when the
    bootstrap is unset or empty."""
    bootstrap = env.get("HADAR_BOOTSTRAP", "").strip()
    if not bootstrap:
        return None
    return KafkaSettings(bootstrap=bootstrap, security=kafka_security_from_env(env))


def kafka_security_from_env(env: Mapping[str, str] = os.environ,
                            overrides: Mapping[str, str | None] | None = None) -> KafkaSecurity:
    """:class:`KafkaSecurity` from ``HADAR_KAFKA_*`` (module docstring).

    ``overrides`` maps a variable name (``HADAR_KAFKA_USERNAME``, ...,
    ``HADAR_KAFKA_PASSWORD_FILE``) to a flag's value, which wins over the environment;
    ``None`` means the flag was not given. A ``*_FILE`` given by a flag wins over the
    plain variable from the environment.
    """
    merged = {k: v for k, v in env.items() if k.startswith("HADAR_KAFKA_")}
    for name, value in (overrides or {}).items():
        if value is not None and value != "":
            merged[name] = value
            if name.endswith("_FILE") and name.removesuffix("_FILE") in ("HADAR_KAFKA_USERNAME",
                                                                           "HADAR_KAFKA_PASSWORD"):
                merged.pop(name.removesuffix("_FILE"), None)
    return KafkaSecurity(
        protocol=merged.get("HADAR_KAFKA_SECURITY_PROTOCOL", "").strip().upper() or "PLAINTEXT",
        mechanism=merged.get("HADAR_KAFKA_SASL_MECHANISM", "").strip().upper() or "SCRAM-SHA-512",
        username=_secret(merged, "HADAR_KAFKA_USERNAME", "HADAR_KAFKA_USERNAME_FILE"),
        password=_secret(merged, "HADAR_KAFKA_PASSWORD", "HADAR_KAFKA_PASSWORD_FILE"),
        ca_file=merged.get("HADAR_KAFKA_CA_FILE", "").strip(),
        cert_file=merged.get("HADAR_KAFKA_CERT_FILE", "").strip(),
        key_file=merged.get("HADAR_KAFKA_KEY_FILE", "").strip(),
    )


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
