"""The trusted harness around a user's trainer process.

The harness (part of the agent's worker, which holds the store credentials) starts the
user's script as a child that holds no credential and talks to it only through a socket
(:mod:`hadar_sdk.protocol`) and two folders:

* **Environment and folders** (:mod:`services.agent.usercode.workspace`): an environment
  rebuilt from nothing (no Kafka or S3 setting, no ``*_FILE`` secret path; the worker's
  ``threads`` as ``OMP_NUM_THREADS`` and the like, an emulated GPU's ``slowdown``); it
  writes only ``home``, ``tmp`` and the outbox of its scratch, and reads the inbox.
* **Sandbox** (:mod:`services.agent.usercode.sandbox`, unless ``TrainerLaunch.sandbox`` is
  False -- insecure, development only): no capability even as uid 0, a Landlock allow-list
  of files, no TCP for a single rank, no signal to or ``/proc/<pid>/environ`` of any process
  outside the sandbox, and a seccomp filter (:mod:`services.agent.usercode.seccomp`): no
  change of any file's mode, owner or times, no ``ptrace``, namespace or mount. Without
  Landlock the trainer does not start (the launcher exits 126).
* **Identity** (an optional extra layer): when the harness runs as root, ``run_as`` runs the
  trainer as an unprivileged uid/gid with no supplementary groups. Whatever the uid, the
  harness marks itself non-dumpable (``PR_SET_DUMPABLE`` 0).
* **Process** (:mod:`services.agent.usercode.process`): its own session, open files, file
  size and optionally address space (:mod:`services.agent.usercode.launch`), no core dumps;
  the last ``log_bytes`` of its stdout and stderr are kept (:attr:`Trainer.log_tail`). When
  it ends (:meth:`Trainer.close`, a kill, a failure) every process it started ends too, also
  one that left its session (``setsid``, a double fork): the harness is their subreaper.
* **Rounds:** :meth:`Trainer.run_round` writes the start state into the inbox, sends the
  round, and waits for ``saved``; at the round's deadline or on :meth:`Trainer.request_stop`
  it sends ``stop``, ``stop_grace_s`` later SIGTERM, ``term_grace_s`` after that SIGKILL. The
  state file is moved out of the outbox into a folder the trainer cannot reach, then checked
  (:mod:`services.agent.usercode.checks`) before the caller may store it. A trainer that breaks
  a rule is ended; later rounds of it fail at once.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from hadar_sdk.protocol import MAX_LINE, TO_HARNESS, Message, ProtocolError, decode, encode
from hadar_sdk.run import START_FILE, STATE_FILE
from services.agent.usercode.checks import (
    TensorSpec,
    TrainerRefused,
    checked_counts,
    checked_state,
    empty_folder,
    specs_of,
    take_state,
)
from services.agent.usercode.process import TrainerProcess
from services.agent.usercode.sandbox import SandboxPolicy, make_undumpable
from services.agent.usercode.workspace import (
    SDK_DIR,
    TrainerLaunch,
    TrainerLimits,
    launcher_command,
    prepare_scratch,
    sandbox_policy,
    trainer_environment,
)

__all__ = ["TrainerLimits", "TrainerLaunch", "RoundRequest", "RoundResult", "Trainer", "ProgressCallback", "SDK_DIR"]

ProgressCallback = Callable[[int, int, float | None], None]   # (steps, samples, loss) of the round so far
MAX_METRICS = 256                    # a round's metrics, at most
_QUEUED = 1024                       # messages read ahead; then the trainer's sends wait (back-pressure)
_EOF, _WAKE = Message(op="<eof>"), Message(op="<wake>")


@dataclass(frozen=True, kw_only=True)
class RoundRequest:
    round: int
    copy: int
    start_steps: int
    max_steps: int
    seconds: float
    max_samples_per_step: int
    start: dict[str, torch.Tensor] | None = None
    data_dir: Path | None = None        # default: TrainerLaunch.data_dir


@dataclass(frozen=True, kw_only=True)
class RoundResult:
    """``ok``: the state is checked and may be stored; else ``reason`` says why not."""

    ok: bool
    reason: str = ""
    steps: int = 0
    samples: int = 0
    loss: float | None = None
    tensors: dict[str, torch.Tensor] | None = None
    metrics: tuple[tuple[str, str, float], ...] = ()
    stopped: bool = False               # the harness sent stop (the deadline, or request_stop)
    killed: bool = False                # ... and then had to signal the process
    exit_code: int | None = None


@dataclass(kw_only=True)
class _Progress:
    steps: int = 0
    samples: int = 0
    loss: float | None = None
    metrics: list[tuple[str, str, float]] = field(default_factory=list)


class Trainer:
    """One user trainer process, started by :meth:`start`, given rounds one at a time.

    :meth:`run_round` and :meth:`close` are called from one thread; :meth:`request_stop`
    from any thread at any time."""

    def __init__(self, launch_: TrainerLaunch, limits: TrainerLimits | None = None) -> None:
        self.launch = launch_
        self.limits = limits or TrainerLimits()
        scratch = launch_.scratch
        self.inbox, self.outbox, self.sdk_path = scratch / "inbox", scratch / "outbox", scratch / "sdk"
        self.received = scratch / "received"   # the harness's own: states moved out of the outbox
        self.policy: SandboxPolicy | None = None
        self._messages: queue.Queue[Message] = queue.Queue(_QUEUED)
        self._send_lock, self._stop_lock = threading.Lock(), threading.Lock()
        self.process = TrainerProcess(log_bytes=self.limits.log_bytes)
        self._sock: socket.socket | None = None
        self._hello = False
        self._ended = False
        self._in_round = False
        self._stop_pending = False
        self._stop_at: float | None = None
        self.violation: str | None = None

    # ------------------------------------------------------------------ process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def log_tail(self) -> str:
        """The last ``log_bytes`` of the trainer's stdout and stderr, as text."""
        return self.process.log_tail

    def environment(self, child_fd: int) -> dict[str, str]:
        """The trainer's whole environment (:func:`~services.agent.usercode.workspace.trainer_environment`)."""
        return trainer_environment(self.launch, child_fd)

    def sandbox_policy(self) -> SandboxPolicy:
        """What the trainer may touch (:func:`~services.agent.usercode.workspace.sandbox_policy`)."""
        return sandbox_policy(self.launch)

    def start(self) -> None:
        self.policy = self.sandbox_policy() if self.launch.sandbox else None
        command = launcher_command(self.launch, self.limits, self.policy)   # TrainerRefused: a bad entrypoint
        make_undumpable()
        prepare_scratch(self.launch)
        ours, theirs = socket.socketpair()
        try:
            self.process.start(command, cwd=self.launch.scratch / "home", env=self.environment(theirs.fileno()),
                               pass_fd=theirs.fileno(), run_as=self.launch.run_as)
        finally:
            theirs.close()
        self._sock = ours
        threading.Thread(target=self._read_channel, name="trainer-channel", daemon=True).start()

    def _read_channel(self) -> None:
        assert self._sock is not None
        buffer = b""
        try:
            while chunk := self._sock.recv(65536):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._messages.put(decode(line, allowed=TO_HARNESS))
                if len(buffer) > MAX_LINE:
                    raise ProtocolError(f"a line over {MAX_LINE} bytes")
        except ProtocolError as exc:
            self.violation = str(exc)
        except OSError:
            pass
        self._messages.put(_EOF)

    def _send(self, op: str, **fields: object) -> bool:
        if self._sock is None:
            return False
        try:
            with self._send_lock:
                self._sock.sendall(encode(op, **fields))
            return True
        except OSError:
            return False

    def _end_process(self) -> tuple[int | None, bool]:
        """End the trainer and all it started (:meth:`TrainerProcess.end`): (exit code, SIGKILL needed)."""
        self._ended = True
        return self.process.end(self.limits.term_grace_s)

    def _fail(self, reason: str, *, stopped: bool = False, progress: _Progress | None = None) -> RoundResult:
        code, _ = self._end_process()
        return RoundResult(ok=False, reason=reason, stopped=stopped, exit_code=code,
                           steps=progress.steps if progress else 0, samples=progress.samples if progress else 0)

    def close(self) -> int | None:
        """Tell the trainer there are no more rounds; SIGTERM it if it has not exited
        ``stop_grace_s`` later, SIGKILL ``term_grace_s`` after that; then SIGKILL every process
        it started (:meth:`TrainerProcess.sweep`). Its exit code."""
        self._send("exit")
        code: int | None = None
        if self.process.started:
            try:
                code = self.process.wait(self.limits.stop_grace_s)
            except subprocess.TimeoutExpired:
                code, _ = self._end_process()
            self.process.sweep()   # what it started, in its session or escaped from it
        self._ended = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        return code

    # ------------------------------------------------------------------ rounds

    def request_stop(self) -> None:
        """Stop the round in progress at the end of its current step (it saves; the usual
        ``stop_grace_s`` then applies), or, between rounds, the next round at once."""
        with self._stop_lock:
            if not self._in_round:
                self._stop_pending = True
            elif self._stop_at is None:
                self._stop_at = time.monotonic()
                self._send("stop")
                with contextlib.suppress(queue.Full):   # a full queue wakes run_round anyway
                    self._messages.put_nowait(_WAKE)

    def _send_stop(self) -> None:
        with self._stop_lock:
            if self._stop_at is None:
                self._stop_at = time.monotonic()
                self._send("stop")

    def _wait(self, until: float) -> Message | None:
        try:
            return self._messages.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return None

    def _write_start(self, start: dict[str, torch.Tensor] | None) -> None:
        path = self.inbox / START_FILE
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if start is not None:
            save_file({k: v.contiguous() for k, v in start.items()}, str(path))
            os.chmod(path, 0o440)
            if self.launch.run_as is not None:
                os.chown(path, -1, self.launch.run_as[1])
        empty_folder(self.outbox)

    def _await_hello(self) -> str | None:
        until = time.monotonic() + self.limits.hello_s
        while not self._hello:
            message = self._wait(until)
            if message is None:
                return f"the trainer did not connect to the SDK within {self.limits.hello_s:g} s"
            if message is _EOF:
                return self._gone_reason()
            if message.op == "hello":
                self._hello = True
            elif message.op == "failed":
                return f"the trainer failed: {message.fields.get('reason')!s:.500}"
        return None

    def wait_ready(self) -> str | None:
        """Wait for the script's first SDK call (its ``hello``), so that its imports and its
        own set-up count in a cold start (CopyFinished.start_s); a warm trainer said it long
        ago and returns at once. None when it came; else why not, and the trainer is ended."""
        if not self.process.started or self._ended:
            return "the trainer is not running"
        reason = self._await_hello()
        if reason is not None:
            self._end_process()
        return reason

    def _gone_reason(self) -> str:
        if self.violation:
            return f"the trainer broke the SDK protocol: {self.violation}"
        code = self.process.wait()
        self.process.join_output(2.0)   # the rest of its output (a child of its own may hold the pipe)
        last = self.log_tail.strip().splitlines()[-1:] or [""]
        return f"the trainer exited (code {code}) without saving: {last[0][:200]}"

    def run_round(self, request: RoundRequest, on_progress: ProgressCallback | None = None) -> RoundResult:
        """Train one round in the trainer; never raises for what the trainer does.

        ``on_progress(steps, samples, loss)`` is called, from this thread, for every progress
        report of the trainer (within the round's budget; a report over it refuses the round);
        what it raises propagates."""
        if not self.process.started or self._ended:
            return RoundResult(ok=False, reason="the trainer is not running", exit_code=self.process.poll())
        reason = self._await_hello()
        if reason is not None:
            return self._fail(reason)
        self._write_start(request.start)
        reference = specs_of(request.start) if request.start is not None else None
        data = request.data_dir or self.launch.data_dir
        with self._stop_lock:   # a stop asked for before the round travels with it: no step is trained
            self._send("round", round=request.round, copy=request.copy, rank=self.launch.rank,
                       world_size=self.launch.world_size, seed=self.launch.seed, start_steps=request.start_steps,
                       max_steps=request.max_steps, seconds=request.seconds, has_start=request.start is not None,
                       inbox=str(self.inbox), outbox=str(self.outbox), data=str(data) if data else None,
                       stop=self._stop_pending)
            self._in_round, self._stop_at = True, time.monotonic() if self._stop_pending else None
        try:
            return self._follow(request, reference, time.monotonic() + request.seconds, on_progress)
        finally:
            with self._stop_lock:
                self._in_round = self._stop_pending = False

    def _follow(self, request: RoundRequest, reference: dict[str, TensorSpec] | None, deadline: float,
                on_progress: ProgressCallback | None) -> RoundResult:
        progress = _Progress()
        while True:
            stop_at = self._stop_at
            message = self._wait(deadline if stop_at is None else stop_at + self.limits.stop_grace_s)
            if message is None:
                if stop_at is None:
                    self._send_stop()
                    continue
                code, kill = self._end_process()
                how = "killed (SIGTERM, then SIGKILL)" if kill else "ended by SIGTERM"
                return RoundResult(ok=False, stopped=True, killed=True, exit_code=code, steps=progress.steps,
                                   samples=progress.samples, reason=f"the trainer did not end the round within "
                                   f"{self.limits.stop_grace_s:g} s of the stop: {how}")
            if message is _WAKE:
                continue
            stopped = self._stop_at is not None
            if message is _EOF:
                return self._fail(self._after_stop(self._gone_reason()), stopped=stopped, progress=progress)
            try:
                if message.op == "progress":
                    progress.steps, progress.samples = message.integer("steps"), message.integer("samples")
                    progress.loss = message.number("loss", optional=True)
                    checked_counts(steps=progress.steps, samples=progress.samples, max_steps=request.max_steps,
                                   max_samples_per_step=request.max_samples_per_step, in_step=True)
                    if on_progress is not None:
                        on_progress(progress.steps, progress.samples, progress.loss)
                elif message.op == "metric":
                    if len(progress.metrics) >= MAX_METRICS:
                        raise TrainerRefused(f"the trainer sent more than {MAX_METRICS} metrics in a round")
                    progress.metrics.append((message.text("name", max_len=64) or "",
                                             message.text("of", max_len=8) or "final",
                                             message.number("value") or 0.0))
                elif message.op == "failed":
                    return self._fail(self._after_stop(f"the trainer failed: {message.fields.get('reason')!s:.500}"),
                                      stopped=stopped, progress=progress)
                elif message.op == "saved":
                    return self._saved(message, request, reference, progress, stopped)
            except (ProtocolError, TrainerRefused) as exc:
                return self._fail(f"refused: {exc}", stopped=stopped, progress=progress)

    def _after_stop(self, reason: str) -> str:
        """``reason`` for a trainer that failed or exited instead of saving; once it was told
        to stop, led by that: the stop is the cause, and what the trainer then said may be a
        consequence (in a copy of several ranks, a peer ended at the deadline fails the
        collective this rank waits in)."""
        stop_at = self._stop_at
        if stop_at is None:
            return reason
        return f"the trainer did not end the round at the stop: {time.monotonic() - stop_at:.1f} s later, {reason}"

    def _saved(self, message: Message, request: RoundRequest, reference: dict[str, TensorSpec] | None,
               progress: _Progress, stopped: bool) -> RoundResult:
        steps, samples = message.integer("steps"), message.integer("samples")
        checked_counts(steps=steps, samples=samples, max_steps=request.max_steps,
                       max_samples_per_step=request.max_samples_per_step)
        tensors = None
        if self.launch.rank == 0:
            taken = take_state(self.outbox / STATE_FILE, folder=self.received)
            tensors = checked_state(taken, folder=self.received, max_bytes=self.limits.state_bytes,
                                    reference=reference)
        return RoundResult(ok=True, steps=steps, samples=samples, loss=progress.loss, tensors=tensors,
                           metrics=tuple(progress.metrics), stopped=stopped)

