"""Side-by-side comparison of simulated policies: summary dict, text table, Markdown, plots.

Everything here is pure: functions return strings, dicts and matplotlib ``Figure`` objects
(built without pyplot, so no global backend state; ``Figure.savefig`` renders with Agg).
The CLI writes them to disk.

Summary (``summary.json``): the cluster, the trace, ``bounds`` (``bounds.py``: the TTD no
policy can beat, with and without forking) and per policy its metrics (``metrics.py``)
plus ``ttd_bound`` ("nofork" for a run where every job ran as one W-worker copy and the
policy does not fork, else "fork"), ``ttd_bound_s``
and ``ttd_over_bound`` (TTD / that bound; null when TTD or the bound is). With gavel in
the run, each policy also gets ``vs_gavel``: TTD and mean/median JCT as gavel / policy,
CRU as policy / gavel (> 1 is better than gavel in every one). A ratio is computed only
between runs that completed the same jobs (null otherwise), and a TTD ratio only between
runs that completed every job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from services.scheduler.core.cluster import Cluster
from services.scheduler.sim.bounds import TtdBounds, bound_for
from services.scheduler.sim.fairness import QueueFairness
from services.scheduler.sim.results import (
    PolicyResults,
    completed_jcts_s,
    utilization_series,
)
from services.scheduler.sim.simulator import SimResult
from shared.wire.queues import QueueConfig

BASELINE = "gavel"
RATIOS = (("ttd", "ttd_s", True), ("cru", "cru", False), ("jct_mean", "jct_mean_s", True),
          ("jct_median", "jct_median_s", True))  # (key, metric, lower is better)


def _div(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def _unfinished_ids(policy: Mapping[str, Any]) -> set[str]:
    return {u["job"] for u in policy["unfinished"]}


def versus(policy: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float | None]:
    """Ratios of ``policy`` against ``base`` (> 1: policy better); all None unless both
    completed the same jobs."""
    same = _unfinished_ids(policy) == _unfinished_ids(base)
    return {key: (_div(base[metric], policy[metric]) if lower else _div(policy[metric], base[metric])) if same
            else None for key, metric, lower in RATIOS}


def build_summary(*, cluster: Cluster, trace: str, jobs: int, metrics: Mapping[str, PolicyResults],
                  bounds: TtdBounds, gangs_only: Mapping[str, bool], queue_config: QueueConfig | None = None,
                  fairness: Mapping[str, QueueFairness] | None = None, charged: str | None = None) -> dict[str, Any]:
    """The ``summary.json`` document (module docstring); seconds and ms. ``queue_config`` and
    ``fairness`` (per policy) only for runs under queues; ``charged``: what moving state cost
    (``SimOptions.charges().describe()``)."""
    policies: dict[str, dict[str, Any]] = {}
    for name, m in metrics.items():
        kind, bound = bound_for(name, bounds, gangs_only=gangs_only.get(name, False))
        policies[name] = {**m.as_dict(), "ttd_bound": kind, "ttd_bound_s": bound,
                          "ttd_over_bound": _div(m.ttd_s, bound)}
    if BASELINE in policies:
        base = dict(policies[BASELINE])
        for p in policies.values():
            p["vs_gavel"] = versus(p, base)
    for name, f in (fairness or {}).items():
        policies[name]["queues"] = f.as_dict()
    out: dict[str, Any] = {
        "cluster": {"name": cluster.name, "nodes": len(cluster.nodes), "gpus": dict(cluster.gpus_by_type)},
        "trace": {"spec": trace, "jobs": jobs},
        "bounds": {"ttd_fork_s": bounds.ttd_fork_s, "ttd_nofork_s": bounds.ttd_nofork_s},
        "policies": policies,
    }
    if charged is not None:
        out["charged"] = charged
    if queue_config is not None:
        out["queues"] = {"default_queue": queue_config.default_queue,
                         "fair_share_half_life_s": queue_config.fair_share_half_life_s,
                         "queues": {q.name: {"weight": q.weight, "quota": dict(q.quota),
                                             "borrowing_limit": q.borrowing_limit} for q in queue_config.queues}}
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _unfinished_note(policy: Mapping[str, Any]) -> str:
    """``n/a (2 jobs never placed: infeasible; 1 job unfinished)`` for a TTD that is null."""
    left = policy["unfinished"]
    never = [u for u in left if not u["placed"]]
    parts = []
    if never:
        codes = sorted({u["reason"].split(":", 1)[0] for u in never})
        parts.append(f"{_plural(len(never), 'job')} never placed: {', '.join(codes)}")
    if len(left) > len(never):
        parts.append(f"{_plural(len(left) - len(never), 'job')} unfinished")
    return f"n/a ({'; '.join(parts)})" if parts else "n/a"


def _hours(x: float | None) -> str:
    return "-" if x is None else f"{x / 3600:.2f}"


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ttd(p: Mapping[str, Any]) -> str:
    return _unfinished_note(p) if p["ttd_s"] is None else _hours(p["ttd_s"])


def table_rows(policies: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """Rows of [metric, value per policy...] from the ``policies`` part of the summary."""
    gpu_types = sorted({t for p in policies.values() for t in p["gru"]})
    spec: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("TTD (h)", _ttd),
        ("TTD bound (h)", lambda p: _hours(p["ttd_bound_s"])),
        ("TTD / bound", lambda p: _times(p["ttd_over_bound"])),
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
    """Ratios vs gavel from each policy's ``vs_gavel`` (> 1 is better than gavel in every
    row); empty without gavel."""
    base = policies.get(BASELINE)
    if base is None:
        return []

    def cell(p: Mapping[str, Any], key: str) -> str:
        value = p["vs_gavel"][key]
        if value is not None:
            return f"{value:.2f}x"
        return "n/a (other jobs completed)" if _unfinished_ids(p) != _unfinished_ids(base) else "n/a"

    labels = {"ttd": "TTD speedup (gavel / policy)", "cru": "CRU gain (policy / gavel)",
              "jct_mean": "JCT mean speedup (gavel / policy)", "jct_median": "JCT median speedup (gavel / policy)"}
    return [[label, *(cell(p, key) for p in policies.values())] for key, label in labels.items()]


def _share(share: float | None, ratio: float | None) -> str:
    return "-" if share is None or ratio is None else f"{share:.3f} ({ratio:.2f}x)"


def queue_rows(policies: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """Per-queue rows from each policy's ``queues`` (fairness.py); empty without queues.
    A share cell is ``share (share / weight share)``."""
    runs: list[Mapping[str, Any] | None] = [p.get("queues") for p in policies.values()]
    first = next((r for r in runs if r), None)
    if first is None:
        return []

    def row(label: str, fmt: Callable[[Mapping[str, Any]], str]) -> list[str]:
        return [label, *("-" if not r else fmt(r) for r in runs)]

    rows = [row("all queues active (h)", lambda r: _hours(r["contended_s"])),
            row("all queues backlogged (h)", lambda r: _hours(r["backlogged_s"])),
            row("Jain (share / weight)", lambda r: _frac(r["jain"])),
            row("Jain backlogged", lambda r: _frac(r["backlogged_jain"])),
            row("rho mean", lambda r: _times(r["rho_mean"])),
            row("rho max", lambda r: _times(r["rho_max"]))]
    for q, figures in first["queues"].items():
        def cells(fmt: Callable[[Mapping[str, Any]], str], q: str = q) -> Callable[[Mapping[str, Any]], str]:
            return lambda r: fmt(r["queues"][q])
        rows += [
            row(f"{q}: jobs completed", cells(lambda f: f"{f['completed']}/{f['jobs']}")),
            row(f"{q}: JCT mean (h)", cells(lambda f: _hours(f["jct_mean_s"]))),
            row(f"{q}: JCT p95 (h)", cells(lambda f: _hours(f["jct_p95_s"]))),
            row(f"{q}: share (weight {figures['weight_share']:.3f})",
                cells(lambda f: _share(f["share"], f["share_ratio"]))),
            row(f"{q}: share backlogged", cells(lambda f: _share(f["backlogged_share"], f["backlogged_ratio"]))),
            row(f"{q}: rho mean", cells(lambda f: _times(f["rho_mean"]))),
            row(f"{q}: rho max", cells(lambda f: _times(f["rho_max"]))),
        ]
    return rows


def format_text_table(policies: Mapping[str, Mapping[str, Any]]) -> str:
    header = ["metric", *policies]
    rows = [header, *table_rows(policies), *ratio_rows(policies), *queue_rows(policies)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(summary: Mapping[str, Any], *, plots: Sequence[str] = ()) -> str:
    policies = summary["policies"]
    cluster, trace, bounds = summary["cluster"], summary["trace"], summary["bounds"]
    gpus = ", ".join(f"{n} {t}" for t, n in cluster["gpus"].items())
    parts = [
        "# Simulation report",
        "",
        f"- Cluster: `{cluster['name']}` ({cluster['nodes']} nodes; {gpus})",
        f"- Trace: `{trace['spec']}` ({trace['jobs']} jobs)",
        "- Policies: " + ", ".join(f"`{name}` (stopped: {p['stop_reason']})" for name, p in policies.items()),
        f"- TTD lower bounds: {_hours(bounds['ttd_fork_s'])} h with forking, {_hours(bounds['ttd_nofork_s'])} h "
        "without (no policy can beat them; `services/scheduler/sim/bounds.py`)",
        *([f"- Charged for moving state: {summary['charged']}"] if "charged" in summary else []),
        "",
        "## Metrics",
        "",
        _markdown_table(["metric", *policies], table_rows(policies)),
    ]
    ratios = ratio_rows(policies)
    if ratios:
        parts += ["", f"## Ratios vs {BASELINE}", "", _markdown_table(["ratio", *policies], ratios),
                  "", "Ratios only between runs that completed the same jobs; TTD ratios only between runs "
                  "that completed all of them."]
    queues = queue_rows(policies)
    if queues:
        weights = ", ".join(f"`{name}` {q['weight']:g}" for name, q in summary["queues"]["queues"].items())
        parts += ["", "## Queues", "", f"Weights: {weights}; default queue `{summary['queues']['default_queue']}`.",
                  "", _markdown_table(["queue figure", *policies], queues),
                  "", "Share: the queue's normalized GPU-seconds over all queues' while every queue had an active "
                  "job (backlogged: while every queue asked for at least its weight share of the GPUs), and in "
                  "parentheses over its weight share. Jain: Jain's index of those ratios. rho: JCT over the "
                  "job's JCT alone on 1/N of the cluster (N queues; `services/scheduler/sim/fairness.py`)."]
    unfinished = [[name, u["job"], "yes" if u["placed"] else "no", u["reason"]]
                  for name, p in policies.items() for u in p["unfinished"]]
    if unfinished:
        parts += ["", "## Unfinished jobs", "", _markdown_table(["policy", "job", "placed", "reason"], unfinished)]
    parts += ["", "TTD: first arrival to last completion (n/a if a job is left). TTD bound: the LP bound "
              "that applies to the policy (with forking for HadarE). CRU/GRU: busy GPU-seconds over "
              "available GPU-seconds during TTD (during the run if a job is left). FTF: JCT over the "
              "job's isolated JCT on its best GPU type."]
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


def plot_ttd_bounds(summary: Mapping[str, Any]) -> Figure:
    """TTD per policy (no bar where a job is left) against the fork and no-fork bounds, hours."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    names = list(summary["policies"])
    ttds = [summary["policies"][n]["ttd_s"] for n in names]
    ax.bar(range(len(names)), [0.0 if t is None else t / 3600 for t in ttds], color="tab:blue")
    for i, t in enumerate(ttds):
        if t is None:
            ax.annotate("n/a", (i, 0), ha="center", va="bottom")
    for key, label, style in (("ttd_nofork_s", "bound without forking", "--"),
                              ("ttd_fork_s", "bound with forking", ":")):
        bound = summary["bounds"][key]
        if bound is not None:
            ax.axhline(bound / 3600, color="black", linestyle=style, linewidth=1, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time to drain the trace (h)")
    ax.grid(alpha=0.3, axis="y")
    if ax.get_lines():
        ax.legend()
    return fig
