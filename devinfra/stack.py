"""Bring the development Kafka and MinIO up, report on them, and take them down.

One run directory holds at most one Kafka (one broker, or a cluster of three: ``up(brokers=3)``)
and one MinIO (one drive, or an erasure set: ``up(drives=4)``). ``up`` reuses a server that
is running and answering, restarts one whose process is gone (crashed, or stopped by ``down
--keep-data``) with its recorded data directory, ports and cluster id or credentials,
starts a new one only where none is recorded, and refuses (with a one-line error) one
that runs but does not answer, or a run directory that holds another size than asked for.
``restart`` does what ``up`` does after a crash for one server (one broker of a cluster),
stopping it first if it runs. So a server comes back where its clients expect it, with
everything it had stored. Only ``down`` deletes data (and not with ``keep_data``).
Anything ``up`` started is stopped again (its data kept) if a later step of the same
``up`` fails.
``down`` is idempotent. Calls on one run directory are serialised with a file lock, so
two ``up``s never race. ``up(secure=True)`` starts (or finds) a secured broker and applies
:mod:`devinfra.secure_mode`; a run directory holds one mode, ``down`` first to switch.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from devinfra.common import (
    InfraError,
    InfraPaths,
    file_lock,
    is_running,
    remove_tree,
    stop_group,
    stop_groups,
)
from devinfra.kafka import (
    KafkaCluster,
    KafkaServer,
    fetch_kafka,
    find_java,
    kafka_healthy,
    kafka_node_names,
    load_kafka,
    load_kafka_cluster,
    restart_kafka,
    restart_kafka_nodes,
    start_kafka_cluster,
)
from devinfra.minio import (
    MinioServer,
    build_minio,
    load_minio,
    minio_healthy,
    restart_minio,
    start_minio,
)
from shared.bus.settings import KafkaSettings
from shared.security.files import write_private
from shared.store.settings import S3Settings

__all__ = [
    "DevServers", "ServerStatus", "Report", "up", "restart", "status", "down", "ensure_kafka",
    "ensure_kafka_cluster", "ensure_minio", "stop_server", "env_lines", "write_env_file",
]

Report = Callable[[str], None]
MINIO = "minio"


@dataclass(frozen=True, kw_only=True)
class DevServers:
    """Both development servers, running and answering."""

    kafka: KafkaCluster
    minio: MinioServer

    @property
    def secure(self) -> bool:
        return self.kafka.secure

    @property
    def kafka_settings(self) -> KafkaSettings:
        """PLAINTEXT settings of a plain broker; a secured one's are in its credential files."""
        return KafkaSettings(bootstrap=self.kafka.bootstrap)

    @property
    def s3_settings(self) -> S3Settings:
        return S3Settings(endpoint=self.minio.endpoint, access_key=self.minio.access_key,
                          secret_key=self.minio.secret_key)


@dataclass(frozen=True, kw_only=True)
class ServerStatus:
    """What ``status`` found for one server (``kafka``, ``kafka-2``, ``kafka-3``, ``minio``).

    ``state``: up; down (nothing recorded); crashed (recorded, process gone: its data is
    kept); stopped (by ``down --keep-data``); not-answering (runs, health check fails).
    """

    name: str
    state: Literal["up", "down", "crashed", "stopped", "not-answering"]
    address: str = ""
    pid: int = 0
    detail: str = ""

    def line(self) -> str:
        back = f"`hadar infra restart {self.name}` brings it back at {self.address}"
        if self.state == "up":
            return f"{self.name}: up at {self.address} (pid {self.pid}{', ' + self.detail if self.detail else ''})"
        if self.state == "not-answering":
            return (f"{self.name}: running (pid {self.pid}) but not answering at {self.address}; "
                    f"`hadar infra restart {self.name}` restarts it with its data")
        if self.state == "crashed":
            return f"{self.name}: crashed (pid {self.pid} is gone, its data is kept); {back} with its data"
        if self.state == "stopped":
            return f"{self.name}: stopped, its data kept; {back} (so does `hadar infra up`)"
        return f"{self.name}: down"


def env_lines(servers: DevServers) -> list[str]:
    """The shell-ready ``NAME=value`` lines that point Hadar at plain ``servers`` (with the
    S3 secret: for owner-only files, not for stdout -- see :func:`devinfra.secure_mode.public_lines`)."""
    return [
        f"HADAR_BOOTSTRAP={servers.kafka.bootstrap}",
        f"HADAR_S3_ENDPOINT={servers.minio.endpoint}",
        f"HADAR_S3_ACCESS_KEY={servers.minio.access_key}",
        f"HADAR_S3_SECRET_KEY={servers.minio.secret_key}",
    ]


