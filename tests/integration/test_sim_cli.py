"""``hadar sim`` end to end on a tiny trace: summary.json, report.md, PNG plots, errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from services.cli.main import main
from services.scheduler.policies import _REGISTRY
from services.scheduler.sim.bounds import TtdBounds
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.report import (
    build_summary,
    format_text_table,
    render_markdown,
)
from services.scheduler.sim.results import PolicyResults, UnfinishedJob

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "small.csv"
METRIC_KEYS = {"ttd_s", "cru", "gru", "jct_mean_s", "jct_median_s", "jct_p95_s", "queue_delay_mean_s", "ftf_mean",
               "decision_ms_p50", "decision_ms_max", "jobs_total", "jobs_completed", "stop_reason", "unfinished",
               "ttd_bound", "ttd_bound_s", "ttd_over_bound"}
RATIO_KEYS = {"ttd", "cru", "jct_mean", "jct_median"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLANE = Path(__file__).resolve().parents[2] / "shared" / "domain" / "data" / "data_plane" / "dev-vm-minio.json"


def available_policies() -> list[str]:
    return [name for name, (module, _) in _REGISTRY.items() if importlib.util.find_spec(module) is not None]


def test_sim_writes_summary_report_and_plots(tmp_path, capsys) -> None:
    policies = available_policies()
    out = tmp_path / "out"
    code = main(["sim", "--cluster", "v100:2x2,p100:2,k80:4", "--trace", str(EXAMPLE),
                 "--policies", ",".join(policies), "--round-s", "120", "--seed", "3", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cluster"] == {"name": "v100:2x2,p100:2,k80:4", "nodes": 8, "gpus": {"k80": 4, "p100": 2, "v100": 4}}
    assert summary["trace"] == {"spec": str(EXAMPLE), "jobs": 8}
    assert list(summary["policies"]) == policies
    bounds = summary["bounds"]
    assert 0 < bounds["ttd_fork_s"] <= bounds["ttd_nofork_s"]
    for name, m in summary["policies"].items():
        assert set(m) == METRIC_KEYS | ({"vs_gavel"} if "gavel" in policies else set()), name
        assert (m["jobs_total"], m["jobs_completed"], m["unfinished"]) == (8, 8, []), name
        assert m["stop_reason"] == "completed"
        assert m["ttd_bound"] == ("fork" if name == "hadare" else "nofork")
        assert m["ttd_bound_s"] == bounds[f"ttd_{m['ttd_bound']}_s"]
        assert m["ttd_over_bound"] == pytest.approx(m["ttd_s"] / m["ttd_bound_s"]) and m["ttd_over_bound"] >= 1 - 1e-6
        assert set(m["gru"]) == {"k80", "p100", "v100"}
        assert 0 < m["cru"] <= 1 and m["ttd_s"] > 0 and m["jct_median_s"] <= m["jct_p95_s"]
    report = (out / "report.md").read_text()
    assert "| TTD (h) |" in report and all(f"`{p}`" in report for p in policies)
    assert ("## Ratios vs gavel" in report) == ("gavel" in policies)
    assert "| TTD / bound |" in report and "| TTD bound (h) |" in report
    for png in ("utilization.png", "jct_cdf.png", "ttd_bounds.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
        assert f"]({png})" in report
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == ["metric", *policies]
    assert "jobs completed" in printed


def test_same_input_gives_same_summary_apart_from_decision_times(tmp_path) -> None:
    args = ["sim", "--cluster", "aws-5", "--trace", "gen:jobs=6,rate=30,multi_gpu=false",
            "--policies", available_policies()[0], "--seed", "11"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b")]) == 0

    def stable(path: Path) -> dict:
        doc = json.loads((path / "summary.json").read_text())
        for m in doc["policies"].values():
            del m["decision_ms_p50"], m["decision_ms_max"]
        return doc
    assert stable(tmp_path / "a") == stable(tmp_path / "b")


@pytest.mark.parametrize("args, fragment", [
    (["--policies", "yarn-cs,fifo"], "unknown policy 'fifo'"),
    (["--cluster", "moon-9"], "unknown cluster 'moon-9'"),
    (["--cluster", "v100:2,b200:1"], "unknown GPU type 'b200'"),
    (["--trace", "gen:jobs=0"], "field jobs"),
    (["--round-s", "0"], "round_s must be positive"),
    (["--data-plane", "/nonexistent/plane.json"], "--data-plane: /nonexistent/plane.json"),
    (["--data-plane", str(PLANE), "--restart-s", "30"], "leave --restart-s out"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args: list[str], fragment: str) -> None:
    base = {"--cluster": "v100:2", "--trace": str(EXAMPLE), "--policies": "yarn-cs", "--out": str(tmp_path)}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["sim"] + [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hadar sim: error: ") and fragment in err and "\n" not in err
    assert not (tmp_path / "summary.json").exists()


def test_a_measured_data_plane_charges_every_move_and_the_report_says_so(tmp_path) -> None:
    runs = {}
    for label, extra in (("flat", []), ("plane", ["--data-plane", str(PLANE)])):
        out = tmp_path / label
        assert main(["sim", "--cluster", "v100:2x2,p100:2,k80:4", "--trace", str(EXAMPLE), "--policies",
                     "hadar,yarn-cs", "--round-s", "120", "--out", str(out), *extra]) == 0
        runs[label] = json.loads((out / "summary.json").read_text())
        assert runs[label]["charged"] in (out / "report.md").read_text()
    assert runs["flat"]["charged"].startswith("flat: restart 0 s")
    charged = runs["plane"]["charged"]
    assert charged.startswith("data plane: start ") and "benchmarks/data_plane.py" in charged
    for name in ("hadar", "yarn-cs"):
        assert runs["plane"]["policies"][name]["jobs_completed"] == 8
    # Under YARN-CS (first come, never preempted) costs only delay each job: later on average. Under
    # hadar they also change what it decides next, so neither way is guaranteed.
    assert runs["plane"]["policies"]["yarn-cs"]["jct_mean_s"] > runs["flat"]["policies"]["yarn-cs"]["jct_mean_s"]


def test_bad_trace_line_names_line_and_field(tmp_path, capsys) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("job_id,arrival_time_s,job_type,scale_factor,total_steps\n"
                     "a,0,A3C,1,100\nb,0,A3C,two,100\n")
    assert main(["sim", "--cluster", "v100:2", "--trace", str(trace), "--policies", "yarn-cs",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "line 3: field scale_factor" in err and "\n" not in err


def test_a_sia_job_list_runs_on_sia_s_table_with_its_restart_times(tmp_path, capsys) -> None:
    workload = Path(__file__).resolve().parents[2] / "shared/domain/data/sia/workloads/philly/workload-3.csv"
    trace = tmp_path / "sia.csv"
    trace.write_text("".join(workload.read_text().splitlines(keepends=True)[:13]))   # header + 12 jobs
    out = tmp_path / "out"
    assert main(["sim", "--cluster", "sia-64", "--trace", str(trace), "--policies", "gavel-throughput-sia,yarn-cs",
                 "--restart-s", "sia", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cluster"]["gpus"] == {"a100": 16, "rtx2080ti": 24, "t4": 24}
    assert all(m["jobs_completed"] == 12 and m["ttd_over_bound"] >= 1 - 1e-6 for m in summary["policies"].values())
    # Gavel's table has none of Sia's job types: the trace's first row says so.
    assert main(["sim", "--cluster", "sia-64", "--trace", str(trace), "--policies", "yarn-cs", "--table", "gavel",
                 "--out", str(tmp_path / "o")]) == 2
    assert "line 2: field batch_size" in capsys.readouterr().err


def policy_metrics(ttd: float | None, cru: float, jct: float, unfinished: tuple[str, ...] = ()) -> PolicyResults:
    return PolicyResults(
        ttd_s=ttd, cru=cru, gru={"v100": cru}, jct_mean_s=jct, jct_median_s=jct, jct_p95_s=jct,
        queue_delay_mean_s=0.0, ftf_mean=1.0, decision_ms_p50=1.0, decision_ms_max=2.0, jobs_total=3,
        jobs_completed=3 - len(unfinished), stop_reason="stalled" if unfinished else "completed",
        unfinished=tuple(UnfinishedJob(job_id=j, placed=False, reason="infeasible: too few GPUs")
                         for j in unfinished))


def test_report_ratios_against_gavel() -> None:
    cluster = parse_cluster("v100:1")
    summary = build_summary(cluster=cluster, trace="t", jobs=3, bounds=TtdBounds(ttd_fork_s=1800, ttd_nofork_s=3600),
                            metrics={"gavel": policy_metrics(7200, 0.5, 3600),
                                     "hadar": policy_metrics(3600, 0.75, 1800)},
                            gangs_only={"gavel": True, "hadar": True})
    assert summary["policies"]["hadar"]["vs_gavel"] == {"ttd": 2.0, "cru": 1.5, "jct_mean": 2.0, "jct_median": 2.0}
    assert summary["policies"]["gavel"]["ttd_over_bound"] == 2.0
    text = render_markdown(summary, plots=())
    assert "| TTD speedup (gavel / policy) | 1.00x | 2.00x |" in text
    assert "| CRU gain (policy / gavel) | 1.00x | 1.50x |" in text
    assert "| JCT mean speedup (gavel / policy) | 1.00x | 2.00x |" in text
    assert "| TTD (h) | 2.00 | 1.00 |" in text
    assert "| TTD bound (h) | 1.00 | 1.00 |" in text and "| TTD / bound | 2.00 | 1.00 |" in text
    del summary["policies"]["gavel"]
    del summary["policies"]["hadar"]["vs_gavel"]
    assert "Ratios" not in render_markdown(summary, plots=())
    assert "TTD speedup" not in format_text_table(summary["policies"])


def test_ratios_only_between_runs_that_completed_the_same_jobs() -> None:
    summary = build_summary(
        cluster=parse_cluster("v100:1"), trace="t", jobs=3, bounds=TtdBounds(ttd_fork_s=1800, ttd_nofork_s=3600),
        metrics={"gavel": policy_metrics(None, 0.5, 3600, unfinished=("c",)),
                 "hadar": policy_metrics(None, 0.6, 1800, unfinished=("c",)),
                 "hadare": policy_metrics(5400, 0.9, 1800)},
        gangs_only={"gavel": True, "hadar": True, "hadare": False})
    policies = summary["policies"]
    assert policies["gavel"]["ttd_s"] is None and policies["gavel"]["ttd_over_bound"] is None
    assert policies["hadar"]["vs_gavel"] == {"ttd": None, "cru": 1.2, "jct_mean": 2.0, "jct_median": 2.0}
    assert policies["hadare"]["vs_gavel"] == dict.fromkeys(RATIO_KEYS)
    assert policies["hadare"]["ttd_over_bound"] == 3.0
    text = format_text_table(policies)
    ttd_row = next(line for line in text.splitlines() if line.startswith("TTD (h)"))
    assert "n/a (1 job never placed: infeasible)" in ttd_row and "1.50" in ttd_row
    speedup = next(line for line in text.splitlines() if line.startswith("TTD speedup"))
    assert "0.50x" not in speedup and "n/a" in speedup


def test_unfinished_jobs_end_to_end(tmp_path, capsys) -> None:
    # A 4-worker job on two single-V100 nodes: no gang fits, Hadar cannot span 4 GPUs, HadarE
    # runs single-worker copies of it on both nodes.
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,arrival_time_s,job_type,scale_factor,total_steps\n"
                     "big,0,ResNet-18 (batch size 64),4,20000\nsmall,0,ResNet-18 (batch size 64),1,20000\n")
    out = tmp_path / "o"
    assert main(["sim", "--cluster", "v100:2", "--trace", str(trace), "--policies", "gavel,hadar,hadare",
                 "--out", str(out)]) == 0
    policies = json.loads((out / "summary.json").read_text())["policies"]
    for name in ("gavel", "hadar"):
        m = policies[name]
        assert (m["jobs_completed"], m["ttd_s"], m["ttd_over_bound"]) == (1, None, None), name
        (left,) = m["unfinished"]
        assert left["job"] == "big" and left["placed"] is False and left["reason"].startswith("infeasible")
    assert policies["hadar"]["vs_gavel"]["ttd"] is None and policies["hadar"]["vs_gavel"]["jct_mean"] is not None
    assert policies["hadare"]["jobs_completed"] == 2 and policies["hadare"]["ttd_over_bound"] >= 1 - 1e-6
    assert all(v is None for v in policies["hadare"]["vs_gavel"].values())
    printed = capsys.readouterr().out
    assert "n/a (1 job never placed: infeasible)" in printed
    assert "big" in (out / "report.md").read_text()
