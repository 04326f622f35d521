"""The whole system end to end on real Kafka and MinIO, every service its own process.

Three jobs are submitted with the CLI, three emulated agents of different GPU types
train them, and the checks come from the event log and the store alone: every job
completes, samples are conserved, every consolidated model is the samples-weighted average
of its round's replicas, and ``hadar model`` downloads the final model. The same jobs
under ``gavel`` leave GPUs idle, in rounds that run jobs, that ``hadare`` fills with copies.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch_file

from devinfra import InfraError, InfraPaths, ensure_kafka, stop_server
from services.scheduler.live.state import fold_log
from shared.bus import KafkaBus
from shared.bus.eventlog import fetch_log
from shared.domain.layout import checkpoint_key
from shared.runtime.logging import STABLE_KEYS
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import Assignment, JobCompleted, ModelConsolidated
from shared.zoo import build_from_metadata
from tests.e2e.processes import stop_services

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HADAR = [sys.executable, "-m", "services.cli.main"]
AGENTS = (("e2e-t4", "t4"), ("e2e-rtx3090", "rtx3090"), ("e2e-a2000", "a2000"))
# The digits job needs many more rounds than the others on any emulated GPU (its rate is
# low), so once the short jobs finish HadarE has work to fork onto their idle GPUs.
JOBS = (("resnet", "digits", 3000), ("resnet", "diabetes", 400), ("autoencoder", "synthetic-ratings", 1500))
RUN_TIMEOUT_S = 480


@dataclass
class Run:
    policy: str
    env: dict[str, str]
    job_ids: list[str]
    log: list
    settings: S3Settings
    workdir: Path


def _env(bootstrap: str, s3: S3Settings, bucket: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HADAR_BOOTSTRAP=bootstrap, HADAR_S3_ENDPOINT=s3.endpoint, HADAR_S3_ACCESS_KEY=s3.access_key,
               HADAR_S3_SECRET_KEY=s3.secret_key, HADAR_S3_BUCKET=bucket, PYTHONPATH=str(ROOT))
    return env


def _hadar(args: list[str], env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(HADAR + args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


def _service(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    fh = open(log, "w")  # noqa: SIM115 - the child process writes to it until it exits
    return subprocess.Popen(HADAR + ["serve", *args, "--http-port", "0"], env=env,
                            cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


async def _read_log(bootstrap: str) -> list:
    return [(r.topic, r.event) for r in await fetch_log(KafkaBus(bootstrap, source="e2e-test"))]


def _completed(records: list, job_ids: list[str]) -> set[str]:
    return {e.job_id for _, e in records if isinstance(e, JobCompleted) and e.job_id in job_ids}


def _not_json_lines(workdir: Path) -> list[str]:
    """Lines of the services' logs (stdout and stderr, their workers' too) that are not JSON
    objects with the stable keys."""
    bad = []
    for path in sorted(workdir.glob("*.log")):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not (isinstance(record, dict) and record.keys() >= STABLE_KEYS):
                bad.append(f"{path.name}:{n}: {line[:200]}")
    return bad


def _run_system(policy: str, tmp: Path, paths: InfraPaths, s3: S3Settings) -> Run:
    try:
        kafka, _ = ensure_kafka(paths)
    except InfraError as exc:
        pytest.fail(f"kafka could not start: {exc}")
    bucket = f"e2e-{policy}-{secrets.token_hex(3)}"
    env = _env(kafka.bootstrap, s3, bucket)
    tmp.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(2)
    job_ids = []
    procs: list[subprocess.Popen] = []
    try:
        # Bad input: one-line error naming the field, exit 2, nothing published.
        bad = _hadar(["submit", "--model", "resnet", "--dataset", "digits", "--workers", "99",
                      "--iterations", "10"], env)
        assert bad.returncode == 2 and "workers" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
        for i, (model, dataset, iterations) in enumerate(JOBS):
            job_id = f"e2e-{policy}-{i}-{token}"
            done = _hadar(["submit", "--id", job_id, "--model", model, "--dataset", dataset, "--workers", "1",
                           "--iterations", str(iterations), "--batch-size", "32", "--optimizer", "adam",
                           "--lr", "0.003"], env)
            assert done.returncode == 0, done.stderr
            job_ids.append(job_id)
        procs.append(_service(["scheduler", "--policy", policy, "--round-s", "15", "--heartbeat-s", "1",
                               "--late-copy-s", "120", "--consolidation-wait-s", "30"], env, tmp / "scheduler.log"))
        # Every round's model is checked below against its replicas, so nothing is deleted here
        # (deletion is covered by tests/integration/test_tracker_lifecycle.py, on MinIO too).
        procs.append(_service(["tracker", "--keep-checkpoints", "--keep-round-models", "1000000",
                               "--keep-round-models-after-completion"], env, tmp / "tracker.log"))
        procs.append(_service(["profiler"], env, tmp / "profiler.log"))
        for node_id, gpu_type in AGENTS:
            procs.append(_service(["agent", "--node-id", node_id, "--emulate", f"{gpu_type}:1", "--heartbeat-s", "1",
                                   "--progress-s", "1", "--deadline-grace-s", "10", "--stop-timeout-s", "10"],
                                  env, tmp / f"agent-{node_id}.log"))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        records: list = []
        while time.monotonic() < deadline:
            time.sleep(3)
            for p in procs:
                assert p.poll() is None, f"a service exited early (code {p.returncode}); logs in {tmp}"
            records = asyncio.run(_read_log(kafka.bootstrap))
            if _completed(records, job_ids) == set(job_ids):
                break
        assert _completed(records, job_ids) == set(job_ids), f"jobs did not complete in time; logs in {tmp}"
    finally:
        stop_services(procs)
        records = asyncio.run(_read_log(kafka.bootstrap))
        stop_server(paths, "kafka")
    bad = _not_json_lines(tmp)
    assert not bad, f"{len(bad)} service log lines are not JSON objects with {sorted(STABLE_KEYS)}: {bad[:5]}"
    return Run(policy=policy, env=env, job_ids=job_ids, log=records,
               settings=S3Settings(endpoint=s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key,
                                   bucket=bucket), workdir=tmp)


def _busy_utilization(run: Run) -> float:
    """GPU-seconds assigned / offered over the rounds that ran anything: the share of the
    cluster a policy fills while it has work placed. Rounds that place nothing are left out:
    round 0 (no estimate yet) and a last round planned while the final models are still
    being consolidated. Counting them (``allocation_utilization``) charges a policy that
    finishes in fewer rounds for the same idle tail: both policies once tied at 0.5, HadarE
    done in two working rounds at 3/3 GPUs, gavel in three at 3, 2 and 1."""
    state = fold_log(run.log)
    offered = assigned = 0.0
    for record in state.rounds.values():
        gpus = sum(len(a.gpus) for a in record.assignments)
        if gpus:
            seconds = record.started.ends_at - record.started.started_at
            offered += seconds * sum(len(state.nodes[n].registered.gpus) for n in record.started.nodes
                                     if n in state.nodes)
            assigned += seconds * gpus
    assert offered > 0, f"{run.policy}: no round ran anything"
    return assigned / offered


async def _check_models(run: Run) -> None:
    store = MinioStore(run.settings)
    await store.start()
    try:
        consolidated = [e for _, e in run.log if isinstance(e, ModelConsolidated) and e.job_id in run.job_ids]
        completed = {e.job_id: e for _, e in run.log if isinstance(e, JobCompleted)}
        # A copy's workers k (its world size) and the job's W, from the placements.
        placed = {(e.job_id, e.round, e.copy): (e.world_size, e.job.workers)
                  for _, e in run.log if isinstance(e, Assignment)}
        # The node that ran a copy's rank 0: it wrote the copy's checkpoint, under its own node segment.
        rank0 = {(e.job_id, e.round, e.copy): e.node_id
                 for _, e in run.log if isinstance(e, Assignment) and 0 in e.ranks}
        iterations = {e.job.job_id: e.job.iterations for _, e in run.log if isinstance(e, Assignment)}
        for job_id in run.job_ids:
            rounds = sorted((e for e in consolidated if e.job_id == job_id), key=lambda e: e.round)
            assert rounds, f"{job_id}: no consolidated model"
            # Samples conserved (docs/architecture.md "Work accounting"): the job's worker-steps
            # are the sum over its rounds of its copies' steps x k, credited up to W x iterations
            # (never more than the job asked for); its total steps are those // W.
            workers = {(e.round, c.copy): placed[(job_id, e.round, c.copy)] for e in rounds for c in e.copies}
            (job_workers,) = {w for _, w in workers.values()}
            summed = sum(c.steps * workers[(e.round, c.copy)][0] for e in rounds for c in e.copies)
            credited = min(summed, job_workers * iterations[job_id])
            assert rounds[-1].total_steps == credited // job_workers == completed[job_id].total_steps
            for event in rounds:
                copy_workers = {c.copy: workers[(event.round, c.copy)][0] for c in event.copies}
                writers = {c.copy: rank0[(job_id, event.round, c.copy)] for c in event.copies}
                await _check_average(store, event, copy_workers, run.workdir / "check", writers=writers)
        last = rounds[-1]
        out = run.workdir / "final.safetensors"
        got = _hadar(["model", run.job_ids[-1], "--out", str(out)], run.env)
        assert got.returncode == 0, got.stderr
        final = load_file(str(out))
        model = load_file(str(await _fetch(store, last.key, run.workdir / "check" / "last.safetensors")))
        assert final.keys() == model.keys() and all(np.array_equal(final[k], model[k]) for k in final)
        # README "Using a model": weights only, and the module its metadata names takes them strictly.
        module = build_from_metadata(safe_open(str(out), "pt").metadata())
        module.load_state_dict(load_torch_file(str(out)), strict=True)
    finally:
        await store.stop()


async def _fetch(store: MinioStore, key: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    await store.get_file(key, path)
    return path


async def _check_average(store: MinioStore, event: ModelConsolidated, workers: dict[int, int],
                         tmp: Path, *, writers: dict[int, str]) -> None:
    """Recompute the samples-weighted average (steps x the copy's ``workers``; equal weights
    when every copy did 0 steps, as ``services/tracker/averaging/weighing.py`` states) from
    the stored replicas; compare with the model. A copy's replica is the checkpoint under
    the node ``writers`` names (the node that ran its rank 0)."""
    model = load_file(str(await _fetch(store, event.key, tmp / "model.safetensors")))
    replicas = []
    for c in event.copies:
        key = checkpoint_key(event.job_id, event.round, c.copy, node=writers[c.copy])
        replicas.append((c.steps, c.steps * workers[c.copy],
                         load_file(str(await _fetch(store, key, tmp / f"{c.copy}.safetensors")))))
    total = sum(samples for _, samples, _ in replicas)
    if total == 0:  # every copy did 0 steps (a slow start): the tracker's rule is equal weights
        replicas = [(steps, 1, tensors) for steps, _, tensors in replicas]
        total = len(replicas)
    most = min(zip(event.copies, replicas), key=lambda cr: (-cr[1][0], cr[0].copy))[1][2]
    for name, value in model.items():
        if np.issubdtype(value.dtype, np.integer):
            assert np.array_equal(value, most[name]), f"{event.key}:{name} not taken from the max-steps copy"
            continue
        expected = sum(t[name].astype(np.float64) * (samples / total) for _, samples, t in replicas)
        assert np.allclose(value.astype(np.float64), expected, rtol=1e-5, atol=1e-6), f"{event.key}:{name}"


def test_hadare_end_to_end_and_gavel_leaves_gpus_idle(tmp_path, infra_paths, s3_settings):
    hadare = _run_system("hadare", tmp_path / "hadare", InfraPaths(cache=infra_paths.cache, run=tmp_path / "k1"),
                         s3_settings)
    asyncio.run(_check_models(hadare))
    forked = [e for _, e in hadare.log if isinstance(e, ModelConsolidated) and len(e.copies) > 1]
    assert forked, "hadare never ran a job as more than one copy"

    gavel = _run_system("gavel", tmp_path / "gavel", InfraPaths(cache=infra_paths.cache, run=tmp_path / "k2"),
                        s3_settings)
    asyncio.run(_check_models(gavel))
    assert _busy_utilization(gavel) < _busy_utilization(hadare)
