"""``hadar infra up|restart|status|down``: the development Kafka and MinIO on 127.0.0.1.

``up`` prints shell-ready ``HADAR_*=...`` lines on stdout without secret values (those are
named by ``*_FILE`` paths; ``--env-file`` gets the full lines, owner-only); progress and
timings go to stderr. ``up --secure`` starts Kafka with SASL_SSL, SCRAM users and ACLs and
MinIO with a user per service, and writes ``$HADAR_RUN_DIR/credentials/<principal>.env``
(see :mod:`devinfra.secure_mode`); ``secure-init`` applies the same to a running stack. A
server that crashed (or was stopped with ``down --keep-data``) comes back from ``up`` or
``restart NAME`` with its data, port and credentials, so the ``HADAR_*`` settings stay valid
and running services reconnect. ``up --brokers 3`` starts a three-broker Kafka cluster
(every topic replicated three times, ``min.insync.replicas=2``) and ``HADAR_BOOTSTRAP`` lists
all three; ``up --drives 4`` starts MinIO over four drives (one erasure set). ``status``
shows each broker and exits 0 only when every server is up and answering, and names the
command that brings a crashed one back. ``down`` stops them all and deletes their data
unless ``--keep-data``; running it twice is fine. Failures print one line and exit 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devinfra import InfraError, InfraPaths, down, restart, status, up, write_env_file
from devinfra.kafka import node_name
from devinfra.kafka_config import SUPPORTED_BROKERS
from devinfra.minio import MAX_DRIVES
from devinfra.secure_mode import apply, credentials_dir, public_lines
from services.cli.secure_init import register_secure_init
from shared.errors import HadarError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "infra", help="start, check or stop the development Kafka and MinIO",
        description="Development Kafka (KRaft, from Maven Central) and MinIO (built with go "
                    "install), cached under $HADAR_CACHE (default ~/.cache/hadar); state and data "
                    "under $HADAR_RUN_DIR (default $HADAR_CACHE/run).",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    start = actions.add_parser("up", help="fetch/build if needed, start, print HADAR_* settings")
    start.add_argument("--env-file", type=Path,
                       help="also write the HADAR_* lines, secrets included, to this file (mode 0600)")
    start.add_argument("--secure", action="store_true",
                       help="Kafka with SASL_SSL, SCRAM users and ACLs; MinIO with a user per service; "
                            "credentials in $HADAR_RUN_DIR/credentials/<principal>.env")
    start.add_argument("--brokers", type=int, choices=SUPPORTED_BROKERS, default=None,
                       help="Kafka brokers: 1 (default for a new one), or 3 (KRaft quorum of three; every topic "
                            "replicated 3 times, min.insync.replicas=2); without it, what is recorded")
    start.add_argument("--drives", type=_drives, default=None, metavar="N",
                       help="MinIO drives: 1 (default for a new one), or 4 to 16 as one erasure set (4: objects "
                            "survive the loss of one drive for writes, two for reads); without it, what is recorded")
    start.set_defaults(func=_up)
    again = actions.add_parser(
        "restart", help="restart one server with its data, port and credentials",
        description="Stop the server if it runs, then start it again with the same data directory, "
                    "port and cluster id (Kafka) or credentials (MinIO), so running services reconnect.")
    again.add_argument("server", type=_server_name, metavar="{kafka,kafka-2,kafka-3,minio}",
                       help="a server; kafka-2 and kafka-3 are the other brokers of a cluster")
    again.set_defaults(func=_restart)
    actions.add_parser("status", help="say whether each server is up").set_defaults(func=_status)
    register_secure_init(actions)
    stop = actions.add_parser(
        "down", help="stop both servers and DELETE their data (unless --keep-data)",
        description="Stop both servers and delete their run directories: every topic, record, bucket "
                    "and object. With --keep-data they are only stopped; `up` or `restart` brings "
                    "them back as they were.")
    stop.add_argument("--keep-data", action="store_true",
                      help="stop only; keep data, ports and credentials for `up`/`restart`")
    stop.set_defaults(func=_down)


def _up(args: argparse.Namespace) -> int:
    paths = InfraPaths.from_env()
    try:
        servers = up(paths, report=_progress, secure=args.secure, brokers=args.brokers, drives=args.drives)
        if args.secure:
            written = apply(paths, servers)
            _progress(f"infra up: users, ACLs and policies applied; credentials in {credentials_dir(paths)}")
            if args.env_file is not None:
                write_env_file_secure(args.env_file, written["cli"])
        elif args.env_file is not None:
            write_env_file(args.env_file, servers)
        lines = public_lines(paths, servers)
    except HadarError as exc:
        return _fail(exc)
    for line in lines:
        print(line)
    return 0


def write_env_file_secure(path: Path, source: Path) -> None:
    """The CLI principal's env file, copied owner-only to ``path``."""
    from shared.security.files import write_private
    write_private(path, source.read_text())


def _restart(args: argparse.Namespace) -> int:
    try:
        restart(InfraPaths.from_env(), args.server, report=_progress)
    except InfraError as exc:
        return _fail(exc)
    return 0


def _status(args: argparse.Namespace) -> int:
    try:
        found = status(InfraPaths.from_env())
    except InfraError as exc:   # a cluster whose records are incomplete
        return _fail(exc)
    for entry in found:
        print(entry.line())
    return 0 if all(entry.state == "up" for entry in found) else 1


def _down(args: argparse.Namespace) -> int:
    try:
        messages = down(InfraPaths.from_env(), keep_data=args.keep_data)
    except InfraError as exc:
        return _fail(exc)
    for message in messages:
        print(message, file=sys.stderr)
    return 0


def _drives(text: str) -> int:
    drives = int(text) if text.isdigit() else 0
    if drives != 1 and not 4 <= drives <= MAX_DRIVES:
        raise argparse.ArgumentTypeError(f"expected 1, or 4 to {MAX_DRIVES} (one erasure set), got {text!r}")
    return drives


def _server_name(text: str) -> str:
    if text not in ("kafka", "minio", *(node_name(i) for i in range(2, max(SUPPORTED_BROKERS) + 1))):
        raise argparse.ArgumentTypeError(f"expected kafka, kafka-2, kafka-3 or minio, got {text!r}")
    return text


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fail(exc: HadarError) -> int:
    print(f"hadar infra: error: {exc}", file=sys.stderr)
    return 1
