"""A MinIO server for development and tests, built from source with ``go install``.

MinIO publishes no semver tags, so the build is pinned to a Go pseudo-version the module
proxy serves. The binary goes to ``cache/bin/minio`` beside a stamp naming the version it
was built at; a different pin rebuilds. MinIO is AGPL-3.0: it only ever runs as a separate
server; Hadar talks plain S3 to it. A new server gets fresh random credentials and free
ports; a restarted one (:func:`restart_minio`) keeps its recorded ones and its data.

``drives=1`` (the default) serves one directory. ``drives=4`` (4 to 16) serves one erasure set
over as many directories (``minio server DIR/drive{1...4}``): each object is split into data
and parity shards across them (4 drives: 2 + 2, MinIO's default parity), so every object stays
readable and writable with one drive gone, and readable with two. A drive that comes back
empty is healed by MinIO itself; objects a returning drive missed are healed when read.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from devinfra.common import (
    Clock,
    InfraError,
    InfraPaths,
    file_lock,
    free_port,
    is_running,
    keep_previous,
    load_recorded,
    port_released,
    remove_tree,
    spawn,
    stop_group,
    wait_for,
)
from shared.security.files import write_private

__all__ = [
    "MinioServer", "MINIO_MODULE", "MINIO_VERSION", "build_minio", "start_minio", "restart_minio", "load_minio",
    "minio_healthy", "new_credentials",
]

NAME = "minio"
MINIO_MODULE = "github.com/minio/minio"
# = @latest on the Go proxy on 2026-02-12; the repository has no semver tags.
MINIO_VERSION = "v0.0.0-20260212201848-7aac2a2c5b7c"
READY_TIMEOUT_S = 60.0
MAX_DRIVES = 16   # one erasure set
BUILD_TIMEOUT_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class MinioServer:
    """A running (or recorded) development MinIO. The secret key is not in repr."""

    pid: int
    port: int
    console_port: int
    run_dir: str
    access_key: str
    secret_key: str = field(repr=False)
    drives: int = 1

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return Path(self.run_dir) / "minio.log"

    @property
    def marker(self) -> str:
        """A string only this server's command line contains (its data directory)."""
        return str(Path(self.run_dir) / "data")

    @property
    def drive_dirs(self) -> list[Path]:
        """The directory of each drive: the data directory itself for a single drive."""
        if self.drives == 1:
            return [Path(self.marker)]
        return [Path(self.marker) / f"drive{number}" for number in range(1, self.drives + 1)]

    @property
    def server_args(self) -> list[str]:
        """The drives as ``minio server`` takes them (it expands ``{1...N}`` itself)."""
        return [self.marker if self.drives == 1 else f"{self.marker}/drive{{1...{self.drives}}}"]


def new_credentials(token_hex: Callable[[int], str] = secrets.token_hex) -> tuple[str, str]:
    """A fresh (access key, secret key): 13 and 40 characters, shell-safe."""
    return f"hadar{token_hex(4)}", token_hex(20)


