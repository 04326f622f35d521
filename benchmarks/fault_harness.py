"""A Hadar cluster of separate processes on its own Kafka and MinIO, for fault injection.

:class:`Cluster` starts a private Kafka (one broker, or a cluster of three with
``Workload.brokers=3``) and MinIO (one drive, or an erasure set with ``Workload.drives=4``)
through ``devinfra``, in a run directory of its own (free ports; binaries from the shared
cache; nothing of the shared ``hadar infra`` is touched), every service as its own process
(``hadar serve scheduler|tracker|profiler|agent``, agents emulated on the CPU, each run
through :mod:`benchmarks.fault_acks`, which journals every record it gets acknowledged),
submits a small workload as ``hadar submit`` does, and lets a scenario kill, stop,
continue and restart any of them. The figures (:mod:`benchmarks.fault_figures`, re-exported
here) come from what the run left: the event log, the stored objects and the journals.
Used by ``benchmarks/faults.py`` and ``tests/e2e/test_faults*.py``.

A scenario strikes only once the workload is mid-work (:meth:`Cluster.wait_mid_work`); a
fault that finds nothing to hit raises :class:`Miss` with the reason, and the run is
reported as a miss (with the figures it did produce), never as zero jobs completed.
``service_crashes``: service processes that exited without the harness stopping them.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from benchmarks.fault_acks import JOURNAL_ENV, close_journal, open_journal
from benchmarks.fault_figures import _verify_one as _verify_one
from benchmarks.fault_figures import (
    events_lost,
    leader_terms,
    progress_times,
    round_numbering_faults,
    rounds_lost,
    verify_models,
)
from devinfra import InfraError, InfraPaths, down, restart, up
from devinfra.common import is_running
from services.cli.jobs import submit as submit_job
from shared.bus import KafkaBus
from shared.bus.eventlog import LogRecord, fetch_log
from shared.domain.layout import final_key
from shared.store.settings import S3Settings
from shared.wire.events import (
    Event,
    Hyperparameters,
    JobCompleted,
    JobSpec,
    ModelConsolidated,
    NodeRegistered,
)

__all__ = ["Workload", "Service", "Cluster", "Miss", "events_lost", "leader_terms", "progress_times",
           "round_numbering_faults", "rounds_lost", "verify_models"]

ROOT = Path(__file__).resolve().parents[1]
SCHEDULERS = ("scheduler", "scheduler-b")   # service names; with a standby, also their holder names
STEPPED_DOWN_EXIT = 3   # services/scheduler/cli.py: a replica taken over exits so, and is restarted
# `hadar` with every acknowledged record journaled (benchmarks/fault_acks.py)
HADAR = [sys.executable, "-m", "benchmarks.fault_acks"]


class Miss(Exception):
    """The fault found nothing to hit (e.g. every job completed before it was due); the
    message says why. The run is reported as a miss, with the figures it produced."""


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
    # The backbone: 1 broker / 1 drive, or a replicated one (`hadar infra up --brokers 3 --drives 4`).
    brokers: int = 1
    drives: int = 1


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
        self.strikes: list[float] = []   # unix times the faults struck (:meth:`struck`)
        self.superseded: list[tuple[str, str]] = []   # (old, new) journal writers of a scheduler takeover
        self.notes: dict[str, object] = {}   # scenario-specific measurements, reported as they are
        # From the journals after the run: (note, since, partitions or None for any) -> seconds
        # to the first acknowledgement after ``since``; (note, start, end) -> acks in between.
        self.watches: list[tuple[str, float, frozenset[tuple[str, int]] | None]] = []
        self.quiet: list[tuple[str, float, float]] = []
        self.acks_dir = workdir / "acks"
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
        w = self.workload
        servers = up(self.paths, brokers=w.brokers, drives=w.drives)
        self.phase("servers_up")
        open_journal(self.acks_dir / "harness.jsonl")   # the harness's own publishes (submit, junk)
        self.bootstrap = servers.kafka.bootstrap
        self.s3 = S3Settings(endpoint=servers.minio.endpoint, access_key=servers.minio.access_key,
                             secret_key=servers.minio.secret_key, bucket=f"faults-{secrets.token_hex(3)}")
        self.env = {**os.environ, "HADAR_BOOTSTRAP": self.bootstrap, "HADAR_S3_ENDPOINT": self.s3.endpoint,
                    "HADAR_S3_ACCESS_KEY": self.s3.access_key, "HADAR_S3_SECRET_KEY": self.s3.secret_key,
                    "HADAR_S3_BUCKET": self.s3.bucket, "PYTHONPATH": str(ROOT), "HADAR_RUN_DIR": str(self.paths.run)}
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
        self.stop_services()
        close_journal()
        try:   # the servers' data and logs stay in the run directory, for a post-mortem
            down(self.paths, keep_data=True)
        except Exception:
            pass
        self.phase("stopped")

    def stop_services(self) -> None:
        """SIGTERM every service still running, all at once, then wait for each (30 s, then SIGKILL)."""
        running = [svc for svc in self.services.values() if svc.proc is not None and svc.proc.poll() is None]
        for svc in running:   # all told at once, then waited for: their shutdowns overlap
            self._terminate(svc, wait=False)
        for svc in running:
            self._terminate(svc)

    def _define(self, name: str, args: list[str]) -> None:
        self.services[name] = Service(name=name, argv=HADAR + ["serve", *args, "--http-port", "0"])

    def start(self, name: str) -> None:
        """Start (or restart) one service; its output is appended to ``<name>.log``."""
        svc = self.services[name]
        log = open(self.workdir / f"{name.replace(':', '-')}.log", "a")  # noqa: SIM115 - the child process writes to it until it exits
        svc.starts += 1
        env = {**self.env, JOURNAL_ENV: str(self.acks_dir / f"{self.writer(name)}.jsonl")}
        svc.proc = subprocess.Popen(svc.argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        svc.expected_exit = False
        svc.terminated = False

    def writer(self, name: str) -> str:
        """The journal name of the current (latest) process of service ``name``."""
        return f"{name.replace(':', '-')}.{self.services[name].starts}"

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

    def wait_mid_work(self, ready: Callable[[list[tuple[str, Event]]], bool], what: str, *, timeout_s: float,
                      poll_s: float = 1.0) -> list[tuple[str, Event]]:
        """Wait until ``ready(records)`` while a job of ours is still running; raise :class:`Miss`
        when every job completed first (the fault would hit nothing) or on timeout."""
        def done_or_ready(records: list[tuple[str, Event]]) -> bool:
            return self.all_completed(records) or ready(records)
        try:
            records = self.wait(done_or_ready, timeout_s=timeout_s, poll_s=poll_s)
        except TimeoutError:
            raise Miss(f"{what}: not reached in {timeout_s:.0f} s") from None
        if self.all_completed(records):
            raise Miss(f"{what}: every job completed first")
        return records

    def mid_work(self, records: list[tuple[str, Event]]) -> bool:
        """A model that added steps since the last fault ended, and a job still running."""
        return (any(t > self.last_fault_end for t in progress_times(self.models(records)))
                and not self.all_completed(records))

    def all_completed(self, records: list[tuple[str, Event]]) -> bool:
        return bool(self.job_ids) and self.completed(records) >= set(self.job_ids)

    def struck(self) -> float:
        """Record that a fault strikes now; the time."""
        now = time.time()
        self.strikes.append(now)
        return now

    def log_records(self) -> list[LogRecord]:
        """:meth:`log` with partitions and offsets; [] while the broker is away."""
        try:
            return asyncio.run(asyncio.wait_for(_read_records(self.bootstrap), 120))
        except Exception:
            return []

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


async def _read_records(bootstrap: str) -> list[LogRecord]:
    return await fetch_log(KafkaBus(bootstrap, source="faults-harness", request_timeout_ms=10_000))


async def _read_log(bootstrap: str) -> list[tuple[str, Event]]:
    return [(r.topic, r.event) for r in await _read_records(bootstrap)]
