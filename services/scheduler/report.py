"""Side-by-side comparison of simulated policies: summary dict, text table, Markdown, plots.

Everything here is pure: functions return strings, dicts and matplotlib ``Figure`` objects
(built without pyplot, so no global backend state; ``Figure.savefig`` renders with Agg).
The CLI writes them to disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from services.scheduler.cluster import Cluster
from services.scheduler.metrics import PolicyMetrics, completed_jcts_s, utilization_series
from services.scheduler.simulator import SimResult

BASELINE = "gavel"


def build_summary(*, cluster: Cluster, trace: str, jobs: int,
                  metrics: Mapping[str, PolicyMetrics]) -> dict[str, Any]:
    """The ``summary.json`` document: cluster, trace and per-policy metrics (seconds, ms)."""
    return {
        "cluster": {"name": cluster.name, "nodes": len(cluster.nodes), "gpus": dict(cluster.gpus_by_type)},
        "trace": {"spec": trace, "jobs": jobs},
        "policies": {name: m.as_dict() for name, m in metrics.items()},
    }


def _hours(x: float | None) -> str:
    return "-" if x is None else f"{x / 3600:.2f}"


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None or den == 0 else f"{num / den:.2f}x"


def table_rows(policies: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """Rows of [metric, value per policy...] from the ``policies`` part of the summary."""
    gpu_types = sorted({t for p in policies.values() for t in p["gru"]})
    spec: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("TTD (h)", lambda p: _hours(p["ttd_s"])),
        ("CRU", lambda p: _frac(p["cru"])),
        *[(f"GRU {t}", lambda p, t=t: _frac(p["gru"].get(t))) for t in gpu_types],
        ("JCT mean (h)", lambda p: _hours(p["jct_mean_s"])),
        ("JCT median (h)", lambda p: _hours(p["jct_median_s"])),
        ("JCT p95 (h)", lambda p: _hours(p["jct_p95_s"])),
        ("queue delay mean (h)", lambda p: _hours(p["queue_delay_mean_s"])),
        ("FTF mean", lambda p: _frac(p["ftf_mean"])),
        ("decision p50 (ms)", lambda p: _ms(p["decision_ms_p50"])),
        ("decision max (ms)", lambda p: _ms(p["decision_ms_max"])),
        ("jobs completed", lambda p: f"{p['jobs_completed']}/{p['jobs_total']}"),
    ]
    return [[label, *(fmt(p) for p in policies.values())] for label, fmt in spec]


def ratio_rows(policies: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """Ratios vs gavel (>1 is better than gavel in every row); empty without gavel."""
    base = policies.get(BASELINE)
    if base is None:
        return []
    return [
        ["TTD speedup (gavel / policy)", *(_ratio(base["ttd_s"], p["ttd_s"]) for p in policies.values())],
        ["CRU gain (policy / gavel)", *(_ratio(p["cru"], base["cru"]) for p in policies.values())],
        ["JCT mean speedup (gavel / policy)",
         *(_ratio(base["jct_mean_s"], p["jct_mean_s"]) for p in policies.values())],
        ["JCT median speedup (gavel / policy)",
         *(_ratio(base["jct_median_s"], p["jct_median_s"]) for p in policies.values())],
    ]


def format_text_table(policies: Mapping[str, Mapping[str, Any]]) -> str:
    header = ["metric", *policies]
    rows = [header, *table_rows(policies), *ratio_rows(policies)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(summary: Mapping[str, Any], *, stop_reasons: Mapping[str, str],
                    plots: Sequence[str] = ()) -> str:
    policies = summary["policies"]
    cluster, trace = summary["cluster"], summary["trace"]
    gpus = ", ".join(f"{n} {t}" for t, n in cluster["gpus"].items())
    parts = [
        "# Simulation report",
        "",
        f"- Cluster: `{cluster['name']}` ({cluster['nodes']} nodes; {gpus})",
        f"- Trace: `{trace['spec']}` ({trace['jobs']} jobs)",
        "- Policies: " + ", ".join(f"`{name}` (stopped: {stop_reasons.get(name, '?')})" for name in policies),
        "",
        "## Metrics",
        "",
        _markdown_table(["metric", *policies], table_rows(policies)),
    ]
    ratios = ratio_rows(policies)
    if ratios:
        parts += ["", f"## Ratios vs {BASELINE}", "", _markdown_table(["ratio", *policies], ratios)]
    parts += ["", "TTD: first arrival to last completion. CRU/GRU: busy GPU-seconds over available "
              "GPU-seconds during TTD. FTF: JCT over the job's isolated JCT on its best GPU type."]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(parts) + "\n"


def plot_utilization(results: Sequence[SimResult]) -> Figure:
    """Busy fraction of the cluster per round, one line per policy, hours since the first round."""
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for result in results:
        t, util = utilization_series(result)
        if len(t):
            ax.step(np.append(t, t[-1] + result.round_s) / 3600, np.append(util, util[-1]), where="post",
                    label=result.policy, linewidth=1)
    ax.set_xlabel("time since first round (h)")
    ax.set_ylabel("cluster utilization (busy GPU fraction)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()
    return fig


def plot_jct_cdf(results: Sequence[SimResult]) -> Figure:
    """Empirical CDF of completed jobs' JCT, one line per policy (log-scale hours)."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    plotted = False
    for result in results:
        jcts = np.asarray(completed_jcts_s(result)) / 3600
        if len(jcts):
            ax.step(jcts, np.arange(1, len(jcts) + 1) / len(result.jobs), where="post", label=result.policy)
            plotted = True
    if plotted:
        ax.set_xscale("log")
        ax.legend()
    ax.set_xlabel("job completion time (h)")
    ax.set_ylabel("fraction of jobs completed")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    return fig
