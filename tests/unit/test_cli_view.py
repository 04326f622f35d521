"""The CLI's pure rendering of a folded log (services/cli/jobview.py)."""

from __future__ import annotations

from services.cli.jobview import job_doc, jobs_table
from services.scheduler.live.state import fold_log
from shared.wire.events import JobSpec, JobSubmitted, RoundStarted, ThroughputEstimate
from shared.wire.records import Waiting
from shared.wire.topics import JOBS, PLACEMENTS, THROUGHPUT

SPEC = JobSpec(job_id="new-1", user="ada", model="resnet", dataset="digits", batch_size=32, workers=1,
               iterations=100)
INFEASIBLE = Waiting(job_id="new-1", code="infeasible",
                     detail="no placement of up to W GPUs of the cluster gives it a positive rate")


def _log(with_estimate: bool):
    items = [(JOBS, JobSubmitted(ts=1.0, source="t", job=SPEC, submitted_at=1.0)),
             (PLACEMENTS, RoundStarted(ts=2.0, source="t", round=0, policy="hadar", started_at=2.0, ends_at=12.0,
                                       waiting=(INFEASIBLE,)))]
    if with_estimate:
        items.append((THROUGHPUT, ThroughputEstimate(ts=1.5, source="t", job_id="new-1", basis="estimate",
                                                     workers=1, rates={"v100": 0.0})))
    return fold_log(items)


def test_a_job_without_a_throughput_estimate_is_waiting_for_one_not_infeasible():
    state = _log(with_estimate=False)
    assert job_doc(state, "new-1", now=5.0)["waiting"] == "waiting for a throughput estimate"
    table = jobs_table(state, include_done=False, now=5.0)
    assert "waiting for a throughput estimate" in table and "infeasible" not in table


def test_once_estimated_the_schedulers_reason_is_shown():
    state = _log(with_estimate=True)
    assert job_doc(state, "new-1", now=5.0)["waiting"].startswith("infeasible: no placement")
