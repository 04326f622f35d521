"""The system end to end on the secured broker and MinIO (``hadar infra up --secure``):
every service is its own process logged in as its own principal, one job is submitted by
the CLI principal and completes, its final model downloads with the CLI's S3 keys, and no
secret value appears on any process's command line or in any log line of the run.

The agent seals its records with its node's credential and logs in to Kafka and MinIO with
the node's own logins (issue 26); once the job is done, a process holding that credential
and those logins forges records for another node, and a revoked node speaks: every service
that reads them refuses each one with its reason, and the scheduler still counts one live
node."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.bus import KafkaBus
from shared.bus.settings import kafka_from_env
from shared.security.authorship import Sealer
from shared.security.identities import Credential, revoke
from shared.security.own_logins import own_login_env
from shared.wire.events import (
    CopyFinished,
    DeadLetter,
    Event,
    GpuInfo,
    JobCancelled,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    NodeHeartbeat,
    NodeRegistered,
    topic_for,
)
from shared.wire.topics import DEADLETTER, MODELS
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


def enrol_node(secure_servers, node: str, tmp_path: Path, kind: str = "node") -> tuple[Credential, Path]:
    """Enrol as the admin does, with ``hadar identity enrol``: a node also gets its store login."""
    env = secure_servers.env["admin"]
    path = tmp_path / f"{kind}-{node}.identity"
    done = subprocess.run([*HADAR, "identity", "enrol", kind, node, "--master-key-file",
                           env["HADAR_AUTHORSHIP_KEY_FILE"], "--registry", env["HADAR_AUTHORSHIP_REGISTRY"],
                           "--out", str(path)], env=principal_env(secure_servers, "admin"), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return Credential.read(path), path


async def forge(events: list[tuple[Credential | None, Event]], node_env: dict[str, str],
                user_env: dict[str, str]) -> set[tuple[str, int, int]]:
    """Publish each event sealed with the credential given (None: unsealed), with the Kafka
    login that may write its topic: a user's record as the user of ``user_env``, the rest as
    the node of ``node_env`` (compromised: each holds its own credential and logins). Returns
    where each landed (topic, partition, offset): the shared broker holds other tests' records."""
    landed: set[tuple[str, int, int]] = set()
    for principal, env in (("agent", node_env), ("cli", user_env)):
        bus = KafkaBus.from_settings(kafka_from_env(env), source=f"forger-{principal}")
        await bus.start()
        try:
            for credential, event in events:
                if (principal == "cli") == isinstance(event, (JobSubmitted, JobCancelled)):
                    bus.sealer = Sealer(credential) if credential is not None else None
                    landed.add((topic_for(event), *await bus.publish(event)))
        finally:
            await bus.stop()
    return landed


async def dead_letters(secure_servers) -> list[DeadLetter]:
    bus = KafkaBus.from_settings(kafka_from_env(secure_servers.env["admin"]), source="e2e-secure")
    await bus.start()
    try:
        return [d.event async for d in bus.read(DEADLETTER) if isinstance(d.event, DeadLetter)]
    finally:
        await bus.stop()