def write_env_file(path: Path, servers: DevServers) -> None:
    """Write :func:`env_lines` to ``path`` (owner-only: it holds the S3 secret)."""
    write_private(path, "\n".join(env_lines(servers)) + "\n")


def up(paths: InfraPaths, *, report: Report = lambda _: None, secure: bool = False, brokers: int | None = None,
       drives: int | None = None) -> DevServers:
    """Ensure both servers run and answer: reuse what runs, restart what is recorded but
    gone (same data, ports, credentials), and start anew only what is not recorded.
    Fetches and builds whatever is missing first, and reports how long each phase took.
    ``secure``: the broker is (or becomes) the secured one; see the module doc.
    ``brokers``/``drives``: the size of a new Kafka cluster / MinIO erasure set (default 1);
    a recorded one of another size is refused (``down`` first), and without them what is
    recorded is brought up as it was."""
    with file_lock(paths.run / ".lock"):
        recorded = load_kafka(paths)
        if recorded is not None and recorded.secure != secure:
            mode = "secured" if recorded.secure else "plain"
            raise InfraError(f"kafka: {paths.run} holds a {mode} broker; `hadar infra down` before "
                             f"`hadar infra up{' --secure' if secure else ''}`")
        _check_sizes(paths, brokers=brokers, drives=drives)
        began = time.monotonic()
        kafka, minio = _running_kafka(paths, report), _running_minio(paths, report)
        if kafka is not None and minio is not None:
            report("infra up: already running")
            return DevServers(kafka=kafka, minio=minio)
        kafka_needs = None if kafka is not None else (find_java(), fetch_kafka(paths, report=report))
        minio_binary = None if minio is not None else build_minio(paths, report=report)
        prepared = time.monotonic()
        if kafka_needs is not None:
            kafka = _start_kafka(paths, *kafka_needs, report, brokers=brokers or 1, secure=secure)
        try:
            if minio_binary is not None:
                minio = _start_minio(paths, minio_binary, report, drives=drives or 1)
        except BaseException:
            if kafka_needs is not None:
                _stop_kafka(paths, keep_data=True)
            raise
        assert kafka is not None and minio is not None
        done = time.monotonic()
        report(f"infra up: ready in {done - began:.1f}s "
               f"(fetch/build {prepared - began:.1f}s, start {done - prepared:.1f}s)")
        return DevServers(kafka=kafka, minio=minio)


def ensure_kafka(paths: InfraPaths, *, report: Report = lambda _: None) -> tuple[KafkaServer, bool]:
    """The running single broker of ``paths``, (re)started as ``up`` would; the flag says whether it was."""
    cluster, started = ensure_kafka_cluster(paths, brokers=1, report=report)
    return cluster.brokers[0], started


def ensure_kafka_cluster(paths: InfraPaths, *, brokers: int,
                         report: Report = lambda _: None) -> tuple[KafkaCluster, bool]:
    """The running Kafka of ``paths`` with ``brokers`` brokers, (re)started as ``up`` would;
    the flag says whether it was."""
    with file_lock(paths.run / ".lock"):
        _check_sizes(paths, brokers=brokers)
        cluster = _running_kafka(paths, report)
        if cluster is not None:
            return cluster, False
        java, lib = find_java(), fetch_kafka(paths, report=report)
        return _start_kafka(paths, java, lib, report, brokers=brokers), True


def ensure_minio(paths: InfraPaths, *, drives: int = 1,
                 report: Report = lambda _: None) -> tuple[MinioServer, bool]:
    """The running MinIO of ``paths`` over ``drives`` drives, (re)started as ``up`` would;
    the flag says whether it was."""
    with file_lock(paths.run / ".lock"):
        _check_sizes(paths, drives=drives)
        server = _running_minio(paths, report)
        if server is not None:
            return server, False
        return _start_minio(paths, build_minio(paths, report=report), report, drives=drives), True


