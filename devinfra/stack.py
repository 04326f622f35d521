"""Bring the development Kafka and MinIO up, report on them, and take them down.

One run directory holds at most one of each. ``up`` reuses a server that is running and
answering, restarts one whose process is gone (crashed, or stopped by ``down
--keep-data``) with its recorded data directory, ports and cluster id or credentials,
starts a new one only where none is recorded, and refuses (with a one-line error) one
that runs but does not answer. ``restart`` does what ``up`` does after a crash for one
server, stopping it first if it runs. So a server comes back where its clients expect it,
with everything it had stored. Only ``down`` deletes data (and not with ``keep_data``).
Anything ``up`` started is stopped again (its data kept) if a later step of the same
``up`` fails.
``down`` is idempotent. Calls on one run directory are serialised with a file lock, so
two ``up``s never race. ``up(secure=True)`` starts (or finds) a secured broker and applies
:mod:`devinfra.secure_mode`; a run directory holds one mode, ``down`` first to switch.
"""

from __future__ import annotations

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
)
from devinfra.kafka import (
    KafkaServer,
    fetch_kafka,
    find_java,
    kafka_healthy,
    load_kafka,
    restart_kafka,
    start_kafka,
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
    "ensure_minio", "stop_server", "env_lines", "write_env_file",
]

Report = Callable[[str], None]
ServerName = Literal["kafka", "minio"]
SERVERS: tuple[ServerName, ...] = ("kafka", "minio")


@dataclass(frozen=True, kw_only=True)
class DevServers:
    """Both development servers, running and answering."""

    kafka: KafkaServer
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
    """What ``status`` found for one server.

    ``state``: up; down (nothing recorded); crashed (recorded, process gone: its data is
    kept); stopped (by ``down --keep-data``); not-answering (runs, health check fails).
    """

    name: ServerName
    state: Literal["up", "down", "crashed", "stopped", "not-answering"]
    address: str = ""
    pid: int = 0

    def line(self) -> str:
        back = f"`hadar infra restart {self.name}` brings it back at {self.address}"
        if self.state == "up":
            return f"{self.name}: up at {self.address} (pid {self.pid})"
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


def up(paths: InfraPaths, *, report: Report = lambda _: None, secure: bool = False) -> DevServers:
    """Ensure both servers run and answer: reuse what runs, restart what is recorded but
    gone (same data, ports, credentials), and start anew only what is not recorded.
    Fetches and builds whatever is missing first, and reports how long each phase took.
    ``secure``: the broker is (or becomes) the secured one; see the module doc."""
    with file_lock(paths.run / ".lock"):
        recorded = load_kafka(paths)
        if recorded is not None and recorded.secure != secure:
            mode = "secured" if recorded.secure else "plain"
            raise InfraError(f"kafka: {paths.run} holds a {mode} broker; `hadar infra down` before "
                             f"`hadar infra up{' --secure' if secure else ''}`")
        began = time.monotonic()
        kafka, minio = _running_kafka(paths, report), _running_minio(paths, report)
        if kafka is not None and minio is not None:
            report("infra up: already running")
            return DevServers(kafka=kafka, minio=minio)
        kafka_needs = None if kafka is not None else (find_java(), fetch_kafka(paths, report=report))
        minio_binary = None if minio is not None else build_minio(paths, report=report)
        prepared = time.monotonic()
        if kafka_needs is not None:
            kafka = _start_kafka(paths, *kafka_needs, report, secure=secure)
        try:
            if minio_binary is not None:
                minio = _start_minio(paths, minio_binary, report)
        except BaseException:
            if kafka_needs is not None:
                _stop(paths, "kafka", keep_data=True)
            raise
        assert kafka is not None and minio is not None
        done = time.monotonic()
        report(f"infra up: ready in {done - began:.1f}s "
               f"(fetch/build {prepared - began:.1f}s, start {done - prepared:.1f}s)")
        return DevServers(kafka=kafka, minio=minio)


def ensure_kafka(paths: InfraPaths, *, report: Report = lambda _: None) -> tuple[KafkaServer, bool]:
    """The running broker of ``paths``, (re)started as ``up`` would; the flag says whether it was."""
    with file_lock(paths.run / ".lock"):
        server = _running_kafka(paths, report)
        if server is not None:
            return server, False
        java, lib = find_java(), fetch_kafka(paths, report=report)
        return _start_kafka(paths, java, lib, report), True


def ensure_minio(paths: InfraPaths, *, report: Report = lambda _: None) -> tuple[MinioServer, bool]:
    """The running MinIO of ``paths``, (re)started as ``up`` would; the flag says whether it was."""
    with file_lock(paths.run / ".lock"):
        server = _running_minio(paths, report)
        if server is not None:
            return server, False
        return _start_minio(paths, build_minio(paths, report=report), report), True