def scrape(log: Path) -> str:
    port = next(json.loads(line)["port"] for line in log.read_text().splitlines() if '"http.listening"' in line)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


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

    def serve(principal: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = open(tmp_path / f"{principal}.log", "w")  # noqa: SIM115 - the child process writes to it until it exits
        procs.append(subprocess.Popen([*HADAR, "serve", principal, *args, "--http-port", "0"],
                                      env={**principal_env(secure_servers, principal), **(env or {})}, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        _, identity_alice = enrol_node(secure_servers, "alice", tmp_path, kind="user")
        submitted = subprocess.run(
            [*HADAR, "submit", "--id", job_id, "--model", "resnet", "--dataset", "diabetes", "--workers", "1",
             "--iterations", "20", "--batch-size", "32"],
            env={**principal_env(secure_servers, "cli"), "HADAR_IDENTITY_FILE": str(identity_alice)}, cwd=ROOT,
            capture_output=True, text=True, timeout=120)
        assert submitted.returncode == 0, submitted.stderr
        serve("scheduler", "--round-s", "4", "--heartbeat-s", "1", "--consolidation-wait-s", "20")
        serve("tracker")
        serve("profiler")
        node_a, identity_a = enrol_node(secure_servers, "secure-a", tmp_path)
        agent_env = {"HADAR_IDENTITY_FILE": str(identity_a)}
        serve("agent", "--node-id", "secure-a", "--emulate", "t4:1", "--heartbeat-s", "1", "--progress-s", "1",
              env=agent_env)
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
        # the final model is alice's: the cluster's local user may not read it, alice may
        other = subprocess.run([*HADAR, "model", job_id, "--out", str(out)], env=principal_env(secure_servers, "cli"),
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert other.returncode == 2 and f"the final model of {job_id!r} is not yours" in other.stderr, other.stderr
        assert len(other.stderr.strip().splitlines()) == 1 and not out.exists()
        got = subprocess.run([*HADAR, "model", job_id, "--out", str(out)],
                             env={**principal_env(secure_servers, "cli"), "HADAR_IDENTITY_FILE": str(identity_alice)},
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        assert out.stat().st_size > 0
        refused = impersonate(secure_servers, node_a, job_id, tmp_path)
        assert sum(r.startswith("authorship: ") for r in refused.values()) == len(refused) - 1, refused
        assert any("user 'bob' may not cancel job" in r for r in refused.values()), refused
        metrics = scrape(tmp_path / "scheduler.log")
        assert 'hadar_scheduler_nodes{state="live"} 1.0' in metrics   # the forged registration never counted
        for reason in ("other_author", "unsealed", "not_enrolled"):   # counted by the scheduler
            line = next(x for x in metrics.splitlines()
                        if x.startswith(f'hadar_scheduler_records_refused_authorship_total{{reason="{reason}"}}'))
            assert float(line.split()[-1]) >= 1, metrics
    finally:
        stop_services(procs)
    assert not leaks, f"a secret was on the command line of {sorted(set(leaks))}"
    for log in tmp_path.glob("*.log"):
        text = log.read_text(errors="replace")
        assert text.strip(), log.name
        assert not any(secret in text for secret in secure_servers.secrets), f"a secret is in {log.name}"
        # A read the ACLs forgot shows only as the client's warning (an empty topic reads fine).
        assert "Not authorized" not in text, f"{log.name}: a read or write the principals table does not allow"


def impersonate(secure_servers, node_a: Credential, job_id: str, tmp_path: Path) -> dict[tuple[str, int, int], str]:
    """Forge as node secure-a for node secure-b, unsealed, as a revoked node, as user bob for
    alice (who submitted the job), and as a revoked user; return the scheduler's dead letters of the forged
    records (origin -> reason) once it refused all of them."""
    revoked, _ = enrol_node(secure_servers, "secure-r", tmp_path)
    bob, _ = enrol_node(secure_servers, "bob", tmp_path, kind="user")
    carol, _ = enrol_node(secure_servers, "carol", tmp_path, kind="user")
    revoke("user/carol", registry_path=Path(secure_servers.env["admin"]["HADAR_AUTHORSHIP_REGISTRY"]))
    revoke("node/secure-r", registry_path=Path(secure_servers.env["admin"]["HADAR_AUTHORSHIP_REGISTRY"]))
    time.sleep(1.5)   # the services read the registry again at most every second
    gpu = (GpuInfo(index=0, type="v100", memory_gb=16.0),)
    forged: list[tuple[Credential | None, Event]] = [
        (node_a, NodeRegistered(ts=time.time(), source="agent/secure-b", node_id="secure-b", gpus=gpu)),
        (None, NodeHeartbeat(ts=time.time(), source="agent/secure-b", node_id="secure-b", seq=1)),
        (node_a, CopyFinished(ts=time.time(), source="agent/secure-b", job_id=job_id, round=0, copy=0,
                              node_id="secure-b", status="failed", steps_round=0)),
        (revoked, NodeRegistered(ts=time.time(), source="agent/secure-r", node_id="secure-r", gpus=gpu)),
        (bob, JobSubmitted(ts=time.time(), source="cli", submitted_at=time.time(),
                           job=JobSpec(job_id="bob-as-alice", user="alice", model="resnet", dataset="diabetes",
                                       batch_size=32, workers=1, iterations=20))),
        (bob, JobCancelled(ts=time.time(), source="cli", job_id=job_id, user="alice")),
        (bob, JobCancelled(ts=time.time(), source="cli", job_id=job_id, user="bob")),   # sealed right, not the owner
        (carol, JobSubmitted(ts=time.time(), source="cli", submitted_at=time.time(),   # a revoked user
                             job=JobSpec(job_id="revoked-carol", user="carol", model="resnet", dataset="diabetes",
                                         batch_size=32, workers=1, iterations=20))),
    ]
    node_env = own_login_env({**secure_servers.env["agent"],
                              "HADAR_IDENTITY_FILE": str(tmp_path / "node-secure-a.identity")})
    user_env = own_login_env({**secure_servers.env["cli"], "HADAR_IDENTITY_FILE": str(tmp_path / "user-bob.identity")})
    landed = asyncio.run(forge(forged, node_env, user_env))
    assert len(landed) == len(forged)
    deadline = time.monotonic() + 60
    while True:
        letters = {(dl.topic, dl.partition, dl.offset): dl.reason for dl in asyncio.run(dead_letters(secure_servers))
                   if dl.source.startswith("scheduler") and (dl.topic, dl.partition, dl.offset) in landed}
        if len(letters) >= len(forged) or time.monotonic() > deadline:
            assert len(letters) == len(forged), letters
            return letters
        time.sleep(1)