def build_minio(paths: InfraPaths, *, env: Mapping[str, str] = os.environ,
                report: Callable[[str], None] = lambda _: None) -> Path:
    """Path of the MinIO binary at the pinned version, built with ``go install`` if needed."""
    bin_dir = paths.cache / "bin"
    binary = bin_dir / "minio"
    stamp = bin_dir / "minio.version"
    wanted = f"{MINIO_MODULE}@{MINIO_VERSION}"
    with file_lock(paths.cache / ".build-minio.lock"):
        if binary.is_file() and stamp.is_file() and stamp.read_text().strip() == wanted:
            report(f"minio: binary cached at {binary}")
            return binary
        go = shutil.which("go", path=env.get("PATH"))
        if go is None:
            raise InfraError("go not found: needed once to build MinIO (go >= 1.24)")
        started = time.monotonic()
        report(f"minio: building {wanted} with go install (minutes on first use)")
        stamp.unlink(missing_ok=True)
        bin_dir.mkdir(parents=True, exist_ok=True)
        paths.logs.mkdir(parents=True, exist_ok=True)
        log = paths.logs / "minio-build.log"
        build_env = {**env, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOBIN": str(bin_dir)}
        try:
            with open(log, "wb") as out:
                result = subprocess.run(
                    [go, "install", wanted], env=build_env, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False,
                )
        except subprocess.TimeoutExpired:
            raise InfraError(f"go install failed: timed out after {BUILD_TIMEOUT_S:.0f}s (log: {log})",
                             retriable=True) from None
        if result.returncode != 0 or not binary.is_file():
            raise InfraError(f"go install failed: {_go_error(log)} (log: {log})")
        stamp.write_text(wanted + "\n")
        report(f"minio: built with go install in {time.monotonic() - started:.1f}s")
        return binary


def load_minio(paths: InfraPaths) -> MinioServer | None:
    """The recorded MinIO of this run directory, whether or not it still runs."""
    return load_recorded(paths.state_file(NAME), MinioServer)


def minio_healthy(server: MinioServer, timeout: float = 2.0) -> bool:
    """Whether ``/minio/health/live`` answers 200 -- with several drives
    ``/minio/health/cluster``: enough of them are online to write (MinIO answers the live
    check before it has found its drives)."""
    check = "live" if server.drives == 1 else "cluster"
    try:
        with urllib.request.urlopen(f"{server.endpoint}/minio/health/{check}", timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_minio(paths: InfraPaths, binary: Path, *, drives: int = 1, clock: Clock = time.monotonic,
                attempts: int = 3) -> MinioServer:
    """Start a new MinIO over ``drives`` directories on free 127.0.0.1 ports with new
    credentials; return once it is live.

    Refuses (and touches nothing) when the run directory holds objects that no state file
    describes: data is only ever deleted by ``down``. A start that fails removes what it
    created, so the next ``up`` starts afresh again.
    """
    if drives != 1 and not 4 <= drives <= MAX_DRIVES:
        raise InfraError(f"minio: {drives} drives not supported; use 1, or 4 to {MAX_DRIVES} (one erasure set)")
    data_dir = paths.server_dir(NAME) / "data"
    if data_dir.is_dir() and any(data_dir.iterdir()):
        raise InfraError(f"minio: {data_dir} holds data but no usable state.json records its port and "
                         "credentials; `hadar infra down` deletes it")
    for attempt in range(1, attempts + 1):
        try:
            return _start_fresh(paths, binary, drives=drives, clock=clock)
        except InfraError as exc:
            if attempt == attempts or "address already in use" not in str(exc).lower():
                raise
    raise AssertionError("unreachable")


def restart_minio(paths: InfraPaths, binary: Path, recorded: MinioServer, *,
                  clock: Clock = time.monotonic) -> MinioServer:
    """Start the recorded MinIO again: the same data directory, ports and credentials, so
    clients reconnect with the settings they had and find every bucket and object.

    The recorded process must be gone (stop it first). Never picks another port: a port
    another process took is an error. On failure the data and the state file are kept.
    """
    if is_running(recorded.pid, recorded.marker):
        raise InfraError(f"minio: still running (pid {recorded.pid}); stop it before restarting")
    for port in (recorded.port, recorded.console_port):
        if not port_released(port):
            raise InfraError(f"minio: port {port} is taken by another process; free it and run "
                             "`hadar infra restart minio` (`hadar infra down` deletes the data instead)")
    return _launch(paths, binary, recorded, clock=clock)


def _start_fresh(paths: InfraPaths, binary: Path, *, drives: int, clock: Clock) -> MinioServer:
    run_dir = paths.server_dir(NAME)
    remove_tree(run_dir)
    port, console_port = free_port(), free_port()
    while console_port == port:
        console_port = free_port()
    access_key, secret_key = new_credentials()
    server = MinioServer(pid=0, port=port, console_port=console_port, run_dir=str(run_dir),
                         access_key=access_key, secret_key=secret_key, drives=drives)
    try:
        return _launch(paths, binary, server, clock=clock)
    except InfraError:
        # Nothing of value was stored yet; keep the log, forget the rest.
        paths.state_file(NAME).unlink(missing_ok=True)
        remove_tree(run_dir / "data")
        raise


def _launch(paths: InfraPaths, binary: Path, server: MinioServer, *, clock: Clock) -> MinioServer:
    run_dir = Path(server.run_dir)
    for drive in server.drive_dirs:
        if not drive.exists():   # a path that exists but is no directory is a drive MinIO finds offline
            drive.mkdir(parents=True)
    env = {
        **os.environ,
        "MINIO_ROOT_USER": server.access_key,
        "MINIO_ROOT_PASSWORD": server.secret_key,
        "MINIO_BROWSER": "off",
        "MINIO_UPDATE": "off",
    }
    if server.drives > 1:
        # Erasure mode refuses drives on the root filesystem (a real deployment gives each its
        # own disk); here they are directories of one disk on purpose. CI/CD mode allows that.
        env["MINIO_CI_CD"] = "on"
    keep_previous(server.log)
    pid = spawn(
        [str(binary), "server", *server.server_args, "--address", f"127.0.0.1:{server.port}",
         "--console-address", f"127.0.0.1:{server.console_port}"],
        log=server.log, env=env, cwd=run_dir,
    )
    server = MinioServer(**{**asdict(server), "pid": pid})
    write_private(paths.state_file(NAME), json.dumps(asdict(server), indent=2) + "\n")
    try:
        wait_for(lambda: minio_healthy(server), what="minio", timeout=READY_TIMEOUT_S,
                 alive=lambda: is_running(pid, server.marker), log=server.log, clock=clock, pid=pid)
    except InfraError:
        stop_group(pid, server.marker)
        raise
    return server


def _go_error(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("go: downloading")]
    return lines[-1] if lines else "(no output)"
