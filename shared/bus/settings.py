"""Where the Kafka cluster is and how a client logs in to it: :class:`KafkaSettings`.

Settings come from the environment only (or are built by the caller from flags:
:mod:`shared.runtime.connection`); the password never appears in ``repr`` or logs.

* ``HADAR_BOOTSTRAP`` -- Kafka bootstrap servers, ``host:port[,host:port...]``.
* ``HADAR_KAFKA_SECURITY_PROTOCOL`` -- ``PLAINTEXT`` (default), ``SSL``, ``SASL_PLAINTEXT``
  or ``SASL_SSL``; ``HADAR_KAFKA_SASL_MECHANISM`` -- ``SCRAM-SHA-512`` (default),
  ``SCRAM-SHA-256`` or ``PLAIN``; ``HADAR_KAFKA_USERNAME`` / ``HADAR_KAFKA_PASSWORD`` (or
  ``*_FILE`` naming a docker secret); ``HADAR_KAFKA_CA_FILE`` (PEM CAs to trust; default:
  the system's), ``HADAR_KAFKA_CERT_FILE`` / ``HADAR_KAFKA_KEY_FILE`` (PEM client
  certificate and key, for brokers that ask for one).

``hadar infra up`` writes these lines for a development Kafka to an env file (owner-only)
and prints only the non-secret ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.errors import ConfigError
from shared.secrets import read_secret

__all__ = ["KafkaSettings", "KafkaSecurity", "kafka_from_env", "kafka_security_from_env",
           "SECURITY_PROTOCOLS", "SASL_MECHANISMS"]

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")


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
        username=read_secret(merged, "HADAR_KAFKA_USERNAME", "HADAR_KAFKA_USERNAME_FILE"),
        password=read_secret(merged, "HADAR_KAFKA_PASSWORD", "HADAR_KAFKA_PASSWORD_FILE"),
        ca_file=merged.get("HADAR_KAFKA_CA_FILE", "").strip(),
        cert_file=merged.get("HADAR_KAFKA_CERT_FILE", "").strip(),
        key_file=merged.get("HADAR_KAFKA_KEY_FILE", "").strip(),
    )


def _is_host_port(text: str) -> bool:
    host, sep, port = text.strip().rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
