"""The system end to end on the secured broker and MinIO (``hadar infra up --secure``):
every service is its own process logged in as its own principal, one job is submitted by
the CLI principal and completes, its final model downloads with the CLI's S3 keys, and no
secret value appears on any process's command line or in any log line of the run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.bus import KafkaBus
from shared.bus.settings import kafka_from_env
from shared.wire.events import JobCompleted
from shared.wire.topics import MODELS
from tests.e2e.processes import stop_services

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HADAR = [sys.executable, "-m", "services.cli.main"]
RUN_TIMEOUT_S = 300


def principal_env(secure_servers, principal: str) -> dict[str, str]:
    """Only what a deployment would give this principal (no settings of the test's own)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HADAR_")}
    return {**base, **secure_servers.env[principal], "PYTHONPATH": str(ROOT)}


async def completed(secure_servers, job_id: str) -> bool:
    settings = kafka_from_env(secure_servers.env["admin"])
    bus = KafkaBus.from_settings(settings, source="e2e-secure")
    await bus.start()
    try:
        return any([isinstance(d.event, JobCompleted) and d.event.job_id == job_id async for d in bus.read(MODELS)])
    finally:
        await bus.stop()


def leaked_on_command_lines(secrets: frozenset[str]) -> list[str]:
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(secret in line for secret in secrets):
            found.append(f"pid {path.parent.name}")   # never the line itself: it holds a secret
    return found


def test_a_job_completes_with_every_service_as_its_own_principal(secure_servers, tmp_path: Path) -> None:
    job_id = f"secure-e2e-{os.getpid()}"
    procs: list[subprocess.Popen] = []
    leaks: list[str] = []

    def serve(principal: str, *args: str) -> None:
        log = open(tmp_path / f"{principal}.log", "w")  # noqa: SIM115 - the child process writes to it until it exits
        procs.append(subprocess.Popen([*HADAR, "serve", principal, *args, "--http-port", "0"],
                                      env=principal_env(secure_servers, principal), cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))

    try:
        submitted = subprocess.run(
            [*HADAR, "submit", "--id", job_id, "--model", "resnet", "--dataset", "diabetes", "--workers", "1",
             "--iterations", "20", "--batch-size", "32"],
            env=principal_env(secure_servers, "cli"), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert submitted.returncode == 0, submitted.stderr
        serve("scheduler", "--round-s", "4", "--heartbeat-s", "1", "--consolidation-wait-s", "20")
        serve("tracker")
        serve("profiler")
        serve("agent", "--node-id", "secure-a", "--emulate", "t4:1", "--heartbeat-s", "1", "--progress-s", "1")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        done = False
        while time.monotonic() < deadline and not done:
            time.sleep(2)
            leaks += leaked_on_command_lines(secure_servers.secrets)
            for p in procs:
                assert p.poll() is None, f"a service exited early (code {p.returncode}); logs in {tmp_path}"
            done = asyncio.run(completed(secure_servers, job_id))
        assert done, f"the job did not complete in {RUN_TIMEOUT_S} s; logs in {tmp_path}"
        out = tmp_path / "final.safetensors"
        got = subprocess.run([*HADAR, "model", job_id, "--out", str(out)], env=principal_env(secure_servers, "cli"),
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        assert out.stat().st_size > 0
    finally:
        stop_services(procs)
    assert not leaks, f"a secret was on the command line of {sorted(set(leaks))}"
    for log in tmp_path.glob("*.log"):
        text = log.read_text(errors="replace")
        assert text.strip(), log.name
        assert not any(secret in text for secret in secure_servers.secrets), f"a secret is in {log.name}"
        # A read the ACLs forgot shows only as the client's warning (an empty topic reads fine).
        assert "Not authorized" not in text, f"{log.name}: a read or write the principals table does not allow"
