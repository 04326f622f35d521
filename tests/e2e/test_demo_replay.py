"""A recorded demo run replays with no difference; a tampered one does not."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.bus.eventlog import read_log, write_log
from shared.wire.events import Assignment, RoundStarted

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
HADAR = [sys.executable, "-m", "services.cli.main"]


def hadar(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADAR_")}   # file-only: no broker
    return subprocess.run([*HADAR, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo")
    log = out / "events.log"
    # Non-default policy options and seed: replay must take them from the log, not from flags.
    run = hadar("demo", "--out", str(out), "--round-s", "8", "--timeout-s", "200", "--record", str(log),
                "--policy-option", "timeline_slack=0.06", "--policy-option", "completion_weight=0.5",
                "--seed", "5",
                "--jobs", "examples/jobs/resnet-diabetes.yaml", "examples/jobs/autoencoder-ratings.yaml",
                timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return log, json.loads((out / "summary.json").read_text())


def test_demo_trains_real_models_and_summarises(recorded):
    _, summary = recorded
    assert [j["completed"] for j in summary["jobs"]] == [True, True]
    for job in summary["jobs"]:
        assert job["steps"] >= job["iterations"]
        assert Path(job["final_model"]).stat().st_size > 0
        assert job["metric"]["name"] == "mse" and job["metric"]["value"] > 0
    assert set(summary["simulated"]["policies"]) == {"hadar", "hadare", "gavel"}
    assert summary["simulated"]["charged"].startswith("data plane: ")
    # The comparison runs on the rates the profiler published: every policy finishes the jobs.
    assert all(m["jobs_completed"] == m["jobs_total"] == 2 for m in summary["simulated"]["policies"].values())


def test_replay_reruns_every_round_identically(recorded):
    log, _ = recorded
    started = [r.event for r in read_log(log) if isinstance(r.event, RoundStarted)]
    recorded_as = ("hadare", '{"completion_weight":0.5,"timeline_slack":0.06}', 5)
    assert started and all((s.policy, s.policy_options, s.seed) == recorded_as for s in started)
    run = hadar("replay", "--file", str(log), "--rerun")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 round(s) differ" in run.stdout and "DIFFERS" not in run.stdout


def test_replay_timeline_and_explain(recorded):
    log, summary = recorded
    job = summary["jobs"][0]["job"]
    timeline = hadar("replay", "--file", str(log), "--job", job)
    assert timeline.returncode == 0
    assert "round 1 started" in timeline.stdout and f"place {job} copy 0" in timeline.stdout
    assert f"completed {job}" in timeline.stdout
    placed_round = next(a.round for a in (r.event for r in read_log(log))
                        if isinstance(a, Assignment) and a.job_id == job)
    explained = hadar("replay", "--file", str(log), "--explain", job, "--round", str(placed_round))
    assert explained.returncode == 0, explained.stderr
    view = json.loads(explained.stdout)
    assert view["decision"] == "ran"
    # The demo runs HadarE, whose first-class fork plan says why a job ran: its place in the
    # queue and the steps its copies were expected to add after the consolidation cost.
    assert summary["policy"] == "hadare"
    assert view["policy_view"]["source"] == "fork-plan" and view["policy_view"]["expected_steps"] > 0


def test_a_tampered_log_is_reported_as_different(recorded, tmp_path):
    log, _ = recorded
    records = list(read_log(log))
    i = next(i for i, r in enumerate(records) if isinstance(r.event, Assignment))
    moved = dataclasses.replace(records[i].event, node_id="somewhere-else")
    records[i] = dataclasses.replace(records[i], event=moved)
    tampered = tmp_path / "tampered.log"
    write_log(tampered, records)
    run = hadar("replay", "--file", str(tampered), "--rerun")
    assert run.returncode == 1 and "DIFFERS" in run.stdout


def test_replay_usage_errors_exit_2(tmp_path):
    assert hadar("replay").returncode == 2
    garbage = tmp_path / "garbage.log"
    garbage.write_bytes(b"\xc1\x00not msgpack")
    run = hadar("replay", "--file", str(garbage))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
