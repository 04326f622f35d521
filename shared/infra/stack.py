"""Bring the development Kafka and MinIO up, report on them, and take them down.

One run directory holds at most one of each. ``up`` reuses a server that is running and
answering, replaces one whose process is gone, and refuses (with a one-line error) one
that runs but does not answer. Anything ``up`` started is stopped again if a later step
of the same ``up`` fails. ``down`` is idempotent. Calls on one run directory are
serialised with a file lock, so two ``up``s never race.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.config import KafkaSettings, S3Settings
from shared.infra.common import (
    InfraError,
    InfraPaths,
    file_lock,
    is_running,
    remove_tree,
    stop_group,
    write_private,
)
from shared.infra.kafka import KafkaServer, fetch_kafka, find_java, kafka_healthy, load_kafka, start_kafka
from shared.infra.minio import MinioServer, build_minio, load_minio, minio_healthy, start_minio

__all__ = [
    "DevServers", "ServerStatus", "Report", "up", "status", "down", "ensure_kafka", "ensure_minio",
    "stop_server", "env_lines", "write_env_file",
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
    def kafka_settings(self) -> KafkaSettings:
        return KafkaSettings(bootstrap=self.kafka.bootstrap)

    @property
    def s3_settings(self) -> S3Settings:
        return S3Settings(endpoint=self.minio.endpoint, access_key=self.minio.access_key,
                          secret_key=self.minio.secret_key)


@dataclass(frozen=True, kw_only=True)
class ServerStatus:
    """What ``status`` found for one server; ``state`` is up, down, stale or not-answering."""

    name: ServerName
    state: Literal["up", "down", "stale", "not-answering"]
    address: str = ""
    pid: int = 0

    def line(self) -> str:
        if self.state == "up":
            return f"{self.name}: up at {self.address} (pid {self.pid})"
        if self.state == "not-answering":
            return f"{self.name}: running (pid {self.pid}) but not answering at {self.address}"
        if self.state == "stale":
            return f"{self.name}: down (pid {self.pid} is gone; `hadar infra down` cleans up)"
        return f"{self.name}: down"


def env_lines(servers: DevServers) -> list[str]:
    """The shell-ready ``NAME=value`` lines that point Hadar at ``servers``."""
    return [
        f"HADAR_BOOTSTRAP={servers.kafka.bootstrap}",
        f"HADAR_S3_ENDPOINT={servers.minio.endpoint}",
        f"HADAR_S3_ACCESS_KEY={servers.minio.access_key}",
        f"HADAR_S3_SECRET_KEY={servers.minio.secret_key}",
    ]


def write_env_file(path: Path, servers: DevServers) -> None:
    """Write :func:`env_lines` to ``path`` (owner-only: it holds the S3 secret)."""
    write_private(path, "\n".join(env_lines(servers)) + "\n")


def up(paths: InfraPaths, *, report: Report = lambda _: None) -> DevServers:
    """Ensure both servers run and answer. Fetches and builds whatever is missing first,
    then starts what is not running, and reports how long each phase took."""
    with file_lock(paths.run / ".lock"):
        began = time.monotonic()
        kafka, minio = _running_kafka(paths, report), _running_minio(paths, report)
        if kafka is not None and minio is not None:
            report("infra up: already running")
            return DevServers(kafka=kafka, minio=minio)
        kafka_needs = None if kafka is not None else (find_java(), fetch_kafka(paths, report=report))
        minio_binary = None if minio is not None else build_minio(paths, report=report)
        prepared = time.monotonic()
        if kafka_needs is not None:
            kafka = _start_kafka(paths, *kafka_needs, report)
        try:
            if minio_binary is not None:
                minio = _start_minio(paths, minio_binary, report)
        except BaseException:
            if kafka_needs is not None:
                _stop(paths, "kafka")
            raise
        assert kafka is not None and minio is not None
        done = time.monotonic()
        report(f"infra up: ready in {done - began:.1f}s "
               f"(fetch/build {prepared - began:.1f}s, start {done - prepared:.1f}s)")
        return DevServers(kafka=kafka, minio=minio)


def ensure_kafka(paths: InfraPaths, *, report: Report = lambda _: None) -> tuple[KafkaServer, bool]:
    """The running broker of ``paths``, started if needed; the flag says whether it was."""
    with file_lock(paths.run / ".lock"):
        server = _running_kafka(paths, report)
        if server is not None:
            return server, False
        java, lib = find_java(), fetch_kafka(paths, report=report)
        return _start_kafka(paths, java, lib, report), True


def ensure_minio(paths: InfraPaths, *, report: Report = lambda _: None) -> tuple[MinioServer, bool]:
    """The running MinIO of ``paths``, started if needed; the flag says whether it was."""
    with file_lock(paths.run / ".lock"):
        server = _running_minio(paths, report)
        if server is not None:
            return server, False
        return _start_minio(paths, build_minio(paths, report=report), report), True


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


def down(paths: InfraPaths) -> list[str]:
    """Stop both servers (their whole process groups) and remove their run directories."""
    with file_lock(paths.run / ".lock"):
        return [_stop(paths, name) for name in SERVERS]


def stop_server(paths: InfraPaths, name: ServerName) -> str:
    """Stop one server and remove its run directory; says what it did."""
    with file_lock(paths.run / ".lock"):
        return _stop(paths, name)


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


def _start_kafka(paths: InfraPaths, java: str, lib: Path, report: Report) -> KafkaServer:
    began = time.monotonic()
    server = start_kafka(paths, lib, java)
    report(f"kafka: started at {server.bootstrap} in {time.monotonic() - began:.1f}s")
    return server


def _start_minio(paths: InfraPaths, binary: Path, report: Report) -> MinioServer:
    began = time.monotonic()
    server = start_minio(paths, binary)
    report(f"minio: started at {server.endpoint} in {time.monotonic() - began:.1f}s")
    return server


def _reusable(name: str, pid: int, marker: str, address: str, healthy: Callable[[], bool],
              report: Report) -> bool:
    if not is_running(pid, marker):
        report(f"{name}: the recorded process {pid} is gone; starting a new one")
        return False
    if healthy():
        report(f"{name}: already running at {address} (pid {pid})")
        return True
    raise InfraError(f"{name} runs (pid {pid}) but does not answer at {address}; run `hadar infra down`")


def _status(name: ServerName, pid: int, marker: str, address: str,
            healthy: Callable[[], bool]) -> ServerStatus:
    if not is_running(pid, marker):
        return ServerStatus(name=name, state="stale", address=address, pid=pid)
    state: Literal["up", "not-answering"] = "up" if healthy() else "not-answering"
    return ServerStatus(name=name, state=state, address=address, pid=pid)


def _stop(paths: InfraPaths, name: ServerName) -> str:
    server = load_kafka(paths) if name == "kafka" else load_minio(paths)
    server_dir = paths.server_dir(name)
    if server is None:
        existed = server_dir.exists()
        remove_tree(server_dir)
        return f"{name}: not running" + (" (removed leftover files)" if existed else "")
    was_running = is_running(server.pid, server.marker)
    stop_group(server.pid, server.marker)
    remove_tree(server_dir)
    return f"{name}: stopped (pid {server.pid})" if was_running else f"{name}: not running (cleaned up)"
