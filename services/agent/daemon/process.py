"""Worker subprocesses: spawning, talking to them, signalling them, keeping them warm.

A worker process imports torch before it reads its spec (seconds on a busy machine), so
the daemon keeps ``spares`` processes started ahead of need: an assignment takes a warm
one and a replacement starts in the background. Once a worker has taken a spec it belongs
to a GPU's slot (:class:`WorkerSlots`, rules in :mod:`services.agent.slots`) and, for a
copy whose rank layout is known (every single-rank copy, every DDP copy within this node, a
spanning copy whose Assignment names its peers), outlives the round: it takes the next
round's spec on its stdin and reloads the consolidated weights in place, keeping its
process group.

The control channel is the worker's stdin, one JSON object a line: a spec, or
``{"stop": [job, round, copy]}`` (finish the step, checkpoint, report, stay warm). Closing
stdin tells an idle worker to exit. SIGTERM still means "stop, checkpoint, exit" (a
one-shot worker, or a worker whose control channel is gone). That is safe for GPUs because a worker
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

import structlog

from services.agent.protocol import WorkerSpec, parse_worker_line, stop_line
from services.agent.slots import (
    EMPTY,
    Decision,
    Slot,
    on_assign_copy,
    on_copy_done,
    stale_peers,
    warm_key,
)

__all__ = ["PROJECT_ROOT", "child_env", "WorkerProcess", "WorkerPool", "WorkerSlots"]

PROJECT_ROOT = Path(__file__).resolve().parents[3]
LINE_LIMIT = 1 << 20
RETIRE_WAIT_S = 5.0   # an idle worker told to exit (stdin closed) is killed after this


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, with the project importable and ``extra`` applied."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class WorkerProcess:
    """One ``python -m services.agent.worker.main`` child."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.signalled = False

    @classmethod
    async def spawn(cls, python: str = sys.executable) -> WorkerProcess:
        proc = await asyncio.create_subprocess_exec(
            python, "-m", "services.agent.worker.main", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=child_env(), cwd=str(PROJECT_ROOT),
            start_new_session=True, limit=LINE_LIMIT)
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def send(self, spec: WorkerSpec, *, keep_open: bool = False) -> None:
        """Hand the worker its spec; close its stdin unless it is to stay warm for the next one."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(spec.to_json().encode() + b"\n")
        await self.proc.stdin.drain()
        if not keep_open:
            self.proc.stdin.close()

    def stop(self, copy: tuple[str, int, int]) -> bool:
        """Ask the worker to stop ``copy`` (checkpoint, report, stay warm); False if the
        control channel is closed (the caller signals instead)."""
        stdin = self.proc.stdin
        if stdin is None or stdin.is_closing() or not self.alive:
            return False
        try:
            stdin.write(stop_line(copy).encode() + b"\n")
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def retire(self) -> None:
        """End an idle worker: close its control channel, SIGKILL it if it lingers."""
        stdin = self.proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), RETIRE_WAIT_S)
        except TimeoutError:
            self.kill()
            await self.proc.wait()

    async def messages(self) -> AsyncIterator[dict[str, Any]]:
        """Protocol messages until the worker closes its stdout (a warm worker does not
        between specs: stop reading at its final message); other lines are skipped."""
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


class WorkerSlots:
    """The worker process of each GPU slot of this node, kept across rounds.

    :meth:`take` gives the processes that run one copy's specs on its slots (the same ones
    as last round when the slots' rules say ``reuse``; spares or new ones otherwise, after
    retiring the old); :meth:`release` hands them back when their specs ended. The
    decisions are :func:`services.agent.slots.on_assign_copy` /
    :func:`~services.agent.slots.on_copy_done`: a DDP copy's ranks are kept or replaced
    together.
    """

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._slots: dict[int, Slot] = {}
        self._procs: dict[int, WorkerProcess] = {}
        self.log = structlog.get_logger()

    def slot(self, index: int) -> Slot:
        return self._slots.get(index, EMPTY)

    def process(self, index: int) -> WorkerProcess | None:
        return self._procs.get(index)

    def _checked(self, index: int) -> Slot:
        """The slot, emptied (and logged) if its idle worker died between rounds."""
        slot, proc = self.slot(index), self._procs.get(index)
        if slot.state == "idle" and (proc is None or not proc.alive):
            code = None if proc is None else proc.proc.returncode
            self.log.warning("slot.crashed", gpu=index, while_="idle", exit_code=code,
                             note="the slot's warm worker died between rounds; respawning")
            self._procs.pop(index, None)
            slot = self._slots[index] = Slot(generation=slot.generation)
        return slot

    async def take(self, indices: list[int], specs: list[WorkerSpec]) -> list[tuple[WorkerProcess, Decision]]:
        """The processes for one copy's specs (one per slot in ``indices``), with the decisions."""
        slots = [self._checked(i) for i in indices]
        decisions = on_assign_copy(slots, [warm_key(spec) for spec in specs])
        replaced = [i for i, d in zip(indices, decisions) if d.action != "reuse" and i in self._procs]
        stale = stale_peers(self._slots, replaced)
        for index in stale:
            self.log.info("slot.retired", gpu=index, pid=self._procs[index].pid,
                          note="a peer rank of its process group was replaced")
            self._slots[index] = Slot(generation=self._slots[index].generation)
        retiring = [self._procs.pop(i) for i in replaced + stale]
        await asyncio.gather(*(old.retire() for old in retiring))   # a group's ranks end together
        taken = []
        try:
            for index, decision in zip(indices, decisions, strict=True):
                proc = self._procs.get(index) if decision.action == "reuse" else await self.pool.acquire()
                assert proc is not None
                self._slots[index], self._procs[index] = decision.slot, proc
                taken.append((proc, decision))
        except BaseException:   # could not start a rank: none of the copy's slots stays taken
            for index in indices:
                proc = self._procs.pop(index, None)
                if proc is not None:
                    proc.kill()
                self._slots[index] = Slot(generation=self.slot(index).generation)
            raise
        return taken

    def release(self, indices: list[int], *, reported: list[bool]) -> list[bool]:
        """One copy's specs ended (``reported``: with a clean ``finished``); which crashed."""
        procs = [self._procs.get(i) for i in indices]
        done = on_copy_done([self.slot(i) for i in indices], reported=reported,
                            alive=[p is not None and p.alive for p in procs])
        for index, proc, result in zip(indices, procs, done, strict=True):
            self._slots[index] = result.slot
            if result.slot.state == "empty" and proc is not None:
                self._procs.pop(index, None)
                if result.torn_down:
                    self.log.warning("slot.torn_down", gpu=index, pid=proc.pid,
                                     note="a peer rank of its copy did not finish cleanly; respawning next time")
                if proc.alive:
                    proc.kill()   # its state is unknown (or a one-shot worker that lingers, or a torn-down peer)
        return [d.crashed for d in done]

    async def close(self) -> None:
        """Retire every idle worker (the daemon stops only after every copy run ended)."""
        procs, self._procs = list(self._procs.values()), {}
        self._slots.clear()
        await asyncio.gather(*(p.retire() for p in procs), return_exceptions=True)
