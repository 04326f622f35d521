"""Issue 26's planted checkpoint, end to end on the secured broker and MinIO (``hadar infra up
--secure``): HadarE forks one job (``resnet`` on ``digits``) onto two emulated nodes,
secure-p1 and secure-p2, each enrolled with ``hadar identity enrol node`` and so holding its
own credential and logins. While secure-p2 trains a copy, a process holding secure-p1's
credential and logins tries to plant a checkpoint (the
model's tensors, right names and shapes, garbage values; metadata naming the copy and
claiming its whole step budget) at that copy's key under secure-p2, and at the same copy's
key of the next round; once secure-p2 has stored its checkpoint it tries to overwrite and to
delete it. The store refuses every one (AccessDenied) and secure-p2's bytes stay as it wrote
them.

Checked from the event log and the store once the job is done: HadarE really forked
(a round averaged two or more copies, and copies ran on both nodes); every copy a round
model weighs was reported finished, with those steps, by the node its rank-0 Assignment
named, and each round model is the samples-weighted average of exactly those nodes' own
checkpoints, so no step is credited that the assigned node did not train (the job's
total steps are what its rounds credited); the final model keeps its held-out accuracy;
nothing was refused or noticed (no dead letter of the job, no ``bad_key`` refusal, no
``checkpoint.not_ours``); no secret is on a command line or in a log, and no read or write
was refused by the broker's ACLs.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_tensors

from services.agent.worker.checkpoint import CheckpointMeta, restore
from shared.bus import KafkaBus
from shared.bus.eventlog import fetch_log
from shared.bus.settings import kafka_from_env
from shared.domain.layout import checkpoint_key
from shared.security.own_logins import own_login_env
from shared.store import MinioStore, StoreDenied
from shared.store.settings import s3_from_env
from shared.wire.events import Assignment, CopyFinished, JobCompleted, ModelConsolidated, Progress
from shared.wire.topics import MODELS, PLACEMENTS, PROGRESS
from shared.zoo import build_model, dataset_info
from tests.e2e.processes import stop_services
from tests.e2e.test_secure_system import (
    HADAR,
    ROOT,
    dead_letters,
    enrol_node,
    leaked_on_command_lines,
    principal_env,
    scrape,
)
from tests.e2e.test_system import _check_average

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.slow]

ATTACKER, VICTIM = "secure-p1", "secure-p2"
ITERATIONS = 1500
# The final model's held-out accuracy (297 digits, ten classes: chance is 0.1). The issue's
# planted run fell to 0.12. Honest runs of this test reached 0.973-0.987 -- and 0.892 in CI at
# stop 50, where the last round was one copy's 133 Adam steps at lr 0.003 and that copy's own
# model scored 0.892 before any averaging (its rounds before: 0.97-0.98). So the bar sits far
# above garbage and well below an honest run's noise; the exact-average checks above are what
# prove no step was credited that the assigned node did not train.
ACCURACY = 0.6
RUN_TIMEOUT_S = 240
ATTACK_TIMEOUT_S = 120
ATTACK_MARGIN_S = 5


def garbage_weights(model: str, dataset: str) -> dict[str, torch.Tensor]:
    """The zoo model's tensors, every name and shape right (it loads strictly), garbage values."""
    tensors = build_model(model, dataset_info(dataset), seed=0).state_dict()
    generator = torch.Generator().manual_seed(26)
    garbage = {name: (torch.randn(value.shape, generator=generator) * 10).to(value.dtype)
               if value.is_floating_point() else value.clone() for name, value in tensors.items()}
    restore(build_model(model, dataset_info(dataset), seed=0), None, garbage)
    return garbage


def planted_checkpoint(weights: dict[str, torch.Tensor], assignment: Assignment) -> bytes:
    """What the attacker plants: a file the victim's worker would take for this copy's own
    mid-round checkpoint were it at its key and had the node written it -- garbage
    ``weights`` that load into the model, metadata naming the job, round and copy and
    claiming the copy's whole step budget. Random bytes would be refused as unreadable by
    any reader; a file like this one is what fooled the copy in the issue."""
    job = assignment.job
    meta = CheckpointMeta(job=job.job_id, round=assignment.round, copy=assignment.copy,
                          steps=assignment.step_budget, total_steps=assignment.step_budget,
                          gpu_type=assignment.gpu_type, model=job.model, dataset=job.dataset)
    return save_tensors(weights, metadata=meta.to_metadata())