def restart(paths: InfraPaths, name: str, *, report: Report = lambda _: None) -> str:
    """Stop the recorded server ``name`` (``minio``, ``kafka``, or ``kafka-2``/``kafka-3`` of
    a cluster) if it runs, then start it again with the same data directory, port(s) and
    cluster id or credentials; returns its address.

    Raises :class:`InfraError` when nothing is recorded (``up`` starts one) or the recorded
    port is now taken by another process (the data is kept either way).
    """
    with file_lock(paths.run / ".lock"):
        recorded = load_minio(paths) if name == MINIO else load_kafka(paths, name)
        if recorded is None:
            raise InfraError(f"{name}: nothing to restart in {paths.run}; `hadar infra up` starts one")
        if is_running(recorded.pid, recorded.marker):
            report(f"{name}: stopping pid {recorded.pid}")
            stop_group(recorded.pid, recorded.marker)
        began = time.monotonic()
        if isinstance(recorded, KafkaServer):
            server = restart_kafka(paths, fetch_kafka(paths, report=report), find_java(), recorded)
            report(f"{name}: restarted at {server.bootstrap} with its data in {time.monotonic() - began:.1f}s")
            return server.bootstrap
        return _start_minio(paths, build_minio(paths, report=report), report, drives=recorded.drives).endpoint


def status(paths: InfraPaths) -> list[ServerStatus]:
    """One status per server (per broker of a cluster), checked live (process and health endpoint)."""
    found: list[ServerStatus] = []
    brokers = load_kafka_cluster(paths)
    if not brokers:
        found.append(ServerStatus(name="kafka", state="down"))
    for broker in brokers:
        detail = f"node {broker.node_id} of {broker.cluster_size}" if broker.cluster_size > 1 else ""
        found.append(_status(broker.name, broker.pid, broker.marker, broker.bootstrap,
                             functools.partial(kafka_healthy, broker), detail=detail))
    minio = load_minio(paths)
    if minio is None:
        found.append(ServerStatus(name=MINIO, state="down"))
    else:
        found.append(_status(MINIO, minio.pid, minio.marker, minio.endpoint, lambda: minio_healthy(minio),
                             detail=f"{minio.drives} drives" if minio.drives > 1 else ""))
    return found


def down(paths: InfraPaths, *, keep_data: bool = False) -> list[str]:
    """Stop both servers (every broker, their whole process groups). Removes their run
    directories -- every topic, record, bucket and object -- unless ``keep_data``, in which
    case ``up`` or ``restart`` brings them back as they were."""
    with file_lock(paths.run / ".lock"):
        said = [*_stop_kafka(paths, keep_data=keep_data), _stop(paths, MINIO, keep_data=keep_data)]
        if not keep_data:   # a secured setup's secrets and every credential file go with the data
            remove_tree(paths.run / "secure")
            remove_tree(paths.run / "credentials")
        return said


def stop_server(paths: InfraPaths, name: Literal["kafka", "minio"]) -> str:
    """Stop one server (every broker of a Kafka cluster) and remove its run directory (its
    data too); says what it did."""
    with file_lock(paths.run / ".lock"):
        if name == MINIO:
            return _stop(paths, MINIO, keep_data=False)
        return "; ".join(_stop_kafka(paths, keep_data=False))


def _check_sizes(paths: InfraPaths, *, brokers: int | None = None, drives: int | None = None) -> None:
    kafka = load_kafka(paths)
    if brokers is not None and kafka is not None and kafka.cluster_size != brokers:
        raise InfraError(f"kafka: {paths.run} holds {kafka.cluster_size} broker(s), not {brokers}; "
                         f"`hadar infra down` before `hadar infra up --brokers {brokers}`")
    minio = load_minio(paths)
    if drives is not None and minio is not None and minio.drives != drives:
        raise InfraError(f"minio: {paths.run} holds {minio.drives} drive(s), not {drives}; "
                         f"`hadar infra down` before `hadar infra up --drives {drives}`")


def _running_kafka(paths: InfraPaths, report: Report) -> KafkaCluster | None:
    brokers = load_kafka_cluster(paths)
    reusable = [_reusable(b.name, b.pid, b.marker, b.bootstrap, functools.partial(kafka_healthy, b), report)
                for b in brokers]
    return KafkaCluster(brokers=brokers) if brokers and all(reusable) else None


def _running_minio(paths: InfraPaths, report: Report) -> MinioServer | None:
    server = load_minio(paths)
    if server is not None and _reusable("minio", server.pid, server.marker, server.endpoint,
                                        lambda: minio_healthy(server), report):
        return server
    return None


