"""A real ``hadar serve`` process writes JSON lines only: its own, aiokafka's, its crash's.

The profiler is pointed at a closed local port, so aiokafka logs the refused connection
(plain text before issue 17) and the service dies of the uncaught BusError (a raw
multi-line traceback before). No broker is needed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from shared.runtime.logging import STABLE_KEYS

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 30   # it exits by itself within seconds; SIGTERM if it has not


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_profiler_stderr_is_json_lines_with_stable_keys() -> None:
    env = {**os.environ, "HADAR_BOOTSTRAP": f"127.0.0.1:{_closed_port()}", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "serve", "profiler", "--http-port", "0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)

    assert out == ""
    lines = err.splitlines()
    assert lines
    records = []
    for line in lines:
        record = json.loads(line)   # raises on a line that is not JSON
        assert isinstance(record, dict) and record.keys() >= STABLE_KEYS, line
        assert record["service"] == "profiler", line
        records.append(record)
    assert any(r["logger"].startswith("aiokafka") for r in records), lines
    crash = [r for r in records if r["logger"] == "hadar.uncaught"]
    assert len(crash) == 1 and crash[0]["level"] == "critical"
    assert "BusError: cannot connect to kafka" in crash[0]["exception"]
    assert proc.returncode == 1
