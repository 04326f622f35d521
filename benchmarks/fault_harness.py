"""A Hadar cluster of separate processes on its own Kafka and MinIO, for fault injection.

:class:`Cluster` starts a private Kafka broker and MinIO server (``devinfra``, in a run
directory of its own; binaries from the shared cache), every service as its own process
(``hadar serve scheduler|tracker|profiler|agent``, agents emulated on the CPU), submits
a small workload through ``hadar submit``, and lets a scenario kill, stop, continue and
restart any of them. :func:`figures` turns what the run left -- the event log and the
stored objects -- into the benchmark's figures. Used by ``benchmarks/faults.py`` and
``tests/e2e/test_faults.py``.

Figures (per scenario):

* ``jobs_completed``/``jobs_total``: jobs with a JobCompleted the harness did not forge.
* ``models_verified``/``models_total``: ModelConsolidated events whose stored model equals
  the samples-weighted average (steps x the copy's workers; uniform if no copy trained a
  step) recomputed from the stored replicas (integer tensors: the copy with the most
  steps), as ``services/tracker/averaging/consolidate.py`` and ``average.py`` define it.
* ``events_lost``: results produced but never consumed, followed along their chain: a
  JobSubmitted never placed nor listed waiting; a CopyFinished (not failed) of a round
  the tracker decided whose copy is in neither the model, its rejections nor a
  RoundAbandoned; a CopyFinished of a completed job's round that was never decided.
* ``rounds_lost_max``: per job, rounds it ran in whose model did not add steps (abandoned,
  undecided, or a model without progress); the maximum over jobs.
* ``recovery_s``: from the end of the fault (restart, SIGCONT; the kill when left dead) to
  the next model that added steps or job completed (None if none came after it).
* ``service_crashes``: service processes that exited without the harness stopping them.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np
from safetensors.numpy import load_file

from devinfra import InfraError, InfraPaths, down, restart, up
from devinfra.common import is_running
from services.cli.jobs import submit as submit_job
from shared.bus import KafkaBus
from shared.bus.eventlog import fetch_log
from shared.domain.layout import checkpoint_key, final_key
from shared.store import MinioStore
from shared.store.settings import S3Settings
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    Hyperparameters,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    LeaderRenewed,
    ModelConsolidated,
    NodeRegistered,
    RoundAbandoned,
    RoundStarted,
)

ROOT = Path(__file__).resolve().parents[1]
SCHEDULERS = ("scheduler", "scheduler-b")   # service names; with a standby, also their holder names
STEPPED_DOWN_EXIT = 3   # services/scheduler/cli.py: a replica taken over exits so, and is restarted
HADAR = [sys.executable, "-m", "services.cli.main"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one scenario runs: jobs ``(model, dataset, iterations)`` on emulated agents
    ``(node id, GPU type)``, and the timing settings every service gets."""

    jobs: tuple[tuple[str, str, int], ...] = (("resnet", "diabetes", 2500), ("autoencoder", "synthetic-ratings", 8000))
    agents: tuple[tuple[str, str], ...] = (("f-t4", "t4"), ("f-rtx3090", "rtx3090"))
    policy: str = "hadare"
    # Rounds well above a worker's start-up on a loaded machine (10-25 s seen on 2 cores).
    round_s: float = 30.0
    heartbeat_s: float = 1.0
    late_copy_s: float = 30.0
    consolidation_wait_s: float = 30.0
    timeout_s: float = 600.0
    # Two scheduler replicas ("scheduler" and "scheduler-b"), one active (--standby).
    standby: bool = False
    lease_ttl_s: float = 10.0


@dataclass
class Service:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    expected_exit: bool = False
    starts: int = 0
    crashes: list[int] = field(default_factory=list)
    terminated: bool = False   # SIGTERM sent to the current process


