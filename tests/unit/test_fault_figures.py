"""The fault benchmark's figures (benchmarks/fault_harness.py) on hand-made logs: what
counts as an event lost, a round lost, and a recovery."""

from __future__ import annotations

from benchmarks.fault_harness import events_lost, progress_times, rounds_lost
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    RoundAbandoned,
    RoundStarted,
)

SPEC = JobSpec(job_id="j", user="u", model="resnet", dataset="digits", batch_size=32, workers=1, iterations=100)


def _assign(r: int, copy: int) -> tuple:
    return ("p", Assignment(ts=1.0 + r, source="s", round=r, job=SPEC, copy=copy, node_id=f"n{copy}", gpus=(0,),
                            gpu_type="t4", world_size=1, ranks=(0,), step_budget=50, deadline=10.0 + r))


def _finished(r: int, copy: int, status: str = "ok") -> tuple:
    return ("g", CopyFinished(ts=5.0 + r, source="a", job_id="j", round=r, copy=copy, node_id=f"n{copy}",
                              status=status, steps_round=10, checkpoint=checkpoint_key("j", r, copy, node=f"n{copy}")))


def _model(r: int, total: int, copies: tuple[int, ...], ts: float) -> tuple:
    return ("m", ModelConsolidated(ts=ts, source="t", job_id="j", round=r, key=model_key("j", r), total_steps=total,
                                   copies=tuple(CopyWeight(copy=c, steps=10, weight=1 / len(copies))
                                                for c in copies)))


BASE = [("j", JobSubmitted(ts=0.5, source="c", job=SPEC, submitted_at=0.5)),
        ("p", RoundStarted(ts=1.0, source="s", round=0, policy="hadare", started_at=1.0, ends_at=10.0))]


def test_a_finished_copy_left_out_of_its_rounds_model_is_lost():
    log = [*BASE, _assign(0, 0), _assign(0, 1), _finished(0, 0), _finished(0, 1), _model(0, 10, (0,), 20.0)]
    assert events_lost(log, ["j"], set()) == 1
    log[-1] = _model(0, 20, (0, 1), 20.0)
    assert events_lost(log, ["j"], set()) == 0


def test_failed_copies_abandoned_rounds_and_forged_reports_are_not_lost():
    forged = _finished(0, 5)
    log = [*BASE, _assign(0, 0), _finished(0, 0, status="failed"), forged,
           ("m", RoundAbandoned(ts=20.0, source="t", job_id="j", round=0, reason="no usable replica"))]
    assert events_lost(log, ["j"], {forged[1].id}) == 0


def test_a_job_never_placed_nor_listed_waiting_is_lost_and_an_undecided_round_of_a_completed_job_too():
    assert events_lost([BASE[0]], ["j"], set()) == 1
    log = [*BASE, _assign(0, 0), _assign(1, 0), _finished(0, 0), _model(0, 100, (0,), 20.0), _finished(1, 0),
           ("m", JobCompleted(ts=21.0, source="t", job_id="j", final_key=final_key("j"), total_steps=100, jct_s=20.0,
                              completed_at=21.0))]
    assert events_lost(log, ["j"], set()) == 1


def test_rounds_lost_are_rounds_run_without_a_model_that_added_steps():
    log = [*BASE, _assign(0, 0), _model(0, 10, (0,), 20.0), _assign(1, 0), _model(1, 10, (0,), 30.0),
           _assign(2, 0), _assign(3, 0), _model(3, 30, (0,), 50.0)]
    assert rounds_lost(log, ["j"], set()) == {"j": 2}          # round 1 added nothing, round 2 undecided
    assert progress_times([e for _, e in log if isinstance(e, ModelConsolidated)]) == [20.0, 50.0]


def test_a_model_is_verified_against_its_replicas_uniformly_when_no_copy_trained(tmp_path):
    """The tracker averages copies uniformly when none trained a step (consolidate._weights);
    the verifier must recompute the same, and refuse a model that is not the average."""
    import asyncio

    import numpy as np
    from safetensors.numpy import save

    from benchmarks.fault_harness import _verify_one
    from shared.store import LocalStore

    async def check(model: np.ndarray, steps: tuple[int, int]) -> bool:
        store = LocalStore(tmp_path / f"store-{steps}-{float(model[0])}")
        await store.start()
        await store.put(checkpoint_key("j", 0, 0, node="n0"), save({"w": np.array([1.0, 3.0], dtype=np.float32)}))
        await store.put(checkpoint_key("j", 0, 1, node="n1"), save({"w": np.array([3.0, 5.0], dtype=np.float32)}))
        await store.put(model_key("j", 0), save({"w": model.astype(np.float32)}))
        event = ModelConsolidated(ts=1.0, source="t", job_id="j", round=0, key=model_key("j", 0), total_steps=0,
                                  copies=(CopyWeight(copy=0, steps=steps[0], weight=0.5),
                                          CopyWeight(copy=1, steps=steps[1], weight=0.5)))
        writers = {("j", 0, 0): "n0", ("j", 0, 1): "n1"}   # each copy's rank 0 (as _assign places them)
        return await _verify_one(store, event, {}, tmp_path / "scratch", writers=writers)

    assert asyncio.run(check(np.array([2.0, 4.0]), (0, 0)))          # uniform: no copy trained
    assert not asyncio.run(check(np.array([1.0, 3.0]), (0, 0)))
    assert asyncio.run(check(np.array([2.5, 4.5]), (1, 3)))          # 1/4 and 3/4 by samples


def _figures(**changes) -> dict:
    good = {"jobs_completed": 2, "jobs_total": 2, "models_verified": 5, "models_total": 5, "events_lost": 0,
            "service_crashes": 0, "rounds_lost_max": 1, "recovery_s": 3.0, "faults": 1, "done_before_fault": 1}
    return {**good, **changes}


def test_a_fault_that_ended_after_every_job_was_done_misses_the_targets():
    from benchmarks.faults import meets_targets

    assert meets_targets(_figures())
    assert not meets_targets(_figures(done_before_fault=2))       # the fault tested nothing
    assert not meets_targets(_figures(rounds_lost_max=2))         # more than one round per fault
    assert meets_targets(_figures(rounds_lost_max=2, faults=2))
    assert not meets_targets(_figures(models_verified=4))


def test_outage_scenarios_run_longer_jobs_than_the_others():
    from benchmarks.fault_harness import Workload
    from benchmarks.faults import SCENARIO_SCALE, scaled

    base = Workload()
    longer = scaled(base, SCENARIO_SCALE["minio_outage"])
    assert [n for _, _, n in longer.jobs] == [round(n * 3) for _, _, n in base.jobs]
    assert scaled(Workload(jobs=(("resnet", "digits", 1),)), 0.1).jobs == (("resnet", "digits", 1),)   # at least 1
