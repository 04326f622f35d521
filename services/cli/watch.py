"""``hadar watch``: follow one job until it finishes, without a consumer group.

Exit codes: 0 the job completed; 1 it was cancelled; 2 (a :class:`UsageError`) no such
job appeared within ``wait_s``. The outcome is decided on a whole-log fold, never on a
partial stream: a cancellation is confirmed by one more poll before it is reported, since
a completion published before it may only show in the next read.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import TextIO

from services.cli.follow import ClusterView, LogFollower
from services.cli.jobview import job_doc, progress_line, waiting_reason
from shared.bus import Bus
from shared.clock import SystemClock
from shared.errors import UsageError

__all__ = ["watch_job", "RATE_WINDOW_S"]

RATE_WINDOW_S = 30.0   # steps/s is measured over this much of the recent past


class _Bar:
    """Progress lines: redrawn in place on a terminal, one line per change elsewhere."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._tty = bool(stream is not None and stream.isatty())
        self._last = ""

    def show(self, line: str) -> None:
        if self._stream is None or line == self._last:
            return
        self._last = line
        self._stream.write(("\r" + line) if self._tty else line + "\n")
        self._stream.flush()

    def end(self) -> None:
        if self._stream is not None and self._tty and self._last:
            self._stream.write("\n")
            self._stream.flush()


async def watch_job(bus: Bus, job_id: str, *, wait_s: float, poll_s: float, as_json: bool) -> int:
    """Follow ``job_id``; with ``as_json`` print only its final :func:`job_doc` on stdout
    (the bar goes to stderr, and only on a terminal)."""
    clock = SystemClock()
    follower = LogFollower(bus)
    bar = _Bar((sys.stderr if sys.stderr.isatty() else None) if as_json else sys.stdout)
    deadline = clock.time() + wait_s
    samples: list[tuple[float, int]] = []
    cancel_seen = False
    while True:
        view: ClusterView = await follower.poll()
        now = clock.time()
        job = view.state.jobs.get(job_id)
        if job is None:
            if now >= deadline:
                raise UsageError(f"job: no job {job_id!r} (waited {wait_s:g} s; --wait-s to wait longer)")
            await asyncio.sleep(poll_s)
            continue
        samples.append((now, job.progress_steps()))
        samples[:] = [s for s in samples if s[0] >= now - RATE_WINDOW_S]
        dt = samples[-1][0] - samples[0][0]
        rate = (samples[-1][1] - samples[0][1]) / dt if dt > 0 else 0.0
        bar.show(progress_line(job, rate, waiting=waiting_reason(view.state, job)))
        if job.state == "completed" or (job.state == "cancelled" and cancel_seen):
            bar.end()
            if as_json:
                print(json.dumps(job_doc(view.state, job_id, now=now, cancelled_at=view.cancelled_at,
                                         training=view.training), indent=2))
            return 0 if job.state == "completed" else 1
        cancel_seen = job.state == "cancelled"
        await asyncio.sleep(0.0 if cancel_seen else poll_s)
