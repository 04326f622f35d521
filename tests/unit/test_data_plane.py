"""The data-plane cost model (shared/domain/data_plane.py) and the simulator's charges from it.

Numbers are chosen so every charge is a whole number of seconds and each rule shows up in
exactly one term; every expected figure is worked out in the comments from the module's rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.scheduler.policies import make_policy
from services.scheduler.sim.charges import checkpoint_figures
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.simulator import RoundObservation, SimOptions, simulate
from services.scheduler.sim.traces import generate_jobs
from shared.domain import workloads
from shared.domain.data_plane import DataPlane, consolidation_s, copy_charges, load_data_plane
from tests.unit.test_simulator import TABLE, ForkEverywhere, GreedyFifo, TaskLevelMixer, job, tiny_model

GB = 10**9
PLANE = DataPlane(store_upload_gbps=1.0, store_download_gbps=2.0, consolidate_gbps=4.0, intra_node_gbps=8.0,
                  inter_node_gbps=0.5, process_start_s=5.0, warm_start_s=1.0, source="test")
PROFILES = Path(__file__).resolve().parents[2] / "shared" / "domain" / "data" / "data_plane"


def test_warm_copy_of_a_new_job_pays_only_its_warm_start_and_its_upload() -> None:
    assert copy_charges(PLANE, checkpoint_bytes=4 * GB, weights_bytes=2 * GB, ranks_per_node=(1,), cold=False,
                        has_model=False) == (1.0, 4.0)


def test_cold_copy_loads_per_rank_on_its_busiest_node_and_broadcasts_across_nodes() -> None:
    # 5 s process start + 2 ranks x 4 GB / 2 GB/s on the busier node + 2 GB of weights / 0.5 GB/s
    start, end = copy_charges(PLANE, checkpoint_bytes=4 * GB, weights_bytes=2 * GB, ranks_per_node=(1, 2),
                              cold=True, has_model=True)
    assert (start, end) == (pytest.approx(5 + 4 + 4), pytest.approx(4.0))
    # on one node the broadcast goes at the intra-node rate: 2 GB / 8 GB/s
    start, _ = copy_charges(PLANE, checkpoint_bytes=4 * GB, weights_bytes=2 * GB, ranks_per_node=(2,),
                            cold=True, has_model=True)
    assert start == pytest.approx(5 + 4 + 0.25)
    # a kept group does not broadcast again
    start, _ = copy_charges(PLANE, checkpoint_bytes=4 * GB, weights_bytes=2 * GB, ranks_per_node=(2,),
                            cold=False, has_model=True)
    assert start == pytest.approx(1 + 4)


def test_consolidation_reads_every_replica_and_the_start_model_averages_and_writes_one() -> None:
    # 3 replicas + the start model read at 2 GB/s, 3 averaged at 4 GB/s, one written at 1 GB/s
    assert consolidation_s(PLANE, checkpoint_bytes=4 * GB, copies=3, has_model=True) == pytest.approx(8 + 3 + 4)
    assert consolidation_s(PLANE, checkpoint_bytes=4 * GB, copies=1, has_model=False) == pytest.approx(2 + 1 + 4)
    costs = [consolidation_s(PLANE, checkpoint_bytes=GB, copies=n, has_model=True) for n in range(1, 9)]
    assert costs == sorted(costs)


def test_bad_figures_and_files_are_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="store_upload_gbps must be > 0"):
        DataPlane(**{**PLANE.to_json(), "store_upload_gbps": 0})
    with pytest.raises(ValueError, match="process_start_s must be >= 0"):
        DataPlane(**{**PLANE.to_json(), "process_start_s": -1})
    with pytest.raises(ValueError, match="finite number"):
        DataPlane(**{**PLANE.to_json(), "warm_start_s": float("nan")})
    with pytest.raises(ValueError, match=r"unknown fields \['speed'\], missing \['warm_start_s'\]"):
        DataPlane.from_json({**{k: v for k, v in PLANE.to_json().items() if k != "warm_start_s"}, "speed": 1})
    assert DataPlane.from_json(json.loads(json.dumps(PLANE.to_json()))) == PLANE
    with pytest.raises(ValueError, match="at least one rank"):
        copy_charges(PLANE, checkpoint_bytes=1, weights_bytes=1, ranks_per_node=(), cold=True, has_model=False)


def test_the_measured_profiles_here_load() -> None:
    files = sorted(PROFILES.glob("*.json"))
    assert files, f"no measured data plane in {PROFILES}"
    for path in files:
        plane = load_data_plane(path)
        assert plane.source, f"{path.name} does not say how it was measured"


def test_a_bad_profile_file_names_itself(tmp_path: Path) -> None:
    bad = tmp_path / "plane.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"plane\.json: not a JSON object"):
        load_data_plane(bad)


def test_checkpoint_figures_know_gavel_types_and_sia_applications() -> None:
    assert checkpoint_figures("ResNet-50 (batch size 32)") == (workloads.model_bytes("ResNet-50 (batch size 32)"), 1)
    assert checkpoint_figures("bert (batch size 12, W=1)") == (109_483_778 * 4, 2)   # AdamW: two slots
    assert checkpoint_figures("nobody's model")[0] == 0


# ------------------------------------------------------------------ the simulator's charges

def _one_job_run(policy: object, plane: DataPlane, steps: int, nodes: str = "v100:2") -> list[RoundObservation]:
    seen: list[RoundObservation] = []
    simulate(policy=policy, cluster=parse_cluster(nodes), jobs=[job("m", 0, "M", steps)],  # type: ignore[arg-type]
             throughput=tiny_model({("M", "v100", 1): 1.0}), model_bytes=lambda _: 2 * GB,
             options=SimOptions(round_s=100, data_plane=plane, check=True), observer=seen.append)
    return seen


def test_a_kept_copy_pays_a_cold_start_once_then_a_warm_reload_every_round() -> None:
    # 2 GB weights + momentum = 4 GB checkpoint (unknown type "M": one optimizer slot).
    # r0: cold, no model: start 5; upload 4; consolidation 1 replica read 2 + average 1 + write 4.
    #     trains [5, 100 - 4 - 7] = 84 s.
    # r1+: warm with a model: start 1 + 4 GB / 2 = 3; consolidation reads 2 replicas' worth: 4 + 1 + 4.
    #     trains [3, 100 - 4 - 9] = 84 s.
    seen = _one_job_run(GreedyFifo(), PLANE, 1000)   # the same GPU every round
    assert [o.steps["m"] for o in seen[:3]] == pytest.approx([84.0, 84.0, 84.0])


def test_a_copy_moved_every_round_pays_process_start_and_a_load_every_round() -> None:
    # The mixer moves the copy each round: r0 as above (84 s); r1+: cold with a model:
    # start 5 + 2 = 7, trains [7, 87] = 80 s.
    seen = _one_job_run(TaskLevelMixer(), PLANE, 1000)
    assert [o.steps["m"] for o in seen[:3]] == pytest.approx([84.0, 80.0, 80.0])


def test_forked_copies_pay_one_consolidation_of_all_replicas_and_finish_after_it() -> None:
    # Two copies on two nodes, rate 1 each. r0: start 5 each, tail = upload 4 + (2 x 4/2 + 2 x 4/4 + 4) = 14:
    # each trains [5, 86] -> 162 steps. r1: warm + load = 3, tail = 4 + (3 x 2 + 2 + 4) = 16: 38 left at
    # rate 2 -> T = 3 + 19 = 22, completion 100 + 22 + 16 = 138.
    seen = _one_job_run(ForkEverywhere(), PLANE, 200)
    assert seen[0].steps["m"] == pytest.approx(162.0)
    assert seen[1].completions["m"] == pytest.approx(138.0)
    assert sum(seen[1].copy_steps.values()) == pytest.approx(38.0)


def test_restart_and_a_data_plane_are_not_charged_together() -> None:
    with pytest.raises(ValueError, match="give one or the other"):
        SimOptions(restart_s=30, data_plane=PLANE)


@pytest.mark.parametrize("policy_name", ["hadar", "hadare", "gavel", "tiresias", "yarn-cs"])
def test_samples_are_conserved_and_every_job_completes_under_the_data_plane(policy_name: str) -> None:
    jobs = generate_jobs(jobs=10, rate_per_hour=6.0, multi_gpu=True, rng=np.random.default_rng(3), throughput=TABLE)
    done: dict[str, float] = {}

    def check(o: RoundObservation) -> None:
        for job_id, steps in o.steps.items():
            workers = next(j.workers for j in o.request.jobs if j.job_id == job_id)
            own = sum(x * sum(len(p.gpus) for p in o.plan.placements if (p.job_id, p.copy) == key)
                      for key, x in o.copy_steps.items() if key[0] == job_id)
            assert own == pytest.approx(steps * workers, rel=1e-9, abs=1e-6)
            done[job_id] = done.get(job_id, 0.0) + steps

    plane = load_data_plane(sorted(PROFILES.glob("*.json"))[0])
    result = simulate(policy=make_policy(policy_name), cluster=parse_cluster("v100:2x4,p100:2x4,k80:8"),
                      jobs=jobs, throughput=TABLE, options=SimOptions(data_plane=plane, check=True), observer=check)
    assert result.stop_reason == "completed"
    assert {j.job_id: j.total_steps for j in jobs} == pytest.approx(done)