async def read_topics(secure_servers, *topics: str) -> list:
    """Every event of ``topics`` now, read as the admin (as ``hadar`` replay reads them)."""
    bus = KafkaBus.from_settings(kafka_from_env(secure_servers.env["admin"]), source="e2e-planted")
    return [r.event for r in await fetch_log(bus, topics)]


def store_of(env: dict[str, str]) -> MinioStore:
    settings = s3_from_env(env)
    assert settings is not None
    return MinioStore(settings, retry_for_s=0)


async def refused(action) -> str:
    """The store's code for an attempted write or delete it refused ("" if it succeeded)."""
    try:
        await action
    except StoreDenied as exc:
        return exc.code
    return ""


def attack(secure_servers, job_id: str, identity_attacker: Path, tmp_path: Path) -> tuple[dict[str, str], float]:
    """Wait until secure-p2 trains a copy of the job, then try to plant, overwrite and delete
    as secure-p1; returns attempt -> S3 error code, and the seconds the attacked copy's round
    still had to run after the plants."""
    attacker_env = own_login_env({**principal_env(secure_servers, "agent"),
                                  "HADAR_IDENTITY_FILE": str(identity_attacker)})
    assert attacker_env["HADAR_S3_ACCESS_KEY"] == f"hadar-node-{ATTACKER}"   # secure-p1's own login, nothing more
    store = store_of(attacker_env)
    asyncio.run(store.start())
    weights = garbage_weights("resnet", "digits")   # ready beforehand: the plants follow the sighting at once
    deadline = time.monotonic() + ATTACK_TIMEOUT_S

    def wait_for(what: str, found):
        while time.monotonic() < deadline:
            events = asyncio.run(read_topics(secure_servers, PLACEMENTS, PROGRESS))
            hit = found(events)
            if hit is not None:
                return hit
            time.sleep(0.5)
        pytest.fail(f"{what} not seen in {ATTACK_TIMEOUT_S} s; logs in {tmp_path}")

    def training(events: list) -> Assignment | None:
        """An Assignment of the job's copy on secure-p2 (rank 0) whose Progress shows it training,
        not finished, with at least ATTACK_MARGIN_S of its round left (a round's first copy may
        report only near its end, while its worker starts: then the next round's is taken)."""
        on_victim = {(e.round, e.copy): e for e in events if isinstance(e, Assignment) and e.job_id == job_id
                     and e.node_id == VICTIM and 0 in e.ranks}
        done = {(e.round, e.copy) for e in events if isinstance(e, CopyFinished) and e.job_id == job_id}
        going = [on_victim[(e.round, e.copy)] for e in events if isinstance(e, Progress) and e.job_id == job_id
                 and e.node_id == VICTIM and (e.round, e.copy) in on_victim.keys() - done]
        return next((a for a in going if a.deadline - time.time() >= ATTACK_MARGIN_S), None)

    victim = wait_for("a copy of the job training on secure-p2", training)
    key = checkpoint_key(job_id, victim.round, victim.copy, node=VICTIM)
    next_key = checkpoint_key(job_id, victim.round + 1, victim.copy, node=VICTIM)
    planted = planted_checkpoint(weights, victim)

    async def while_training() -> dict[str, str]:
        return {"plant this round": await refused(store.put(key, planted)),
                "plant next round": await refused(store.put(next_key, planted)),
                "delete this round": await refused(store.delete(key))}

    codes = asyncio.run(while_training())
    left = victim.deadline - time.time()

    def stored(events: list) -> CopyFinished | None:
        return next((e for e in events if isinstance(e, CopyFinished) and e.job_id == job_id
                     and (e.round, e.copy, e.node_id) == (victim.round, victim.copy, VICTIM)
                     and e.checkpoint == key), None)

    # The attempts came while the copy trained, as in the issue (before it reported its round).
    assert stored(asyncio.run(read_topics(secure_servers, PROGRESS))) is None, "the attack came too late"

    wait_for("secure-p2's checkpoint of the attacked copy", stored)

    async def once_stored() -> dict[str, str]:
        admin = store_of(principal_env(secure_servers, "admin"))
        await admin.start()
        before = hashlib.sha256(await admin.get(key)).hexdigest()
        attempts = {"overwrite stored": await refused(store.put(key, planted)),
                    "delete stored": await refused(store.delete(key))}
        assert hashlib.sha256(await admin.get(key)).hexdigest() == before, "secure-p2's checkpoint was changed"
        await admin.stop()
        await store.stop()
        return attempts

    codes.update(asyncio.run(once_stored()))
    return codes, left


