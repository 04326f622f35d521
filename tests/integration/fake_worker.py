"""A stand-in for ``python -m services.agent.worker`` that speaks the worker protocol without torch.

Reads one WorkerSpec (JSON) from stdin, reports ``started``, "trains" one step every
``STEP_S`` seconds (reporting ``progress`` every ``progress_s``) until the step budget, the
deadline or SIGTERM, then reports ``finished`` (``ok``/``preempted``) with the spec's
checkpoint key; it writes no checkpoint. A spec whose model is ``crash`` exits with code 3
without reporting. Starts in tens of milliseconds, so agent tests can run many copies.

Run through an executable wrapper (see ``fake_python`` in the tests): the daemon starts it
as ``PYTHON -m services.agent.worker`` and the wrapper ignores those arguments.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

STEP_S = 0.01
stop = False


def on_term(*_: Any) -> None:
    global stop
    stop = True


def emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": kind, **fields}) + "\n")
    sys.stdout.flush()


def main() -> int:
    signal.signal(signal.SIGTERM, on_term)
    text = sys.stdin.read()
    if not text.strip():
        return 0
    spec = json.loads(text)
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
    emit("finished", status="preempted" if stop else "ok", steps_round=steps, steps_total=steps,
         samples_per_s=100.0, loss=1.0, checkpoint=spec["checkpoint"] if spec["rank"] == 0 else None,
         train_s=time.time() - began, metric=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
