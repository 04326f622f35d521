"""The CI-sized subset of the replicated fault figures (issue 28 item 5; ``benchmarks/faults.py
--replicated`` runs all five): on its own three-broker Kafka (replication 3,
``min.insync.replicas=2``, ``acks=all``) and four-drive MinIO, with every service its own
process, the broker leading a running job's ``hadar.placements`` partition is SIGKILLed
mid-round and left dead. Every job completes, every round model equals the samples-weighted
average of its stored replicas, no result is lost, no record a producer got acknowledged is
missing when the topics are read back, no service exits, no round number is published twice
or skipped, at most one round is lost per job; and the fault was tested: it struck mid-work
(no miss), a job was still running after it, and writes on the partitions the dead broker
led resumed. It prints the run's figures with a phase breakdown (``pytest -s``).
"""

from __future__ import annotations

import pytest

from benchmarks.fault_harness import Workload
from benchmarks.faults import meets_targets, run_scenario
from devinfra import InfraError
from tests.required import unavailable

pytestmark = [pytest.mark.kafka, pytest.mark.s3, pytest.mark.slow]

# Short rounds and jobs of a few rounds: the kill lands half a round after the first model,
# and a job still runs after it even on a quiet machine.
REPLICATED_CI_WORKLOAD = Workload(jobs=(("resnet", "diabetes", 1500), ("autoencoder", "synthetic-ratings", 6000)),
                                  round_s=10.0, late_copy_s=10.0, consolidation_wait_s=10.0, timeout_s=240.0)


def test_the_placements_leader_killed_loses_no_acknowledged_record(tmp_path):
    try:
        figures = run_scenario("replicated_leader_kill", REPLICATED_CI_WORKLOAD, tmp_path)
    except InfraError as exc:
        unavailable(f"servers could not start: {exc}")
    print(f"replicated faults CI subset: {figures}")   # with its phase breakdown (pytest -s / -rA)
    assert figures["miss"] is None, figures
    assert figures["backbone"] == "3 broker(s), 4 drive(s)", figures
    assert figures["faults"] == 1
    assert figures["jobs_completed"] == figures["jobs_total"] == 2, figures
    assert figures["models_verified"] == figures["models_total"] > 0, figures
    assert figures["acks"] > 0 and figures["acked_records_lost"] == 0, figures
    assert figures["events_lost"] == 0 and figures["service_crashes"] == 0, figures
    assert figures["round_numbering_faults"] == 0, figures
    assert figures["rounds_lost_max"] <= 1, figures
    assert figures["done_before_fault"] < 2, figures
    assert figures["notes"]["writes_resumed_s"] is not None, figures
    assert figures["recovery_s"] is not None, figures
    assert meets_targets(figures), figures
