"""A stand-in for ``python -m services.agent.worker.main`` that speaks the worker protocol
without torch.

Reads WorkerSpecs (JSON lines) from stdin until it closes; for each, reports ``started``,
"trains" one step every ``STEP_S`` seconds (reporting ``progress`` every ``progress_s``)
until the step budget, the deadline, a stop line for its copy or SIGTERM, then reports
``finished`` (``ok``/``preempted``) with the spec's checkpoint key; it writes no checkpoint.
Like the real worker it stays for the next spec of a single-rank copy and exits after SIGTERM
or a copy with a rendezvous. A spec whose model is ``crash`` exits with code 3 without
reporting; one whose model is ``slow-upload`` reports ``uploading`` after training and takes
``UPLOAD_S`` to "upload" its checkpoint (a store retrying through an outage), ignoring stop
requests and SIGTERM meanwhile, as the real worker does. Starts in tens of milliseconds, so
agent tests can run many copies.

Run through an executable wrapper (see ``fake_python`` in the tests): the daemon starts it
as ``PYTHON -m services.agent.worker.main`` and the wrapper ignores those arguments.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
from typing import Any

STEP_S = 0.01
UPLOAD_S = 3.0
stop = False
terminated = False
current: tuple[str, int, int] | None = None
stopped: set[tuple[str, int, int]] = set()
specs: queue.Queue[str | None] = queue.Queue()


def on_term(*_: Any) -> None:
    global stop, terminated
    stop = terminated = True


def read_control() -> None:
    global stop
    for line in sys.stdin:
        data = json.loads(line) if line.strip() else None
        if isinstance(data, dict) and "stop" in data:
            stopped.add(tuple(data["stop"]))
            if tuple(data["stop"]) == current:
                stop = True
        elif data is not None:
            specs.put(line)
    specs.put(None)


def emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": kind, **fields}) + "\n")
    sys.stdout.flush()


def main() -> int:
    global current, stop
    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=read_control, daemon=True).start()
    while not terminated:
        try:
            text = specs.get(timeout=0.1)
        except queue.Empty:
            continue
        if text is None:
            return 0
        spec = json.loads(text)
        current = (spec["job_id"], spec["round"], spec["copy"])
        stop = terminated or current in stopped
        code = run(spec)
        if code != 0 or terminated or spec["rendezvous"] is not None or spec["world_size"] != 1:
            return code
    return 0


def run(spec: dict[str, Any]) -> int:
    if spec["model"] == "crash":
        return 3
    emit("started", steps_round=0, steps_total=0, pid=0, setup_s=0.0, spec_wait_s=0.0)
    began = last = time.time()
    steps = 0
    while not stop and steps < spec["step_budget"] and time.time() < spec["deadline"]:
        time.sleep(STEP_S)
        steps += 1
        if spec["rank"] == 0 and time.time() - last >= spec["progress_s"]:
            last = time.time()
            emit("progress", steps_round=steps, steps_total=steps, samples_per_s=100.0, loss=1.0)
    if spec["model"] == "slow-upload" and spec["rank"] == 0:
        emit("uploading", key=spec["checkpoint"])
        time.sleep(UPLOAD_S)
    emit("finished", status="preempted" if stop else "ok", steps_round=steps, steps_total=steps,
         samples_per_s=100.0, loss=1.0, checkpoint=spec["checkpoint"] if spec["rank"] == 0 else None,
         train_s=time.time() - began, metric=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
