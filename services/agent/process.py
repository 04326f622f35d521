"""Worker subprocesses: spawning, talking to them, signalling them, and keeping spares warm.

A worker process imports torch before it reads its spec (seconds on a busy machine), so
the daemon keeps ``spares`` processes started ahead of need: an assignment takes a warm
one and a replacement starts in the background. That is safe for GPUs because a worker
sets the spec's environment (``CUDA_VISIBLE_DEVICES``) before its first CUDA call, and
importing torch makes none. Workers run in their own session, so a terminal's Ctrl-C
reaches only the daemon, which then drains them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from services.agent.spec import WorkerSpec, parse_worker_line

__all__ = ["PROJECT_ROOT", "child_env", "WorkerProcess", "WorkerPool"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
LINE_LIMIT = 1 << 20


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, with the project importable and ``extra`` applied."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class WorkerProcess:
    """One ``python -m services.agent.worker`` child."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.signalled = False

    @classmethod
    async def spawn(cls, python: str = sys.executable) -> WorkerProcess:
        proc = await asyncio.create_subprocess_exec(
            python, "-m", "services.agent.worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=child_env(), cwd=str(PROJECT_ROOT),
            start_new_session=True, limit=LINE_LIMIT)
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def send(self, spec: WorkerSpec) -> None:
        """Hand the worker its spec (then close its stdin)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(spec.to_json().encode() + b"\n")
        await self.proc.stdin.drain()
        self.proc.stdin.close()

    async def messages(self) -> AsyncIterator[dict[str, Any]]:
        """Protocol messages until the worker closes its stdout; other lines are skipped."""
        assert self.proc.stdout is not None
        while True:
            try:
                line = await self.proc.stdout.readline()
            except ValueError:  # a line over LINE_LIMIT: not a protocol line
                continue
            if not line:
                return
            message = parse_worker_line(line)
            if message is not None:
                yield message

    def terminate(self) -> None:
        """SIGTERM: finish the step, checkpoint, exit."""
        self.signalled = True
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def wait(self) -> int:
        return await self.proc.wait()


class WorkerPool:
    """Keeps up to ``spares`` warm worker processes; :meth:`acquire` returns one.

    Taking a spare does not start its replacement: the caller calls :meth:`refill` once its
    workers are set up, so that a replacement's imports do not slow a starting copy down.
    """

    def __init__(self, *, python: str = sys.executable, spares: int = 1) -> None:
        self.python = python
        self.spares = spares
        self._ready: list[WorkerProcess] = []
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self) -> None:
        self.refill()

    async def acquire(self) -> WorkerProcess:
        while self._ready:
            worker = self._ready.pop(0)
            if worker.alive:
                return worker
        return await WorkerProcess.spawn(self.python)

    def refill(self) -> None:
        """Start spares until ``spares`` are ready or starting."""
        while not self._closed and len(self._ready) + len(self._starting) < self.spares:
            task = asyncio.create_task(self._spawn_spare())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _spawn_spare(self) -> None:
        try:
            worker = await WorkerProcess.spawn(self.python)
        except OSError:
            return
        if self._closed:
            await _discard(worker)
        else:
            self._ready.append(worker)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._starting):
            await asyncio.gather(task, return_exceptions=True)
        spares, self._ready = self._ready, []
        for worker in spares:
            await _discard(worker)


async def _discard(worker: WorkerProcess) -> None:
    """End an idle spare. It holds no work, so SIGKILL is safe and does not wait for its imports."""
    worker.kill()
    await worker.wait()
