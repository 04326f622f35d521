"""Connection flags every command and service shares: where Kafka and the object store are.

Settings come from flags or the environment (``HADAR_BOOTSTRAP``, ``HADAR_S3_ENDPOINT``,
``HADAR_S3_BUCKET``, ``HADAR_S3_ACCESS_KEY``, ``HADAR_S3_SECRET_KEY``); a flag wins over
its variable. Secret values are read from the environment only and never printed.

Guarantees: a missing or malformed setting raises :class:`~shared.errors.UsageError` with
one line naming the flag and the variable, before any connection is attempted.
"""

from __future__ import annotations

import argparse
import os

from shared.bus import Bus, KafkaBus
from shared.config import KafkaSettings, S3Settings, s3_from_env
from shared.errors import UsageError
from shared.store import MinioStore, ObjectStore

__all__ = ["add_bus_args", "add_store_args", "kafka_settings", "s3_settings", "make_bus", "make_store"]


def add_bus_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", default=None,
                        help="Kafka bootstrap host:port (default: $HADAR_BOOTSTRAP)")


def add_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: $HADAR_S3_ENDPOINT)")
    parser.add_argument("--s3-bucket", default=None, help="bucket (default: $HADAR_S3_BUCKET or 'hadar')")


def kafka_settings(args: argparse.Namespace) -> KafkaSettings:
    bootstrap = getattr(args, "bootstrap", None) or os.environ.get("HADAR_BOOTSTRAP", "")
    if not bootstrap:
        raise UsageError("no Kafka broker: pass --bootstrap HOST:PORT or set HADAR_BOOTSTRAP")
    return KafkaSettings(bootstrap=bootstrap)


def s3_settings(args: argparse.Namespace) -> S3Settings:
    env = dict(os.environ)
    if getattr(args, "s3_endpoint", None):
        env["HADAR_S3_ENDPOINT"] = args.s3_endpoint
    if getattr(args, "s3_bucket", None):
        env["HADAR_S3_BUCKET"] = args.s3_bucket
    settings = s3_from_env(env)   # a ConfigError is a UsageError: one line, exit 2
    if settings is None:
        raise UsageError("no object store: pass --s3-endpoint URL or set HADAR_S3_ENDPOINT "
                         "(credentials from HADAR_S3_ACCESS_KEY / HADAR_S3_SECRET_KEY)")
    return settings


def make_bus(args: argparse.Namespace, *, source: str) -> Bus:
    return KafkaBus.from_settings(kafka_settings(args), source=source)


def make_store(args: argparse.Namespace) -> ObjectStore:
    return MinioStore(s3_settings(args))