def _start_kafka(paths: InfraPaths, java: str, lib: Path, report: Report, *, brokers: int,
                 secure: bool = False) -> KafkaCluster:
    """Restart the recorded brokers whose processes are gone, together (a node of a cluster
    is ready only once a majority runs); else start a new cluster of ``brokers``."""
    began = time.monotonic()
    recorded = load_kafka_cluster(paths)
    if recorded:
        gone = [b for b in recorded if not is_running(b.pid, b.marker)]
        restarted = {b.name: b for b in restart_kafka_nodes(paths, lib, java, gone)}
        cluster = KafkaCluster(brokers=tuple(restarted.get(b.name, b) for b in recorded))
        for broker in restarted.values():
            report(f"{broker.name}: restarted at {broker.bootstrap} with its data in {time.monotonic() - began:.1f}s")
    else:
        cluster = start_kafka_cluster(paths, lib, java, brokers=brokers, secure=secure)
        report(f"kafka: started {brokers} broker(s) at {cluster.bootstrap} in {time.monotonic() - began:.1f}s"
               if brokers > 1 else f"kafka: started at {cluster.bootstrap} in {time.monotonic() - began:.1f}s")
    return cluster


def _start_minio(paths: InfraPaths, binary: Path, report: Report, *, drives: int) -> MinioServer:
    """Restart the recorded MinIO if there is one (its process must be gone), else start anew."""
    began = time.monotonic()
    recorded = load_minio(paths)
    if recorded is not None:
        server = restart_minio(paths, binary, recorded)
        report(f"minio: restarted at {server.endpoint} with its data in {time.monotonic() - began:.1f}s")
    else:
        server = start_minio(paths, binary, drives=drives)
        on = f" over {drives} drives" if drives > 1 else ""
        report(f"minio: started at {server.endpoint}{on} in {time.monotonic() - began:.1f}s")
    return server


def _reusable(name: str, pid: int, marker: str, address: str, healthy: Callable[[], bool],
              report: Report) -> bool:
    if not is_running(pid, marker):
        if pid > 0:
            report(f"{name}: the recorded process {pid} is gone; restarting it with its data at {address}")
        return False
    if healthy():
        report(f"{name}: already running at {address} (pid {pid})")
        return True
    raise InfraError(f"{name} runs (pid {pid}) but does not answer at {address}; "
                     f"`hadar infra restart {name}` restarts it with its data")


def _status(name: str, pid: int, marker: str, address: str, healthy: Callable[[], bool], *,
            detail: str = "") -> ServerStatus:
    if pid <= 0:
        return ServerStatus(name=name, state="stopped", address=address, pid=pid)
    if not is_running(pid, marker):
        return ServerStatus(name=name, state="crashed", address=address, pid=pid)
    state: Literal["up", "not-answering"] = "up" if healthy() else "not-answering"
    return ServerStatus(name=name, state=state, address=address, pid=pid, detail=detail)


def _stop_kafka(paths: InfraPaths, *, keep_data: bool) -> list[str]:
    """:func:`_stop` for every broker directory, their processes signalled together: a node
    stopped alone after its peers would wait for a quorum that is gone."""
    names = kafka_node_names(paths)
    recorded = [server for server in (load_kafka(paths, name) for name in names) if server is not None]
    running = {server.name for server in recorded if is_running(server.pid, server.marker)}
    stop_groups([(server.pid, server.marker) for server in recorded])
    return [_stop(paths, name, keep_data=keep_data, was_running=name in running) for name in names]


def _stop(paths: InfraPaths, name: str, *, keep_data: bool, was_running: bool | None = None) -> str:
    server = load_minio(paths) if name == MINIO else load_kafka(paths, name)
    server_dir = paths.server_dir(name)
    if server is None:
        if keep_data:
            return f"{name}: not running"
        existed = server_dir.exists()
        remove_tree(server_dir)
        return f"{name}: not running" + (" (removed leftover files)" if existed else "")
    if was_running is None:
        was_running = is_running(server.pid, server.marker)
        stop_group(server.pid, server.marker)
    if keep_data:
        # pid 0 records "stopped on purpose": status tells it from a crash.
        write_private(paths.state_file(name), json.dumps({**asdict(server), "pid": 0}, indent=2) + "\n")
        return f"{name}: stopped (pid {server.pid}), data kept" if was_running else f"{name}: not running, data kept"
    remove_tree(server_dir)
    return f"{name}: stopped (pid {server.pid})" if was_running else f"{name}: not running (cleaned up)"