def test_a_checkpoint_planted_for_another_node_is_refused_and_nothing_unearned_is_credited(
        secure_servers, tmp_path: Path) -> None:
    job_id = f"planted-{os.getpid()}-{secrets.token_hex(2)}"
    procs: list[subprocess.Popen] = []
    leaks: list[str] = []

    def serve(name: str, principal: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the child process writes to it until it exits
        procs.append(subprocess.Popen([*HADAR, "serve", principal, *args, "--http-port", "0"],
                                      env={**principal_env(secure_servers, principal), **(env or {})}, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    started = time.monotonic()
    try:
        # not alice: the secured servers are shared by this session's tests, and enrolling a
        # user again rotates her key, so another test's scheduler would refuse her old records
        _, identity_dana = enrol_node(secure_servers, "dana", tmp_path, kind="user")
        identities = {node: enrol_node(secure_servers, node, tmp_path)[1] for node in (ATTACKER, VICTIM)}
        submitted = subprocess.run(
            [*HADAR, "submit", "--id", job_id, "--model", "resnet", "--dataset", "digits", "--workers", "1",
             "--iterations", str(ITERATIONS), "--batch-size", "32", "--optimizer", "adam", "--lr", "0.003"],
            env={**principal_env(secure_servers, "cli"), "HADAR_IDENTITY_FILE": str(identity_dana)}, cwd=ROOT,
            capture_output=True, text=True, timeout=120)
        assert submitted.returncode == 0, submitted.stderr
        serve("scheduler", "scheduler", "--policy", "hadare", "--round-s", "8", "--heartbeat-s", "1",
              "--late-copy-s", "60", "--consolidation-wait-s", "30")
        serve("tracker", "tracker", "--finish-timeout-s", "60", "--keep-checkpoints",
              "--keep-round-models", "1000000", "--keep-round-models-after-completion")
        serve("profiler", "profiler")
        for node, identity in identities.items():
            serve(f"agent-{node}", "agent", "--node-id", node, "--emulate", "t4:1", "--heartbeat-s", "1",
                  "--progress-s", "1", "--deadline-grace-s", "10", "--stop-timeout-s", "10",
                  "--cache-dir", str(tmp_path / f"cache-{node}"), "--ledger-dir", str(tmp_path / f"ledger-{node}"),
                  env={"HADAR_IDENTITY_FILE": str(identity)})
        codes, left = attack(secure_servers, job_id, identities[ATTACKER], tmp_path)
        deadline = started + RUN_TIMEOUT_S
        done = False
        while time.monotonic() < deadline and not done:
            time.sleep(2)
            leaks += leaked_on_command_lines(secure_servers.secrets)
            for p in procs:
                assert p.poll() is None, f"a service exited early (code {p.returncode}); logs in {tmp_path}"
            done = any(isinstance(e, JobCompleted) and e.job_id == job_id
                       for e in asyncio.run(read_topics(secure_servers, MODELS)))
        assert done, f"the job did not complete in {RUN_TIMEOUT_S} s; logs in {tmp_path}"
        metrics = {node: scrape(tmp_path / f"agent-{node}.log") for node in identities}
        tracker_metrics = scrape(tmp_path / "tracker.log")
    finally:
        stop_services(procs)
    elapsed = time.monotonic() - started

    # Every attempt as secure-p1 on secure-p2's keys was refused by the store.
    assert codes == dict.fromkeys(codes, "AccessDenied") and len(codes) == 5, codes

    events = asyncio.run(read_topics(secure_servers, PLACEMENTS, PROGRESS, MODELS))
    rounds = sorted((e for e in events if isinstance(e, ModelConsolidated) and e.job_id == job_id),
                    key=lambda e: e.round)
    completed = next(e for e in events if isinstance(e, JobCompleted) and e.job_id == job_id)
    rank0 = {(e.round, e.copy): e.node_id for e in events   # the node that trained each copy and wrote its checkpoint
             if isinstance(e, Assignment) and e.job_id == job_id and 0 in e.ranks}
    finished = [e for e in events if isinstance(e, CopyFinished) and e.job_id == job_id]
    summary = [(e.round, [(c.copy, rank0[(e.round, c.copy)], c.steps) for c in e.copies], e.metric_value)
               for e in rounds]   # shown by pytest -s / -rA
    print(f"planted: done in {elapsed:.0f} s; attempts {codes}, {left:.1f} s before the copy's deadline; "
          f"rounds [(round, [(copy, node, steps)], accuracy)] {summary}")

    # HadarE forked the job across the two nodes.
    assert any(len(e.copies) >= 2 for e in rounds), "HadarE never averaged two or more copies of the job"
    assert {rank0[(e.round, c.copy)] for e in rounds for c in e.copies} == {ATTACKER, VICTIM}

    # No step credited that the assigned node did not train: each weighed copy was reported
    # finished with those steps by the node of its rank 0, with that node's checkpoint key.
    for e in rounds:
        assert not e.rejected, (e.round, e.rejected)
        for c in e.copies:
            node = rank0[(e.round, c.copy)]
            assert any((f.round, f.copy, f.node_id, f.steps_round) == (e.round, c.copy, node, c.steps)
                       and f.status in ("ok", "preempted")
                       and f.checkpoint == checkpoint_key(job_id, e.round, c.copy, node=node) for f in finished), \
                (e.round, c, node)
    assert all(f.node_id == rank0[(f.round, f.copy)] for f in finished if f.status != "failed")
    summed = sum(c.steps for e in rounds for c in e.copies)   # W = k = 1: a copy's step is one worker-step
    assert rounds[-1].total_steps == min(summed, ITERATIONS) == completed.total_steps   # samples conserved

    # Each round's model is the weighted average of the checkpoints those nodes stored.
    async def check_models() -> None:
        admin = store_of(principal_env(secure_servers, "admin"))
        await admin.start()
        try:
            for e in rounds:
                await _check_average(admin, e, {c.copy: 1 for c in e.copies}, tmp_path / "check",
                                     writers={c.copy: rank0[(e.round, c.copy)] for c in e.copies})
        finally:
            await admin.stop()

    asyncio.run(check_models())

    # The model keeps its accuracy.
    assert rounds[-1].metric_name == "accuracy" and rounds[-1].metric_value is not None
    assert rounds[-1].metric_value >= ACCURACY, rounds[-1].metric_value

    # Nothing planted got as far as being noticed: no refusal of the job's records, no
    # checkpoint at a copy's key that its node did not write.
    letters = [d for d in asyncio.run(dead_letters(secure_servers)) if job_id.encode() in d.raw or job_id in d.reason]
    assert not letters, [(d.source, d.reason) for d in letters]
    assert 'hadar_tracker_events_rejected_total{reason="bad_key"} 0.0' in tracker_metrics
    for node, text in metrics.items():
        line = next(x for x in text.splitlines() if x.startswith("hadar_agent_checkpoints_not_ours_total"))
        assert float(line.split()[-1]) == 0, (node, line)

    assert not leaks, f"a secret was on the command line of {sorted(set(leaks))}"
    for log in tmp_path.glob("*.log"):
        text = log.read_text(errors="replace")
        assert text.strip(), log.name
        assert not any(secret in text for secret in secure_servers.secrets), f"a secret is in {log.name}"
        assert "Not authorized" not in text, f"{log.name}: a read or write the principals table does not allow"
        assert "checkpoint.not_ours" not in text and "bad_key" not in text, log.name
