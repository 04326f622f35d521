"""benchmarks/sweep.py: its summary rules, and one tiny grid end to end on the real simulator."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest


def _load():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep.py"
    spec = importlib.util.spec_from_file_location("bench_sweep", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sweep"] = module
    spec.loader.exec_module(module)
    return module


sweep = _load()


def _row(policy, seed, ttd, jct, bound, unfinished=()):
    return {"cluster": "c", "mix": "single", "arrivals": "zero", "jobs": 5, "seed": seed, "policy": policy,
            "ttd_s": ttd, "jct_mean_s": jct, "completed": 5 - len(unfinished), "total": 5,
            "unfinished": sorted(unfinished), "bound_kind": "nofork", "bound_s": bound}


def test_ratios_only_between_runs_that_completed_the_same_jobs_and_bound_violations_are_listed():
    rows = [_row("gavel", 1, 200.0, 100.0, 100.0), _row("hadar", 1, 100.0, 50.0, 100.0),
            _row("gavel", 2, 300.0, 90.0, 100.0), _row("hadar", 2, None, None, 100.0, unfinished=("j1",)),
            _row("gavel", 3, 120.0, 60.0, 100.0), _row("hadar", 3, 90.0, 60.0, 100.0)]   # 90 < its bound
    cells, violations = sweep.summarize(rows)
    hadar = next(c for c in cells if c["policy"] == "hadar")
    assert hadar["seeds"] == 3 and hadar["done"] == 2 and hadar["n_x"] == 2
    assert hadar["ttd_x"] == pytest.approx((2.0 + 120 / 90) / 2, abs=1e-3)
    assert hadar["jct_x"] == pytest.approx((2.0 + 1.0) / 2, abs=1e-3)
    assert [(v["policy"], v["seed"]) for v in violations] == [("hadar", 3)]
    assert "(2/3 done)" in sweep.markdown(cells, ("gavel", "hadar"))


@pytest.mark.slow
def test_a_tiny_grid_runs_and_ends_with_one_json_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["sweep.py", "--clusters", "lab-5", "--jobs", "5", "--mixes", "single",
                                      "--arrivals", "zero", "--seeds", "1", "--policies", "gavel,hadar",
                                      "--out", str(tmp_path)])
    sweep.main()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(last)
    assert out["violations"] == [] and {c["policy"] for c in out["cells"]} == {"gavel", "hadar"}
    assert (tmp_path / "sweep.md").exists() and (tmp_path / "sweep_lab-5_single_zero.png").exists()


def test_policy_options_reach_only_the_named_policy_and_seeds_start_where_asked(tmp_path, capsys, monkeypatch):
    task = sweep.Task(cluster="lab-5", mix="single", arrivals="zero", jobs=3, seed=2, rate=0.0, round_s=360.0,
                      policies=("gavel", "hadar"), options=(("hadar", "horizon", 0),))
    with pytest.raises(ValueError, match="horizon"):     # the option got to Hadar's constructor
        sweep.run_task(task)
    args = ["sweep.py", "--clusters", "lab-5", "--jobs", "3", "--mixes", "single", "--arrivals", "zero",
            "--seeds", "1", "--first-seed", "4", "--policies", "gavel,hadar",
            "--policy-option", "hadar:critical_slack=0.1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", args + ["--policy-option", "gavel:horizon=0"])
    with pytest.raises(TypeError, match="horizon"):       # gavel's option goes to gavel alone
        sweep.main()
    monkeypatch.setattr(sys, "argv", args)
    sweep.main()
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["seed"] for r in rows} == {4} and {r["policy"] for r in rows} == {"gavel", "hadar"}
