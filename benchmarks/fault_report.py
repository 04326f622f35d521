"""The fault benchmark's verdict and table: :func:`meets_targets` and :func:`table`.

Targets (issues 13 and 28): every job completes, every model verifies, 0 events lost, 0
acknowledged records lost, 0 service crashes, no round number published twice or skipped,
at most one round lost per job per fault, a standby in charge within two round lengths,
nothing published by a superseded scheduler after its successor, nothing acknowledged with
two brokers of three down and writes resumed once one returned; and the fault hit something
(a miss -- the fault found nothing to hit -- or an error never meets them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FIELDS", "meets_targets", "table"]

FIELDS = ("jobs_completed", "jobs_total", "models_verified", "models_total", "events_lost", "acked_records_lost",
          "service_crashes", "rounds_lost_max", "recovery_s", "miss")


def meets_targets(figures: dict[str, Any]) -> bool:
    """Whether one scenario's figures meet every target (module doc)."""
    if figures.get("miss") or figures.get("error") or figures.get("jobs_completed") is None:
        return False
    faults = figures.get("faults", 0)
    notes = figures.get("notes", {})
    takeovers = figures.get("takeover_s", [])
    round_s = figures.get("round_s")
    return (figures["jobs_completed"] == figures["jobs_total"] and figures["models_verified"] == figures["models_total"]
            and figures["models_total"] > 0 and figures["events_lost"] == 0 and figures["service_crashes"] == 0
            and figures.get("acked_records_lost", 0) == 0
            and figures["rounds_lost_max"] <= faults and figures.get("round_numbering_faults", 0) == 0
            and figures.get("fencing_violations", 0) == 0
            and (not takeovers or round_s is None or max(takeovers) <= 2 * round_s)
            and notes.get("acked_while_minority", 0) == 0
            and ("writes_resumed_s" not in notes or notes["writes_resumed_s"] is not None)
            and (faults == 0 or figures.get("done_before_fault", 0) < figures["jobs_total"]))


def _of(figures: dict[str, Any], done: str, total: str) -> str:
    if figures.get(done) is None:
        return "-"
    return f"{figures[done]}/{figures[total]}"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _notes(figures: dict[str, Any]) -> str:
    said = []
    if figures.get("miss"):
        said.append(f"MISS: {figures['miss']}")
    if figures.get("error"):
        said.append(f"ERROR: {figures['error']}")
    notes = figures.get("notes", {})
    for key in ("writes_resumed_s", "acked_while_minority", "held_till_return", "consolidating"):
        if key in notes:
            said.append(f"{key}={_num(notes[key])}")
    if figures.get("fencing_violations"):
        said.append(f"fencing_violations={figures['fencing_violations']}")
    if figures.get("round_numbering_faults"):
        said.append(f"round_numbering_faults={figures['round_numbering_faults']}")
    return "; ".join(said)


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per scenario; a miss or an error is spelled out, never shown as 0 jobs."""
    head = ("scenario", "jobs", "models ok", "events lost", "acked lost", "crashes", "rounds lost", "recovery s",
            "takeover s", "done before", "wall s", "meets", "notes")
    rows = [head]
    for name, f in results.items():
        takeovers = f.get("takeover_s") or []
        rows.append((name, _of(f, "jobs_completed", "jobs_total"), _of(f, "models_verified", "models_total"),
                     _num(f.get("events_lost")), _num(f.get("acked_records_lost")), _num(f.get("service_crashes")),
                     _num(f.get("rounds_lost_max")), _num(f.get("recovery_s")),
                     ",".join(f"{t:.1f}" for t in takeovers) or "-", _num(f.get("done_before_fault")),
                     f"{f.get('wall_s', 0):.0f}", "yes" if meets_targets(f) else "NO", _notes(f)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
