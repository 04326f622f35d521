"""Apache Kafka for development and tests: one broker, or a cluster of three, each node a
combined KRaft broker+controller of a static quorum.

Jars and java: :mod:`devinfra.kafka_jars`; the config files: :mod:`devinfra.kafka_config`.
Every node binds 127.0.0.1 only, on free ports, with a small heap. Node 1 lives in
``run/kafka/``, nodes 2 and 3 of a cluster in ``run/kafka-2/`` and ``run/kafka-3/``; each
records its own ``state.json`` (with the quorum's voters), so each can be killed and
restarted alone. A node counts as ready when its port accepts and a Metadata request to it
lists that node: it has registered with the quorum and is not fenced.

A new cluster gets free ports and a new cluster id; a restarted node (:func:`restart_kafka`,
:func:`restart_kafka_nodes`) gets the recorded ones and its existing storage, so clients
find it where it was. ``secure=True`` (one broker only) starts it with a SASL_SSL listener,
SCRAM users and the StandardAuthorizer (:mod:`devinfra.broker_auth`); a restart keeps the
mode it was recorded with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from devinfra.broker_auth import BrokerSecurity, admin_security, prepare, scram_args, write_argfile
from devinfra.common import (
    Clock,
    InfraError,
    InfraPaths,
    free_ports,
    is_running,
    keep_previous,
    load_recorded,
    log_tail,
    port_accepts,
    port_released,
    remove_tree,
    spawn,
    stop_group,
    wait_for,
)
from devinfra.kafka_config import (
    EXTRA_PROPERTIES,
    LOG4J2_PROPERTIES,
    extra_properties,
    kafka_properties,
    new_cluster_id,
    replication_properties,
)
from devinfra.kafka_jars import DEFAULT_POM, fetch_kafka, find_java
from shared.bus.settings import KafkaSecurity
from shared.security.files import write_private

__all__ = [
    "KafkaServer", "KafkaCluster", "DEFAULT_POM", "find_java", "fetch_kafka", "start_kafka", "start_kafka_cluster",
    "restart_kafka", "restart_kafka_nodes", "kafka_properties", "EXTRA_PROPERTIES", "extra_properties",
    "load_kafka", "load_kafka_cluster", "kafka_node_names", "node_name", "kafka_healthy", "new_cluster_id",
]

NAME = "kafka"
JVM_HEAP = ("-Xms256m", "-Xmx512m")
# Three JVMs share the machine: each starts small but may grow as far as a lone broker, since a
# 256 MiB ceiling ran out of heap in LogManager's start-up on a loaded CI machine (heap is only
# committed as used, so three brokers rarely hold more than a lone one).
CLUSTER_JVM_HEAP = ("-Xms128m", "-Xmx512m")
READY_TIMEOUT_S = 120.0


def node_name(node_id: int) -> str:
    """The server name (and run directory) of node ``node_id``: ``kafka``, ``kafka-2``, ..."""
    return NAME if node_id == 1 else f"{NAME}-{node_id}"


@dataclass(frozen=True, kw_only=True)
class KafkaServer:
    """A running (or recorded) development broker: one node of its cluster.

    ``voters`` is the quorum (``controller.quorum.voters``) of a cluster; empty for a lone
    broker, which votes for itself.
    """

    pid: int
    port: int
    controller_port: int
    run_dir: str
    cluster_id: str
    secure: bool = False
    node_id: int = 1
    voters: str = ""

    @property
    def name(self) -> str:
        return node_name(self.node_id)

    @property
    def cluster_size(self) -> int:
        return len(self.voters.split(",")) if self.voters else 1

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return Path(self.run_dir) / "kafka.log"

    @property
    def marker(self) -> str:
        """A string only this server's command line contains (its config file path)."""
        return str(Path(self.run_dir) / "server.properties")


@dataclass(frozen=True, kw_only=True)
class KafkaCluster:
    """Every broker of a development cluster, node 1 first (one broker or three)."""

    brokers: tuple[KafkaServer, ...]

    @property
    def bootstrap(self) -> str:
        """Every broker's address, comma-separated, as ``HADAR_BOOTSTRAP`` takes them."""
        return ",".join(broker.bootstrap for broker in self.brokers)

    @property
    def secure(self) -> bool:
        return self.brokers[0].secure


def load_kafka(paths: InfraPaths, name: str = NAME) -> KafkaServer | None:
    """The recorded broker ``name`` of this run directory, whether or not it still runs."""
    return load_recorded(paths.state_file(name), KafkaServer)


def load_kafka_cluster(paths: InfraPaths) -> tuple[KafkaServer, ...]:
    """Every recorded broker of this run directory, node 1 first; empty when none is."""
    first = load_kafka(paths)
    if first is None:
        return ()
    nodes = [first]
    for node_id in range(2, first.cluster_size + 1):
        node = load_kafka(paths, node_name(node_id))
        if node is None:
            raise InfraError(f"kafka: {paths.run} records node 1 of {first.cluster_size} brokers but not "
                             f"{node_name(node_id)}; `hadar infra down` deletes them")
        nodes.append(node)
    return tuple(nodes)


