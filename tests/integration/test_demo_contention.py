"""The demo completes under contention (issue 14 item 4): ``hadar demo``'s code path -- the
embedded system, five emulated agents, HadarE rounds -- finishes every job of a small set
while CPU hogs keep every core of the machine busy.

Before warm workers and round stretching, a start-up cost above the round length left
rounds without a checkpoint and jobs without progress. Short rounds (4 s) make that cliff
easy to reach here: the imports of a worker alone take longer on a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli.demo import run_demo
from services.cli.jobfile import parse_job

JOBS = (
    {"id": "hog-digits", "model": "resnet", "dataset": "digits", "batch_size": 32, "workers": 1,
     "iterations": 120, "optimizer": "sgd", "lr": 0.05, "seed": 1},
    {"id": "hog-ratings", "model": "autoencoder", "dataset": "synthetic-ratings", "batch_size": 64, "workers": 1,
     "iterations": 120, "optimizer": "adam", "lr": 0.005, "seed": 5},
)


@pytest.fixture
def cpu_hogs():
    """One busy-looping process per core, for the test's whole length."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield hogs
    for hog in hogs:
        hog.kill()
        hog.wait()


@pytest.mark.slow
def test_the_demo_completes_every_job_beside_cpu_hogs(cpu_hogs: list, tmp_path: Path) -> None:
    specs = [parse_job(job) for job in JOBS]
    args = argparse.Namespace(bootstrap=None, s3_endpoint=None, policy="hadare", policy_option=[], seed=0,
                              round_s=4.0, timeout_s=240.0, record=None)
    summary = asyncio.run(run_demo(args, specs, tmp_path))
    assert all(hog.poll() is None for hog in cpu_hogs), "a hog ended: the machine was not kept busy"
    jobs = {j["job"]: j for j in summary["jobs"]}
    assert set(jobs) == {s.job_id for s in specs}
    for job in jobs.values():
        assert job["completed"], f"{job['job']} did not complete: {job}"
        assert job["steps"] >= job["iterations"]
        assert Path(job["final_model"]).stat().st_size > 0 and job["metric"]["name"]
