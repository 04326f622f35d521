"""The trainer's operating-system process: started, its output kept, ended with all it started.

* **Start:** :meth:`TrainerProcess.start` runs the launcher in a session of its own (a signal
  to the session reaches every process the script starts that stays in it), its stdout and
  stderr in one pipe of which the last ``log_bytes`` are kept (:attr:`TrainerProcess.log_tail`).
  Before the first start the harness makes itself a *child subreaper*
  (``PR_SET_CHILD_SUBREAPER``): a process the trainer starts whose parent dies -- a
  double fork, a ``setsid`` daemon -- becomes the harness's child instead of init's.
* **End:** :meth:`TrainerProcess.end` sends SIGTERM to the session, SIGKILL after the grace;
  :meth:`TrainerProcess.sweep` (also run by ``end``) then SIGKILLs what is left in the session
  and every *escaped* child of the harness, and reaps it, until none is left (or 5 s passed:
  a process stuck in the kernel). An escaped child is a child of the harness process that is
  neither a trainer this module started (and has not reaped) nor in the harness's own session:
  a trainer's descendants never are (the trainer starts its own session, and no process can
  join an existing one), while what the harness starts itself with ``subprocess`` is. So it is
  the descendants of *some* trainer: with several trainers in one harness process, ending one
  also ends the escaped processes of the others (the agent runs one trainer per worker).
  Killing a child by pid is safe: a child's pid is not reused until it is reaped, and only
  this module reaps children it did not start.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

__all__ = ["TrainerProcess", "become_subreaper", "escaped_children", "end_escaped"]

_PR_SET_CHILD_SUBREAPER = 36
_SWEEP_S = 5.0
_LOCK = threading.Lock()        # a start (fork to registration) never interleaves with a sweep's scan
_TRAINERS: set[int] = set()     # the pids of the trainer processes started here and not yet reaped


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (idempotent); False if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid``, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()   # after the command name, which may hold anything
    return (int(fields[1]), int(fields[3])) if len(fields) > 3 else None


def escaped_children() -> list[int]:
    """This process's children that are trainers' descendants (see the module docstring)."""
    me, session = os.getpid(), os.getsid(0)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in _TRAINERS:
            info = _stat(entry)
            if info is not None and info[0] == me and info[1] != session:
                found.append(int(entry))
    return found


def end_escaped(timeout: float = _SWEEP_S) -> list[int]:
    """SIGKILL and reap :func:`escaped_children`, again for their orphans, until none is left."""
    ended: list[int] = []
    deadline = time.monotonic() + timeout
    with _LOCK:
        while found := escaped_children():
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            pending = set(found)
            while pending:
                for pid in list(pending):
                    try:
                        done = os.waitpid(pid, os.WNOHANG)[0] == pid
                    except ChildProcessError:
                        done = True
                    if done:
                        pending.discard(pid)
                        ended.append(pid)
                if pending:
                    if time.monotonic() >= deadline:
                        return ended
                    time.sleep(0.005)
            if time.monotonic() >= deadline:
                break
    return ended


class TrainerProcess:
    """The launcher (then the user's script) as a child in its own session; see the module."""

    def __init__(self, *, log_bytes: int) -> None:
        self.log_bytes = log_bytes
        self._popen: subprocess.Popen[bytes] | None = None
        self._output: threading.Thread | None = None
        self._log: collections.deque[bytes] = collections.deque()
        self.kept_bytes = 0             # the output kept, in whole chunks (at most log_bytes + one chunk)
        self._log_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def started(self) -> bool:
        return self._popen is not None

    def start(self, command: list[str], *, cwd: Path, env: dict[str, str], pass_fd: int,
              run_as: tuple[int, int] | None) -> None:
        user = {} if run_as is None else {"user": run_as[0], "group": run_as[1], "extra_groups": []}
        become_subreaper()
        with _LOCK:
            self._popen = subprocess.Popen(
                command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(pass_fd,), start_new_session=True,
                **user)  # type: ignore[call-overload]
            _TRAINERS.add(self._popen.pid)
        self._output = threading.Thread(target=self._read_output, name="trainer-output", daemon=True)
        self._output.start()

    def _read_output(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        fd = self._popen.stdout.fileno()
        while chunk := os.read(fd, 8192):
            with self._log_lock:
                self._log.append(chunk)
                self.kept_bytes += len(chunk)
                while self.kept_bytes > self.log_bytes and len(self._log) > 1:
                    self.kept_bytes -= len(self._log.popleft())

    @property
    def log_tail(self) -> str:
        """The last ``log_bytes`` of the trainer's stdout and stderr, as text."""
        with self._log_lock:
            data = b"".join(self._log)[-self.log_bytes:]
        return data.decode("utf-8", errors="replace")

    def join_output(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the rest of the output (a child of the trainer may hold the pipe)."""
        if self._output is not None:
            self._output.join(timeout)

    def poll(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (subprocess.TimeoutExpired after ``timeout``); None if never started."""
        if self._popen is None:
            return None
        code = self._popen.wait(timeout)
        with _LOCK:
            _TRAINERS.discard(self._popen.pid)
        return code

    def signal(self, signum: int, *, leftovers: bool = False) -> None:
        """Signal the trainer's session (``leftovers``: also once the trainer itself has exited)."""
        if self._popen is not None and (leftovers or self._popen.poll() is None):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signum)

    def end(self, term_grace_s: float) -> tuple[int | None, bool]:
        """SIGTERM the session, SIGKILL it after ``term_grace_s``, then :meth:`sweep`:
        (exit code, SIGKILL needed)."""
        if self._popen is None:
            return None, False
        self.signal(signal.SIGTERM)
        try:
            code, kill = self.wait(term_grace_s), False
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            code, kill = self.wait(), True
        self.sweep()
        return code, kill

    def sweep(self) -> None:
        """SIGKILL what is left of the trainer's session and every escaped process (see the module)."""
        if self._popen is not None:
            self.signal(signal.SIGKILL, leftovers=True)
            end_escaped()