def restart(paths: InfraPaths, name: ServerName, *, report: Report = lambda _: None) -> str:
    """Stop the recorded server ``name`` if it runs, then start it again with the same data
    directory, port(s) and cluster id or credentials; returns its address.

    Raises :class:`InfraError` when nothing is recorded (``up`` starts one) or the recorded
    port is now taken by another process (the data is kept either way).
    """
    with file_lock(paths.run / ".lock"):
        recorded = load_kafka(paths) if name == "kafka" else load_minio(paths)
        if recorded is None:
            raise InfraError(f"{name}: nothing to restart in {paths.run}; `hadar infra up` starts one")
        if is_running(recorded.pid, recorded.marker):
            report(f"{name}: stopping pid {recorded.pid}")
            stop_group(recorded.pid, recorded.marker)
        if name == "kafka":
            return _start_kafka(paths, find_java(), fetch_kafka(paths, report=report), report).bootstrap
        return _start_minio(paths, build_minio(paths, report=report), report).endpoint


def status(paths: InfraPaths) -> list[ServerStatus]:
    """One status per server, checked live (process and health endpoint)."""
    found: list[ServerStatus] = []
    kafka = load_kafka(paths)
    if kafka is None:
        found.append(ServerStatus(name="kafka", state="down"))
    else:
        found.append(_status("kafka", kafka.pid, kafka.marker, kafka.bootstrap,
                             lambda: kafka_healthy(kafka)))
    minio = load_minio(paths)
    if minio is None:
        found.append(ServerStatus(name="minio", state="down"))
    else:
        found.append(_status("minio", minio.pid, minio.marker, minio.endpoint,
                             lambda: minio_healthy(minio)))
    return found


def down(paths: InfraPaths, *, keep_data: bool = False) -> list[str]:
    """Stop both servers (their whole process groups). Removes their run directories --
    every topic, record, bucket and object -- unless ``keep_data``, in which case ``up``
    or ``restart`` brings them back as they were."""
    with file_lock(paths.run / ".lock"):
        said = [_stop(paths, name, keep_data=keep_data) for name in SERVERS]
        if not keep_data:   # a secured setup's secrets and every credential file go with the data
            remove_tree(paths.run / "secure")
            remove_tree(paths.run / "credentials")
        return said


def stop_server(paths: InfraPaths, name: ServerName) -> str:
    """Stop one server and remove its run directory (its data too); says what it did."""
    with file_lock(paths.run / ".lock"):
        return _stop(paths, name, keep_data=False)


def _running_kafka(paths: InfraPaths, report: Report) -> KafkaServer | None:
    server = load_kafka(paths)
    if server is not None and _reusable("kafka", server.pid, server.marker, server.bootstrap,
                                        lambda: kafka_healthy(server), report):
        return server
    return None


def _running_minio(paths: InfraPaths, report: Report) -> MinioServer | None:
    server = load_minio(paths)
    if server is not None and _reusable("minio", server.pid, server.marker, server.endpoint,
                                        lambda: minio_healthy(server), report):
        return server
    return None


def _start_kafka(paths: InfraPaths, java: str, lib: Path, report: Report, *, secure: bool = False) -> KafkaServer:
    """Restart the recorded broker if there is one (its process must be gone), else start anew."""
    began = time.monotonic()
    recorded = load_kafka(paths)
    if recorded is not None:
        server = restart_kafka(paths, lib, java, recorded)
        report(f"kafka: restarted at {server.bootstrap} with its data in {time.monotonic() - began:.1f}s")
    else:
        server = start_kafka(paths, lib, java, secure=secure)
        report(f"kafka: started at {server.bootstrap} in {time.monotonic() - began:.1f}s")
    return server


def _start_minio(paths: InfraPaths, binary: Path, report: Report) -> MinioServer:
    """Restart the recorded MinIO if there is one (its process must be gone), else start anew."""
    began = time.monotonic()
    recorded = load_minio(paths)
    if recorded is not None:
        server = restart_minio(paths, binary, recorded)
        report(f"minio: restarted at {server.endpoint} with its data in {time.monotonic() - began:.1f}s")
    else:
        server = start_minio(paths, binary)
        report(f"minio: started at {server.endpoint} in {time.monotonic() - began:.1f}s")
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


def _status(name: ServerName, pid: int, marker: str, address: str,
            healthy: Callable[[], bool]) -> ServerStatus:
    if pid <= 0:
        return ServerStatus(name=name, state="stopped", address=address, pid=pid)
    if not is_running(pid, marker):
        return ServerStatus(name=name, state="crashed", address=address, pid=pid)
    state: Literal["up", "not-answering"] = "up" if healthy() else "not-answering"
    return ServerStatus(name=name, state=state, address=address, pid=pid)


def _stop(paths: InfraPaths, name: ServerName, *, keep_data: bool) -> str:
    server = load_kafka(paths) if name == "kafka" else load_minio(paths)
    server_dir = paths.server_dir(name)
    if server is None:
        if keep_data:
            return f"{name}: not running"
        existed = server_dir.exists()
        remove_tree(server_dir)
        return f"{name}: not running" + (" (removed leftover files)" if existed else "")
    was_running = is_running(server.pid, server.marker)
    stop_group(server.pid, server.marker)
    if keep_data:
        # pid 0 records "stopped on purpose": status tells it from a crash.
        write_private(paths.state_file(name), json.dumps({**asdict(server), "pid": 0}, indent=2) + "\n")
        return f"{name}: stopped (pid {server.pid}), data kept" if was_running else f"{name}: not running, data kept"
    remove_tree(server_dir)
    return f"{name}: stopped (pid {server.pid})" if was_running else f"{name}: not running (cleaned up)"
