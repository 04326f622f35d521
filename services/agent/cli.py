"""``hadar serve agent``: flags and runner (wired by services/cli/serve.py).

Settings are an :class:`~services.agent.config.AgentConfig` loaded by
:func:`shared.runtime.config.load_config`: flags over the environment (``HADAR_NODE_ID``,
``HADAR_NODE_ADDRESS``, ``HADAR_AGENT_*``) over the ``--config`` TOML file over the
defaults. A bad value exits 2 with one line naming it. Where the object store is
(``--store-dir`` or S3) is a connection setting, as Kafka's is.

The Kafka and S3 logins are ``HADAR_KAFKA_USERNAME``/``HADAR_KAFKA_PASSWORD`` and
``HADAR_S3_ACCESS_KEY``/``HADAR_S3_SECRET_KEY`` when given (a development store's root,
say); otherwise the node's own logins from its credential (``HADAR_IDENTITY_FILE``: user
``hadar-node-<node>`` on both, which may act only as this node: its own consumer group, its
own checkpoints), as a secured cluster's agents have no other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from services.agent.daemon.discovery import (
    NodeDevices,
    cpu_devices,
    discover_in_subprocess,
    emulated_devices,
)
from services.agent.protocol import StoreTarget
from shared.errors import ConfigError, UsageError
from shared.runtime.config import add_config_arg, load_config
from shared.runtime.connection import add_store_args, make_bus, s3_settings
from shared.runtime.logging import configure_logging
from shared.runtime.service import run_service
from shared.security.authorship import with_authorship
from shared.security.identities import node_identity
from shared.security.own_logins import own_login_env

if TYPE_CHECKING:
    from services.agent.config import AgentConfig

__all__ = ["add_agent_parser", "run_agent", "agent_config", "DEFAULT_HTTP_PORT", "ENV_PREFIX"]

DEFAULT_HTTP_PORT = 8082
ENV_PREFIX = "HADAR_AGENT_"
# Flags whose field has the same name; AgentConfig holds their defaults.
_FIELDS = ("node_id", "address", "emulate", "emulate_reference", "cpu_devices", "heartbeat_s", "progress_s",
           "stop_timeout_s", "deadline_grace_s", "threads", "spare_workers", "cache_dir", "cache_bytes",
           "trainer_sandbox", "ledger_dir")


def add_agent_parser(services: argparse._SubParsersAction,
                     add_common: Callable[..., None]) -> argparse.ArgumentParser:
    parser = services.add_parser("agent", help="run a node agent: discover GPUs, train assigned job copies")
    add_common(parser, http_port=DEFAULT_HTTP_PORT)
    add_store_args(parser)
    parser.add_argument("--store-dir", default=None,
                        help="use a local directory as the object store instead of S3 (single machine)")
    add_config_arg(parser)
    # None means "not given", so that the environment and the file can set it.
    parser.add_argument("--node-id", default=None,
                        help="this node's id (letters, digits, '.', '_', '-'; default: $HADAR_NODE_ID)")
    parser.add_argument("--address", default=None,
                        help="host other agents reach this one at for DDP rendezvous "
                             "(default: $HADAR_NODE_ADDRESS, else the node id)")
    parser.add_argument("--emulate", default=None, metavar="TYPE:N[,TYPE:N...]",
                        help="stand in for GPUs of these catalog types on the CPU, throttled to their speed")
    parser.add_argument("--emulate-reference", default=None, metavar="TYPE",
                        help="type that runs at full CPU speed when emulating (default: fastest in the catalog)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="devices a machine without CUDA offers (type cpu; default 1)")
    parser.add_argument("--heartbeat-s", type=float, default=None, help="heartbeat period (default: 5)")
    parser.add_argument("--progress-s", type=float, default=None,
                        help="progress report period of a worker (default: 2)")
    parser.add_argument("--stop-timeout-s", type=float, default=None,
                        help="a preempted worker is killed this long after SIGTERM (default: 30)")
    parser.add_argument("--deadline-grace-s", type=float, default=None,
                        help="a worker still running this long after its round deadline is preempted (default: 30)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: 1)")
    parser.add_argument("--spare-workers", type=int, default=None, help="warm worker processes kept ready (default: 1)")
    parser.add_argument("--cache-dir", default=None,
                        help="where this node keeps users' code and data bundles "
                             "(default: ~/.cache/hadar/agent/<node>/bundles)")
    parser.add_argument("--cache-bytes", type=int, default=None,
                        help="the bundle cache's size; least recently used bundles go first (default: 20 GiB)")
    parser.add_argument("--trainer-sandbox", default=None, metavar="true|false",
                        help="run users' code in the Landlock/seccomp sandbox (default: true; false is insecure, "
                             "only for developing on a kernel without Landlock)")
    parser.add_argument("--ledger-dir", default=None,
                        help="where this node records the digests of the checkpoints it writes; keep it on a "
                             "disk that outlives a restart (default: ~/.cache/hadar/agent/<node>/written)")
    parser.set_defaults(func=run_agent)
    return parser


def agent_config(args: argparse.Namespace) -> AgentConfig:
    """The AgentConfig of these flags, the environment and ``--config``; UsageError if invalid."""
    from services.agent.config import AgentConfig

    flags = {name: getattr(args, name) for name in _FIELDS}
    return load_config(AgentConfig, flags=flags, env=os.environ, env_prefix=ENV_PREFIX, file=args.config)


def _store(args: argparse.Namespace, env: Mapping[str, str]) -> StoreTarget:
    if args.store_dir:
        return StoreTarget.local(Path(args.store_dir).resolve())
    return StoreTarget.remote(s3_settings(args, env))


async def _discover(config: AgentConfig) -> NodeDevices:
    devices = await discover_in_subprocess()
    if devices.kind == "cpu" and config.cpu_devices > 1:
        return cpu_devices(config.cpu_devices)
    return devices


def run_agent(args: argparse.Namespace) -> int:
    from services.agent.daemon.service import AgentDaemon  # heavy: only when run

    config = agent_config(args)
    try:
        env = own_login_env(os.environ)   # the node's own Kafka and store logins, from its credential
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    store = _store(args, env)
    emulated = emulated_devices(config.emulation, config.emulate_reference) if config.emulate else None
    bus = with_authorship(make_bus(args, source=f"agent/{config.node_id}", env=env), env)
    if bus.sealer is not None and bus.sealer.identity != node_identity(config.node_id):
        raise UsageError(f"HADAR_IDENTITY_FILE holds the credential of {bus.sealer.identity}, "
                         f"but this agent is node {config.node_id!r}")
    configure_logging("agent", level=args.log_level)
    drain_s = max(args.drain_timeout_s, config.stop_timeout_s + 15.0)

    async def run() -> int:
        devices = emulated or await _discover(config)
        if store.kind == "local":
            os.makedirs(store.root, exist_ok=True)
        await bus.start()
        try:
            daemon = AgentDaemon(config, bus=bus, store=store, devices=devices)
            code = await run_service(daemon, http_host=args.http_host, http_port=args.http_port,
                                     drain_timeout_s=drain_s, bus=bus)
        finally:
            await bus.stop()
        return code

    return asyncio.run(run())
