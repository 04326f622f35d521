"""Pieces both development servers share: where things live, ports, processes, state files.

Layout (``cache`` = ``$HADAR_CACHE`` or ``~/.cache/hadar``; ``run`` = ``$HADAR_RUN_DIR`` or
``cache/run``)::

    cache/kafka-<version>-<pom hash>/lib/   Kafka's jars (from Maven Central)
    cache/bin/minio, cache/bin/minio.version the MinIO binary and the version it was built at
    cache/logs/                               fetch and build logs
    run/<server>/state.json                   pid, ports, paths (and MinIO's credentials, 0600)
    run/<server>/data/, run/<server>/*.log    the server's data and output

Every server is started as the leader of its own process group, so stopping it means
signalling that group: no child outlives ``down``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from shared.errors import HadarError
from shared.security.files import read_json

__all__ = [
    "InfraError", "InfraPaths", "Clock", "free_port", "free_ports", "spawn", "is_running", "stop_group",
    "stop_groups", "wait_for", "port_accepts", "file_lock", "log_tail",
    "remove_tree", "keep_previous", "port_released", "exit_status", "failure_tail", "FAILURE_LINES",
]

Clock = Callable[[], float]

# Servers this process spawned, kept so they can be reaped (and so Popen does not warn).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
# Exit codes of reaped children (negative: the signal), for the error that reports the exit.
_EXITED: dict[int, int] = {}
# How many of a dead server's last log lines an error shows (the cause is rarely the last).
FAILURE_LINES = 5
# How long a server seen gone while starting gets to finish exiting, so its exit code is known.
EXIT_WAIT_S = 10.0


class InfraError(HadarError):
    """A development server could not be fetched, built, started or stopped. One line.

    ``retriable`` only where trying again may succeed by itself: a server that was not
    ready in time, a port taken between choosing and binding it, a step that timed out.
    A missing tool, a failed build or a server that exits are not.
    """


@dataclass(frozen=True, kw_only=True)
class InfraPaths:
    """The cache (binaries, jars; kept) and the run directory (state, data; removed by ``down``
    only -- ``up`` and ``restart`` keep a server's data, ports and credentials)."""

    cache: Path
    run: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> InfraPaths:
        cache = Path(env["HADAR_CACHE"]) if env.get("HADAR_CACHE") else Path.home() / ".cache" / "hadar"
        run = Path(env["HADAR_RUN_DIR"]) if env.get("HADAR_RUN_DIR") else cache / "run"
        return cls(cache=cache.expanduser().resolve(), run=run.expanduser().resolve())

    def server_dir(self, name: str) -> Path:
        return self.run / name

    def state_file(self, name: str) -> Path:
        return self.run / name / "state.json"

    @property
    def logs(self) -> Path:
        return self.cache / "logs"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the server may still race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago (each bound until
    all are chosen, so none repeats; the servers may still race for them)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def port_accepts(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_released(port: int, *, timeout: float = 10.0, clock: Clock = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> bool:
    """Whether nothing accepts on ``port`` any more, waiting up to ``timeout`` seconds.

    A killed multi-threaded server (a JVM, Go) looks gone -- its main thread a zombie --
    a moment before its last thread exits and its listening sockets close.
    """
    deadline = clock() + timeout
    while port_accepts(port, timeout=0.5):
        if clock() >= deadline:
            return False
        sleep(0.1)
    return True


def spawn(argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None,
          cwd: Path | None = None) -> int:
    """Start ``argv`` detached in a new session (its own process group); output to ``log``.

    Returns the pid, which is also the process-group id.
    """
    with open(log, "ab") as out:
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
        )
    _CHILDREN[process.pid] = process
    return process.pid


def is_running(pid: int, marker: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line contains ``marker``.

    The marker (a path unique to the server's run directory) guards against a recycled pid.
    A pid of 0 or less (a server stopped by ``down --keep-data``) is never running.
    """
    if pid <= 0:
        return False
    _reap(pid)
    proc = Path("/proc") / str(pid)
    if not Path("/proc/self").exists():  # no procfs: trust the pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state != "Z" and marker in cmdline


def stop_group(pid: int, marker: str, *, grace: float = 10.0, clock: Clock = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Stop the process group led by ``pid``: SIGTERM, then SIGKILL after ``grace`` seconds.

    Does nothing when ``pid`` is not running ``marker`` any more (already stopped).
    """
    stop_groups([(pid, marker)], grace=grace, clock=clock, sleep=sleep)


def stop_groups(leaders: Sequence[tuple[int, str]], *, grace: float = 10.0, clock: Clock = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> None:
    """:func:`stop_group` for several groups at once, each ``(pid, marker)``: all get SIGTERM
    together, so the nodes of a cluster shut down while their peers still answer."""
    # never signal a group whose leader is gone: its id may belong to another now
    running = [(pid, marker) for pid, marker in leaders if is_running(pid, marker)]
    for pid, _ in running:
        _signal_group(pid, signal.SIGTERM)
    deadline = clock() + grace
    while clock() < deadline and any(is_running(pid, marker) for pid, marker in running):
        sleep(0.1)
    for pid, _ in running:
        _signal_group(pid, signal.SIGKILL)
    deadline = clock() + 5.0
    while clock() < deadline and any(is_running(pid, marker) for pid, marker in running):
        sleep(0.05)
    for pid, marker in running:
        if is_running(pid, marker):
            raise InfraError(f"process {pid} survived SIGKILL")


def wait_for(ready: Callable[[], bool], *, what: str, timeout: float, alive: Callable[[], bool],
             log: Path, clock: Clock = time.monotonic,
             sleep: Callable[[float], None] = time.sleep, interval: float = 0.2, pid: int | None = None) -> None:
    """Poll ``ready`` until it is true; raise :class:`InfraError` if the process dies or time runs out.

    The error is one line with why: the exit code or killing signal of ``pid`` (when this
    process started it) and :func:`failure_tail` of ``log``, which holds the server's stdout
    and stderr.
    """
    deadline = clock() + timeout
    while True:
        if ready():
            return
        if not alive():
            status = f" ({exit_status(pid, wait=EXIT_WAIT_S)})" if pid is not None else ""
            raise InfraError(f"{what} exited while starting{status}: {failure_tail(log)} (log: {log})")
        if clock() >= deadline:
            raise InfraError(f"{what} not ready after {timeout:.0f}s: {failure_tail(log)} (log: {log})",
                             retriable=True)
        sleep(interval)


def exit_status(pid: int, *, wait: float = 0.0) -> str:
    """How the server ``pid`` ended, in words: ``exit code N``, ``killed by SIGNAME``, or
    unknown for a process this one did not start (its parent reaps it) or that still runs.

    ``wait``: seconds to wait for a child of this process to finish exiting. A JVM drops its
    command line before it becomes a zombie, so a server can look gone before it has exited.
    """
    process = _CHILDREN.get(pid)
    code = process.poll() if process is not None else _EXITED.get(pid)
    if process is not None and code is None and wait > 0:
        try:
            code = process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    if process is not None and code is not None:
        _reap(pid)
    if code is None:
        return ("exit status unknown: not started by this process" if process is None
                else "exit status unknown: still running")
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(log: Path, lines: int = 1) -> str:
    """The last non-empty line(s) of ``log``, for a one-line error message."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no output)"
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) if kept else "(no output)"


def failure_tail(log: Path, lines: int = FAILURE_LINES) -> str:
    """The last ``lines`` lines of ``log`` that say something, in one line: a Java stack
    trace's frames (``at ...``, ``... 3 more``) are left out, so the exception's message
    shows rather than the frames under it."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no output)"
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in kept if not _STACK_FRAME.match(line)]
    return " | ".join(said[-lines:]) if said else "(no output)"


_STACK_FRAME = re.compile(r"^(at [\w$.<>/]+\(.*\)|\.\.\. \d+ more)")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


T = TypeVar("T")


def load_recorded(path: Path, record: Callable[..., T]) -> T | None:
    """The server recorded in the state file ``path``, whether or not it still runs;
    ``None`` if there is none or it was written by an incompatible version."""
    data = read_json(path)
    if data is None:
        return None
    try:
        return record(**data)
    except TypeError:
        return None


def keep_previous(log: Path) -> None:
    """Move ``log`` to ``log.prev`` (replacing an older one): a restarted server starts a new
    log, and the crashed run's output stays readable beside it."""
    if log.exists():
        os.replace(log, log.with_name(log.name + ".prev"))


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything under it, if it exists."""
    shutil.rmtree(path, ignore_errors=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    _reap(pgid)


def _reap(pid: int) -> None:
    # When this process started the server (the test session), a dead child stays a zombie
    # until it is waited for; poll its Popen so the pid is really gone.
    process = _CHILDREN.get(pid)
    if process is not None and process.poll() is not None:
        _EXITED[pid] = process.returncode
        del _CHILDREN[pid]
