"""Service processes of the end-to-end tests: how a test ends them.

Each service runs in its own session (``start_new_session=True``), so its process group
holds its workers too; signalling the group ends them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable

__all__ = ["stop_services"]


def stop_services(procs: Iterable[subprocess.Popen], *, timeout_s: float = 60.0) -> None:
    """SIGTERM the process group of every service still running, give each ``timeout_s`` to
    exit (a clean shutdown: rounds finished or abandoned, logs flushed), then SIGKILL the
    group of any that did not."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
