"""``hadar serve agent``: flags and runner (wired by services/cli/serve.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.agent.discovery import NodeDevices, cpu_devices, discover_in_subprocess, emulated_devices
from services.agent.emulation import parse_emulation
from services.agent.spec import StoreTarget
from shared.connect import add_store_args, make_bus, s3_settings
from shared.errors import UsageError
from shared.events import NODE_ID_RE
from shared.gpus import emulation_reference
from shared.logging import configure_logging
from shared.service import run_service

if TYPE_CHECKING:
    from services.agent.daemon import AgentConfig

__all__ = ["add_agent_parser", "run_agent", "DEFAULT_HTTP_PORT"]

DEFAULT_HTTP_PORT = 8082


def add_agent_parser(services: argparse._SubParsersAction,
                     add_common: Callable[..., None]) -> argparse.ArgumentParser:
    parser = services.add_parser("agent", help="run a node agent: discover GPUs, train assigned job copies")
    add_common(parser, http_port=DEFAULT_HTTP_PORT)
    add_store_args(parser)
    parser.add_argument("--store-dir", default=None,
                        help="use a local directory as the object store instead of S3 (single machine)")
    node_id = os.environ.get("HADAR_NODE_ID") or None
    parser.add_argument("--node-id", default=node_id, required=node_id is None,
                        help="this node's id (letters, digits, '.', '_', '-'; default: $HADAR_NODE_ID)")
    parser.add_argument("--address", default=os.environ.get("HADAR_NODE_ADDRESS", ""),
                        help="host other agents reach this one at for DDP rendezvous "
                             "(default: $HADAR_NODE_ADDRESS, else the node id)")
    parser.add_argument("--emulate", default=None, metavar="TYPE:N[,TYPE:N...]",
                        help="stand in for GPUs of these catalog types on the CPU, throttled to their speed")
    parser.add_argument("--emulate-reference", default=None, metavar="TYPE",
                        help="type that runs at full CPU speed when emulating (default: fastest in the catalog)")
    parser.add_argument("--cpu-devices", type=int, default=1,
                        help="devices a machine without CUDA offers (type cpu; default 1)")
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="heartbeat period")
    parser.add_argument("--progress-s", type=float, default=2.0, help="progress report period of a worker")
    parser.add_argument("--stop-timeout-s", type=float, default=30.0,
                        help="a preempted worker is killed this long after SIGTERM")
    parser.add_argument("--deadline-grace-s", type=float, default=30.0,
                        help="a worker still running this long after its round deadline is preempted")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--spare-workers", type=int, default=1, help="warm worker processes kept ready")
    parser.set_defaults(func=run_agent)
    return parser


def _config(args: argparse.Namespace) -> AgentConfig:
    from services.agent.daemon import AgentConfig

    if not NODE_ID_RE.match(args.node_id):
        raise UsageError(f"--node-id: {args.node_id!r} must be 1-63 letters, digits, '.', '_', '-'")
    if min(args.heartbeat_s, args.progress_s, args.stop_timeout_s) <= 0 or args.deadline_grace_s < 0:
        raise UsageError("--heartbeat-s, --progress-s and --stop-timeout-s must be > 0, --deadline-grace-s >= 0")
    if args.threads < 1 or args.spare_workers < 0 or args.cpu_devices < 1:
        raise UsageError("--threads and --cpu-devices must be >= 1, --spare-workers >= 0")
    return AgentConfig(node_id=args.node_id, address=args.address, heartbeat_s=args.heartbeat_s,
                       progress_s=args.progress_s, stop_timeout_s=args.stop_timeout_s,
                       deadline_grace_s=args.deadline_grace_s, threads=args.threads,
                       spare_workers=args.spare_workers)


def _store(args: argparse.Namespace) -> StoreTarget:
    if args.store_dir:
        return StoreTarget.local(Path(args.store_dir).resolve())
    return StoreTarget.remote(s3_settings(args))


def _emulation(args: argparse.Namespace) -> NodeDevices | None:
    if not args.emulate:
        return None
    try:
        spec = parse_emulation(args.emulate)
        emulation_reference(args.emulate_reference)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return emulated_devices(spec, args.emulate_reference)


async def _discover(args: argparse.Namespace) -> NodeDevices:
    devices = await discover_in_subprocess()
    if devices.kind == "cpu" and args.cpu_devices > 1:
        return cpu_devices(args.cpu_devices)
    return devices


def run_agent(args: argparse.Namespace) -> int:
    from services.agent.daemon import AgentDaemon  # heavy: only when run

    config = _config(args)
    store = _store(args)
    emulated = _emulation(args)
    bus = make_bus(args, source=f"agent/{config.node_id}")
    configure_logging("agent", level=args.log_level)
    drain_s = max(args.drain_timeout_s, config.stop_timeout_s + 15.0)

    async def run() -> None:
        devices = emulated or await _discover(args)
        if store.kind == "local":
            os.makedirs(store.root, exist_ok=True)
        await bus.start()
        try:
            daemon = AgentDaemon(config, bus=bus, store=store, devices=devices)
            await run_service(daemon, http_host=args.http_host, http_port=args.http_port, drain_timeout_s=drain_s)
        finally:
            await bus.stop()

    asyncio.run(run())
    return 0

