"""Connection flags every command and service shares: where Kafka and the object store are.

Settings come from flags or the environment (``HADAR_BOOTSTRAP``, ``HADAR_KAFKA_*``,
``HADAR_S3_ENDPOINT``, ``HADAR_S3_BUCKET``, ``HADAR_S3_ACCESS_KEY``, ``HADAR_S3_SECRET_KEY``,
see :mod:`shared.bus.settings` and :mod:`shared.store.settings`); a flag wins over its
variable. Secret values are read from the environment or from files (``*_FILE``,
``--kafka-password-file``: docker secrets), never from a flag's value (a command line is
visible to every local user), and never printed.

Guarantees: a missing or malformed setting raises :class:`~shared.errors.UsageError` with
one line naming the flag and the variable, before any connection is attempted.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from shared.bus import Bus, KafkaBus
from shared.bus.settings import (
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    KafkaSettings,
    kafka_security_from_env,
)
from shared.errors import UsageError
from shared.store import MinioStore, ObjectStore
from shared.store.settings import S3Settings, s3_from_env

__all__ = ["add_bus_args", "add_store_args", "kafka_settings", "s3_settings", "make_bus", "make_store"]


def add_bus_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", default=None,
                        help="Kafka bootstrap HOST:PORT[,HOST:PORT...], any of the brokers "
                             "(default: $HADAR_BOOTSTRAP)")
    group = parser.add_argument_group("Kafka security (default: $HADAR_KAFKA_*)")
    group.add_argument("--kafka-security-protocol", choices=SECURITY_PROTOCOLS, default=None,
                       help="PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL")
    group.add_argument("--kafka-sasl-mechanism", choices=SASL_MECHANISMS, default=None,
                       help="SASL mechanism (default SCRAM-SHA-512)")
    group.add_argument("--kafka-username", default=None, help="SASL username")
    group.add_argument("--kafka-password-file", default=None, metavar="FILE",
                       help="file holding the SASL password (else $HADAR_KAFKA_PASSWORD[_FILE])")
    group.add_argument("--kafka-ca-file", default=None, metavar="PEM", help="CA certificates to trust")
    group.add_argument("--kafka-cert-file", default=None, metavar="PEM", help="client certificate")
    group.add_argument("--kafka-key-file", default=None, metavar="PEM", help="client private key")


def add_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: $HADAR_S3_ENDPOINT)")
    parser.add_argument("--s3-bucket", default=None, help="bucket (default: $HADAR_S3_BUCKET or 'hadar')")


def kafka_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> KafkaSettings:
    """The Kafka settings of ``args`` over ``env`` (default: the process environment)."""
    env = os.environ if env is None else env
    bootstrap = getattr(args, "bootstrap", None) or env.get("HADAR_BOOTSTRAP", "")
    if not bootstrap:
        raise UsageError("no Kafka broker: pass --bootstrap HOST:PORT or set HADAR_BOOTSTRAP")
    security = kafka_security_from_env(env, {
        "HADAR_KAFKA_SECURITY_PROTOCOL": getattr(args, "kafka_security_protocol", None),
        "HADAR_KAFKA_SASL_MECHANISM": getattr(args, "kafka_sasl_mechanism", None),
        "HADAR_KAFKA_USERNAME": getattr(args, "kafka_username", None),
        "HADAR_KAFKA_PASSWORD_FILE": getattr(args, "kafka_password_file", None),
        "HADAR_KAFKA_CA_FILE": getattr(args, "kafka_ca_file", None),
        "HADAR_KAFKA_CERT_FILE": getattr(args, "kafka_cert_file", None),
        "HADAR_KAFKA_KEY_FILE": getattr(args, "kafka_key_file", None),
    })
    return KafkaSettings(bootstrap=bootstrap, security=security)


def s3_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> S3Settings:
    """The store settings of ``args`` over ``env`` (default: the process environment)."""
    env = dict(os.environ if env is None else env)
    if getattr(args, "s3_endpoint", None):
        env["HADAR_S3_ENDPOINT"] = args.s3_endpoint
    if getattr(args, "s3_bucket", None):
        env["HADAR_S3_BUCKET"] = args.s3_bucket
    settings = s3_from_env(env)   # a ConfigError is a UsageError: one line, exit 2
    if settings is None:
        raise UsageError("no object store: pass --s3-endpoint URL or set HADAR_S3_ENDPOINT "
                         "(credentials from HADAR_S3_ACCESS_KEY / HADAR_S3_SECRET_KEY)")
    return settings


def make_bus(args: argparse.Namespace, *, source: str, env: Mapping[str, str] | None = None) -> Bus:
    return KafkaBus.from_settings(kafka_settings(args, env), source=source)


def make_store(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ObjectStore:
    return MinioStore(s3_settings(args, env))