def kafka_node_names(paths: InfraPaths) -> list[str]:
    """The names of every broker directory in this run directory (``kafka`` always first),
    recorded or left over, for ``down`` to stop and remove."""
    others = sorted((p.name for p in paths.run.glob(f"{NAME}-[0-9]*") if p.is_dir()),
                    key=lambda name: int(name.rpartition("-")[2]))
    return [NAME, *others]


def kafka_healthy(server: KafkaServer, timeout: float = 5.0) -> bool:
    """Whether the broker's port accepts and a Metadata request to it lists this broker
    (as the admin, for a secured broker)."""
    security = admin_security(Path(server.run_dir).parent) if server.secure else None
    return port_accepts(server.port) and _metadata_lists_node(server.bootstrap, server.node_id, timeout, security)


def start_kafka(paths: InfraPaths, lib: Path, java: str, *, clock: Clock = time.monotonic,
                attempts: int = 3, secure: bool = False) -> KafkaServer:
    """Format fresh storage and start a new single broker; see :func:`start_kafka_cluster`."""
    return start_kafka_cluster(paths, lib, java, brokers=1, clock=clock, attempts=attempts, secure=secure).brokers[0]


def start_kafka_cluster(paths: InfraPaths, lib: Path, java: str, *, brokers: int, clock: Clock = time.monotonic,
                        attempts: int = 3, secure: bool = False) -> KafkaCluster:
    """Format fresh storage and start ``brokers`` new nodes (1 or 3); return once every one
    is ready (states recorded).

    Retries with new ports when one was taken between choosing it and binding it. Refuses
    (and touches nothing) when a node's directory holds broker data that no state file
    describes: data is only ever deleted by ``down``. A start that fails removes what it
    created, so the next ``up`` starts afresh again.
    """
    replication_properties(brokers)  # refuses an unsupported count in one line
    if secure and brokers != 1:
        raise InfraError("kafka: a secured broker runs alone; `hadar infra up --secure` takes no --brokers")
    for node_id in range(1, brokers + 1):
        data_dir = paths.server_dir(node_name(node_id)) / "data"
        if data_dir.is_dir() and any(data_dir.iterdir()):
            raise InfraError(f"kafka: {data_dir} holds data but no usable state.json records its port and "
                             "cluster id; `hadar infra down` deletes it")
    for attempt in range(1, attempts + 1):
        try:
            return _start_fresh(paths, lib, java, brokers=brokers, clock=clock, secure=secure)
        except InfraError as exc:
            if attempt == attempts or "Address already in use" not in str(exc):
                raise
    raise AssertionError("unreachable")


def restart_kafka(paths: InfraPaths, lib: Path, java: str, recorded: KafkaServer, *,
                  clock: Clock = time.monotonic) -> KafkaServer:
    """Start the recorded broker again; see :func:`restart_kafka_nodes`. A node of a cluster
    becomes ready only while a majority of the quorum runs (its peers, or ``up``)."""
    return restart_kafka_nodes(paths, lib, java, [recorded], clock=clock)[0]


def restart_kafka_nodes(paths: InfraPaths, lib: Path, java: str, recorded: Sequence[KafkaServer], *,
                        clock: Clock = time.monotonic) -> tuple[KafkaServer, ...]:
    """Start the recorded brokers again, together: the same data directories, ports and
    cluster id, so clients reconnect to the addresses they had and find every record stored.

    The recorded processes must be gone (stop them first). Never formats storage that
    exists and never picks another port: a port another process took is an error. On
    failure the data and the state files are kept for the next try.
    """
    for server in recorded:
        if is_running(server.pid, server.marker):
            raise InfraError(f"{server.name}: still running (pid {server.pid}); stop it before restarting")
        for port in (server.port, server.controller_port):
            if not port_released(port):
                raise InfraError(f"{server.name}: port {port} is taken by another process; free it and run "
                                 f"`hadar infra restart {server.name}` (`hadar infra down` deletes the data instead)")
    return _launch(paths, lib, java, recorded, clock=clock)


def _start_fresh(paths: InfraPaths, lib: Path, java: str, *, brokers: int, clock: Clock,
                 secure: bool) -> KafkaCluster:
    names = [node_name(node_id) for node_id in range(1, brokers + 1)]
    for name in names:
        remove_tree(paths.server_dir(name))
    ports = free_ports(2 * brokers)
    client_ports, controller_ports = ports[:brokers], ports[brokers:]
    voters = "" if brokers == 1 else ",".join(f"{i}@127.0.0.1:{port}" for i, port in enumerate(controller_ports, 1))
    cluster_id = new_cluster_id()
    planned = [KafkaServer(pid=0, port=port, controller_port=controller_port, run_dir=str(paths.server_dir(name)),
                           cluster_id=cluster_id, secure=secure, node_id=node_id, voters=voters)
               for node_id, (name, port, controller_port)
               in enumerate(zip(names, client_ports, controller_ports), 1)]
    try:
        return KafkaCluster(brokers=_launch(paths, lib, java, planned, clock=clock))
    except InfraError:
        # Nothing of value was stored yet; keep the logs, forget the rest.
        for server in planned:
            paths.state_file(server.name).unlink(missing_ok=True)
            remove_tree(Path(server.run_dir) / "data")
        raise