class Cluster:
    """One run: servers, services, a workload. Use as a context manager; everything it
    started is stopped on exit (servers' data removed with the run directory's owner)."""

    def __init__(self, workdir: Path, workload: Workload, *, cache: Path | None = None) -> None:
        self.workdir = workdir
        self.workload = workload
        self.paths = InfraPaths(cache=cache or InfraPaths.from_env().cache, run=workdir / "run")
        self.services: dict[str, Service] = {}
        self.job_ids: list[str] = []
        self.forged_ids: set[str] = set()
        self.env: dict[str, str] = {}
        self.s3: S3Settings | None = None
        self.bootstrap = ""
        self.last_fault_end = 0.0   # unix time the latest fault ended (scenarios wait for progress after it)
        self.restart_failures: list[str] = []   # failed `infra restart` tries, with why
        self.phases: dict[str, float] = {}   # seconds per phase of the run, in order (:meth:`phase`)
        self.step_downs: list[str] = []   # scheduler replicas that exited 3 (taken over), restarted
        self.takeovers: list[float] = []   # seconds from a fault on the active scheduler to its successor
        self._mark = time.monotonic()

    def phase(self, name: str) -> None:
        """Close the phase ``name``: the seconds since the previous one closed are added to it."""
        now = time.monotonic()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self._mark, 1)
        self._mark = now

    # ------------------------------------------------------------------ start, stop

    def __enter__(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._mark = time.monotonic()
        servers = up(self.paths)
        self.phase("servers_up")
        self.bootstrap = servers.kafka.bootstrap
        self.s3 = S3Settings(endpoint=servers.minio.endpoint, access_key=servers.minio.access_key,
                             secret_key=servers.minio.secret_key, bucket=f"faults-{secrets.token_hex(3)}")
        self.env = {**os.environ, "HADAR_BOOTSTRAP": self.bootstrap, "HADAR_S3_ENDPOINT": self.s3.endpoint,
                    "HADAR_S3_ACCESS_KEY": self.s3.access_key, "HADAR_S3_SECRET_KEY": self.s3.secret_key,
                    "HADAR_S3_BUCKET": self.s3.bucket, "PYTHONPATH": str(ROOT), "HADAR_RUN_DIR": str(self.paths.run)}
        w = self.workload
        # An upload at the round's end may ride out an outage until the tracker decides the
        # round (deadline + late_copy_s), no longer: grace (late/2) + upload (late/2).
        self.env["HADAR_AGENT_UPLOAD_GRACE_S"] = str(w.late_copy_s / 2)
        scheduler = ["scheduler", "--policy", w.policy, "--round-s", str(w.round_s), "--heartbeat-s",
                     str(w.heartbeat_s), "--late-copy-s", str(w.late_copy_s), "--consolidation-wait-s",
                     str(w.consolidation_wait_s)]
        for name in SCHEDULERS if w.standby else SCHEDULERS[:1]:
            standby = ["--standby", "--lease-ttl-s", str(w.lease_ttl_s), "--holder", name] if w.standby else []
            self._define(name, [*scheduler, *standby])
        # Every round's model is verified against its replicas: nothing is deleted.
        self._define("tracker", ["tracker", "--finish-timeout-s", str(w.late_copy_s), "--keep-checkpoints",
                                 "--keep-round-models", "1000000", "--keep-round-models-after-completion"])
        self._define("profiler", ["profiler"])
        for node_id, gpu in w.agents:
            self._define(f"agent:{node_id}", ["agent", "--node-id", node_id, "--emulate", f"{gpu}:1",
                                              "--heartbeat-s", str(w.heartbeat_s), "--progress-s", "1",
                                              "--deadline-grace-s", str(w.late_copy_s / 2),
                                              "--stop-timeout-s", "10"])
        return self

    def __exit__(self, *exc: object) -> None:
        running = [svc for svc in self.services.values() if svc.proc is not None and svc.proc.poll() is None]
        for svc in running:   # all told at once, then waited for: their shutdowns overlap
            self._terminate(svc, wait=False)
        for svc in running:
            self._terminate(svc)
        try:   # the servers' data and logs stay in the run directory, for a post-mortem
            down(self.paths, keep_data=True)
        except Exception:
            pass
        self.phase("stopped")

    def _define(self, name: str, args: list[str]) -> None:
        self.services[name] = Service(name=name, argv=HADAR + ["serve", *args, "--http-port", "0"])

    def start(self, name: str) -> None:
        """Start (or restart) one service; its output is appended to ``<name>.log``."""
        svc = self.services[name]
        log = open(self.workdir / f"{name.replace(':', '-')}.log", "a")  # noqa: SIM115 - the child process writes to it until it exits
        svc.proc = subprocess.Popen(svc.argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        svc.expected_exit = False
        svc.terminated = False
        svc.starts += 1

    def start_all(self) -> None:
        for name in self.services:
            self.start(name)

    def wait_registered(self, timeout_s: float = 300.0) -> None:
        """Wait until every agent has registered (so no round is planned on part of the cluster)."""
        nodes = {n for n, _ in self.workload.agents}
        self.wait(lambda r: nodes <= {e.node_id for _, e in r if isinstance(e, NodeRegistered)}, timeout_s=timeout_s,
                  poll_s=1.0)

    def submit(self) -> None:
        """Submit every job as ``hadar submit`` publishes one (:func:`services.cli.jobs.submit`),
        from this process. The specs pass JobSpec's own checks; the model zoo's (which
        imports torch: 12-20 s on the loaded 2-core machine) is left to the services."""
        token = secrets.token_hex(2)
        specs = [JobSpec(job_id=f"f-{i}-{token}", user="faults", model=model, dataset=dataset, batch_size=32,
                         workers=1, iterations=iterations, hyper=Hyperparameters(optimizer="adam", lr=0.003))
                 for i, (model, dataset, iterations) in enumerate(self.workload.jobs)]
        asyncio.run(_submit(self.bootstrap, specs))
        self.job_ids.extend(spec.job_id for spec in specs)

    # ------------------------------------------------------------------ faults

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send ``sig`` to a service's process group; a SIGKILL or SIGTERM is an expected exit."""
        svc = self.services[name]
        assert svc.proc is not None
        if sig in (signal.SIGKILL, signal.SIGTERM):
            svc.expected_exit = True
        os.killpg(svc.proc.pid, sig)
        if sig == signal.SIGKILL:
            svc.proc.wait(timeout=30)

    def kill_server(self, name: str) -> None:
        """SIGKILL the Kafka broker or MinIO server (``hadar infra restart`` brings it back)."""
        from devinfra.kafka import load_kafka
        from devinfra.minio import load_minio

        server = load_kafka(self.paths) if name == "kafka" else load_minio(self.paths)
        assert server is not None
        os.kill(server.pid, signal.SIGKILL)
        while is_running(server.pid, server.marker):
            time.sleep(0.05)

    def restart_server(self, name: str, *, attempts: int = 3) -> None:
        """``hadar infra restart NAME`` as an operator would: a failed try is recorded in
        :attr:`restart_failures` (with why: exit code and log lines) and tried again, up
        to ``attempts`` times. Returns once the server answers -- for Kafka, once a metadata
        request lists the broker and every topic can be read again -- so that the fault
        ends when the server is back, and recovery counts from there."""
        for attempt in range(1, attempts + 1):
            try:
                restart(self.paths, name)   # type: ignore[arg-type]
                break
            except InfraError as exc:
                self.restart_failures.append(f"{name} attempt {attempt}: {exc}")
                if attempt == attempts:
                    raise
                time.sleep(2)
        if name == "kafka":
            deadline = time.monotonic() + 60
            while not self.log() and time.monotonic() < deadline:
                time.sleep(0.5)

    def crashes(self) -> dict[str, int]:
        """Services that exited on their own so far, with their exit codes (recorded once).
        A scheduler replica that stepped down (exit 3: a newer one took over) is no crash: it
        is started again, as a standby, as swarm's restart policy would."""
        for svc in self.services.values():
            if svc.proc is not None and svc.proc.poll() is not None and not svc.expected_exit:
                if svc.name in SCHEDULERS and self.workload.standby and svc.proc.returncode == STEPPED_DOWN_EXIT:
                    self.step_downs.append(svc.name)
                    self.start(svc.name)
                    continue
                svc.crashes.append(svc.proc.returncode)
                svc.expected_exit = True
        return {s.name: s.crashes[-1] for s in self.services.values() if s.crashes}

    def _terminate(self, svc: Service, *, wait: bool = True) -> None:
        """SIGTERM a service (SIGCONT first, in case it is stopped) and, with ``wait``, wait
        30 s for it to exit, then SIGKILL it."""
        if svc.proc is None or svc.proc.poll() is not None:
            return
        svc.expected_exit = True
        try:
            if not svc.terminated:
                os.killpg(svc.proc.pid, signal.SIGCONT)
                os.killpg(svc.proc.pid, signal.SIGTERM)
                svc.terminated = True
            if not wait:
                return
            svc.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(svc.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------ the log

    def log(self) -> list[tuple[str, Event]]:
        """Every decodable record of every topic, ``(topic, event)``; [] while the broker is away."""
        try:
            return asyncio.run(asyncio.wait_for(_read_log(self.bootstrap), 60))
        except Exception:
            return []

    def completed(self, records: list[tuple[str, Event]]) -> set[str]:
        return {e.job_id for e in self.completions(records)}

    def completions(self, records: list[tuple[str, Event]]) -> list[JobCompleted]:
        return [e for _, e in records if isinstance(e, JobCompleted) and e.job_id in self.job_ids
                and e.id not in self.forged_ids and e.final_key == final_key(e.job_id)]

    def wait(self, predicate, *, timeout_s: float, poll_s: float = 2.0) -> list[tuple[str, Event]]:
        """Poll the log until ``predicate(records)``; the last records read (raises on timeout)."""
        deadline = time.monotonic() + timeout_s
        records: list[tuple[str, Event]] = []
        while time.monotonic() < deadline:
            self.crashes()
            records = self.log() or records
            if predicate(records):
                return records
            time.sleep(poll_s)
        raise TimeoutError(f"condition not reached in {timeout_s:.0f} s")

    def models(self, records: list[tuple[str, Event]]) -> list[ModelConsolidated]:
        return [e for _, e in records if isinstance(e, ModelConsolidated) and e.job_id in self.job_ids
                and e.id not in self.forged_ids]


async def _submit(bootstrap: str, specs: list[JobSpec]) -> None:
    bus = KafkaBus(bootstrap, source="cli")
    await bus.start()
    try:
        for spec in specs:
            await submit_job(bus, spec)
    finally:
        await bus.stop()


async def _read_log(bootstrap: str) -> list[tuple[str, Event]]:
    records = await fetch_log(KafkaBus(bootstrap, source="faults-harness", request_timeout_ms=10_000))
    return [(r.topic, r.event) for r in records]


# ---------------------------------------------------------------------- figures


def leader_terms(records: list[tuple[str, Event]]) -> list[tuple[int, str, float]]:
    """``(term, holder, first renewal's time)`` of every scheduler term, in term order."""
    first: dict[int, tuple[str, float]] = {}
    for _, e in records:
        if isinstance(e, LeaderRenewed) and e.role == "scheduler" and e.term not in first:
            first[e.term] = (e.holder, e.ts)
    return [(term, holder, ts) for term, (holder, ts) in sorted(first.items())]


def round_numbering_faults(records: list[tuple[str, Event]]) -> int:
    """Round numbers published more than once (distinct RoundStarted ids) plus numbers skipped
    between the first and the last: 0 when every round has its own number, in order."""
    ids: dict[int, set[str]] = {}
    for _, e in records:
        if isinstance(e, RoundStarted) and e.source != "forger":
            ids.setdefault(e.round, set()).add(e.id)
    if not ids:
        return 0
    twice = sum(len(v) - 1 for v in ids.values())
    skipped = (max(ids) - min(ids) + 1) - len(ids)
    return twice + skipped


def progress_times(models: list[ModelConsolidated]) -> list[float]:
    """Times of models that added steps to their job, in order."""
    best: dict[str, int] = {}
    times = []
    for m in sorted(models, key=lambda m: (m.ts, m.round)):
        if m.total_steps > best.get(m.job_id, 0):
            best[m.job_id] = m.total_steps
            times.append(m.ts)
    return times


def rounds_lost(records: list[tuple[str, Event]], job_ids: list[str], forged: set[str]) -> dict[str, int]:
    """Per job: rounds it ran in whose model did not add steps."""
    ran: dict[str, set[int]] = {j: set() for j in job_ids}
    productive: dict[str, set[int]] = {j: set() for j in job_ids}
    best: dict[str, int] = {}
    for _, e in records:
        if e.id in forged:
            continue
        if isinstance(e, Assignment) and e.job_id in ran:
            ran[e.job_id].add(e.round)
    for m in sorted((e for _, e in records if isinstance(e, ModelConsolidated) and e.id not in forged),
                    key=lambda m: m.round):
        if m.job_id in productive and m.total_steps > best.get(m.job_id, 0):
            best[m.job_id] = m.total_steps
            productive[m.job_id].add(m.round)
    return {j: len(ran[j] - productive[j]) for j in job_ids}


def events_lost(records: list[tuple[str, Event]], job_ids: list[str], forged: set[str]) -> int:
    """Results produced but never consumed (module docstring)."""
    real = [(t, e) for t, e in records if e.id not in forged]
    placed = {e.job_id for _, e in real if isinstance(e, Assignment)}
    listed = {w.job_id for _, e in real if isinstance(e, RoundStarted) for w in e.waiting}
    lost = sum(1 for _, e in real if isinstance(e, JobSubmitted) and e.job_id in job_ids
               and e.job_id not in placed | listed)
    decided: dict[tuple[str, int], set[int] | None] = {}
    for _, e in real:
        if isinstance(e, ModelConsolidated):
            used = {c.copy for c in e.copies} | {r.copy for r in e.rejected} | set(e.missing)
            decided[(e.job_id, e.round)] = used
        elif isinstance(e, RoundAbandoned):
            decided[(e.job_id, e.round)] = None
    completed = {e.job_id for _, e in real if isinstance(e, JobCompleted)}
    seen: set[tuple[str, int, int]] = set()
    for _, e in real:
        if not isinstance(e, CopyFinished) or e.job_id not in job_ids or e.status == "failed":
            continue
        key = (e.job_id, e.round, e.copy)
        if key in seen:
            continue
        seen.add(key)
        if (e.job_id, e.round) in decided:
            used = decided[(e.job_id, e.round)]
            lost += used is not None and e.copy not in used
        elif e.job_id in completed:
            lost += 1
    return lost


async def verify_models(s3: S3Settings, models: list[ModelConsolidated], records: list[tuple[str, Event]],
                        scratch: Path) -> int:
    """How many of ``models`` equal the samples-weighted average of their stored replicas."""
    workers = {(e.job_id, e.round, e.copy): e.world_size for _, e in records if isinstance(e, Assignment)}
    store = MinioStore(s3)
    await store.start()
    scratch.mkdir(parents=True, exist_ok=True)
    ok = 0
    for m in models:
        try:
            ok += await _verify_one(store, m, workers, scratch)
        except Exception:
            pass
    return ok


async def _verify_one(store: MinioStore, m: ModelConsolidated, workers: dict, scratch: Path) -> bool:
    scratch.mkdir(parents=True, exist_ok=True)
    await store.get_file(m.key, scratch / "model.safetensors")
    model = load_file(str(scratch / "model.safetensors"))
    replicas = []
    for c in m.copies:
        path = scratch / f"{c.copy}.safetensors"
        await store.get_file(checkpoint_key(m.job_id, m.round, c.copy), path)
        k = workers.get((m.job_id, m.round, c.copy), 1)
        replicas.append((c.copy, c.steps, c.steps * k, load_file(str(path))))
    if not replicas:
        return False
    total = sum(r[2] for r in replicas)
    # The tracker's weights (services/tracker/averaging/consolidate.py): samples over their total, or
    # uniform when no copy trained a step (copies that started too late to train).
    weights = [r[2] / total if total else 1 / len(replicas) for r in replicas]
    most = min(replicas, key=lambda r: (-r[1], r[0]))[3]
    for name, value in model.items():
        if np.issubdtype(value.dtype, np.integer):
            if not np.array_equal(value, most[name]):
                return False
            continue
        expected = sum(r[3][name].astype(np.float64) * w for r, w in zip(replicas, weights))
        if not np.allclose(value.astype(np.float64), expected, rtol=1e-5, atol=1e-6):
            return False
    return True