def _launch(paths: InfraPaths, lib: Path, java: str, servers: Sequence[KafkaServer], *,
            clock: Clock) -> tuple[KafkaServer, ...]:
    """Configure, format where no storage is, and start every node of ``servers`` before
    waiting for any: a node of a cluster is ready only once a majority of the quorum runs."""
    security = prepare(paths.run) if servers[0].secure else None
    extra = extra_properties(paths.run)
    heap = JVM_HEAP if servers[0].cluster_size == 1 else CLUSTER_JVM_HEAP
    jvms = {server.name: _configure(server, java, lib, heap, security, extra) for server in servers}
    unformatted = [s for s in servers if not (Path(s.run_dir) / "data" / "meta.properties").exists()]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(unformatted))) as pool:
        formats = [pool.submit(_format, jvms[s.name], s, extra=scram_args(security) if security else [])
                   for s in unformatted]
        for done in formats:
            done.result()
    started: list[KafkaServer] = []
    try:
        for server in servers:
            keep_previous(server.log)
            pid = spawn([*jvms[server.name], "kafka.Kafka", server.marker], log=server.log, cwd=Path(server.run_dir))
            started.append(replace(server, pid=pid))
            write_private(paths.state_file(server.name), json.dumps(asdict(started[-1]), indent=2) + "\n")
        for server in started:
            wait_for(functools.partial(_ready_or_bind_failure, server), what=server.name, timeout=READY_TIMEOUT_S,
                     alive=functools.partial(is_running, server.pid, server.marker), log=server.log, clock=clock,
                     interval=0.25, pid=server.pid)
    except InfraError:
        for server in started:
            stop_group(server.pid, server.marker)
        raise
    return tuple(started)


def _configure(server: KafkaServer, java: str, lib: Path, heap: tuple[str, ...], security: BrokerSecurity | None,
               extra: dict[str, str]) -> list[str]:
    """Write the node's config files; return the JVM command line that runs Kafka's classes."""
    run_dir = Path(server.run_dir)
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    write_private(Path(server.marker), kafka_properties(
        port=server.port, controller_port=server.controller_port, data_dir=data_dir, node_id=server.node_id,
        voters=server.voters, security=security, extra=extra))
    log4j = run_dir / "log4j2.properties"
    log4j.write_text(LOG4J2_PROPERTIES)
    return [java, *heap, "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile=file:{log4j}", f"-Dkafka.logs.dir={run_dir}", "-cp", f"{lib}/*"]


def _format(jvm: list[str], server: KafkaServer, *, extra: list[str]) -> None:
    config = Path(server.marker)
    format_log = config.with_name("format.log")
    # The tool's arguments go in a Java @argfile: SCRAM passwords must not be on a command line.
    argfile = write_argfile(config.with_name(".format.args"),
                            ["kafka.tools.StorageTool", "format", "-t", server.cluster_id, "-c", str(config), *extra])
    try:
        with open(format_log, "wb") as out:
            formatted = subprocess.run(
                [*jvm, f"@{argfile}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=180,
            )
    except subprocess.TimeoutExpired:
        raise InfraError(f"{server.name} storage format timed out after 180s (log: {format_log})",
                         retriable=True) from None
    finally:
        argfile.unlink(missing_ok=True)
    if formatted.returncode != 0:
        raise InfraError(f"{server.name} storage format failed: {log_tail(format_log)} (log: {format_log})")


def _ready_or_bind_failure(server: KafkaServer) -> bool:
    # A broker whose port was taken after free_ports() chose it may hang instead of exiting.
    if "Address already in use" in server.log.read_text(errors="replace"):
        raise InfraError(f"{server.name}: Address already in use (log: {server.log})", retriable=True)
    return kafka_healthy(server, timeout=3.0)


def _metadata_lists_node(bootstrap: str, node_id: int, timeout: float, security: KafkaSecurity | None = None) -> bool:
    # aiokafka is async; run it on a private loop in a worker thread so this works whether
    # or not the caller is inside an event loop.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            request = _metadata_request(bootstrap, node_id, timeout_s=timeout, security=security)
            return pool.submit(asyncio.run, request).result(timeout + 5)
        except Exception:
            return False


async def _metadata_request(bootstrap: str, node_id: int, *, timeout_s: float,
                            security: KafkaSecurity | None) -> bool:
    from aiokafka.client import AIOKafkaClient

    from shared.bus.kafka_login import security_options

    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a broker still starting refuses; that is expected here
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                            **(security_options(security) if security is not None else {}))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return any(broker.nodeId == node_id for broker in client.cluster.brokers())
    finally:
        await client.close()
        quiet.setLevel(level)
