"""Scores the roofline estimator (shared.domain.gpus) against Gavel's measured throughput table.

* mape: mean absolute percentage error of the raw, uncalibrated estimate against the
  measured "null" steps/s, over every (job type, GPU type in k80/p100/v100, scale)
  entry whose measured rate is nonzero;
* rank_correct_frac: fraction of job types (at scale 1, measured on all three types)
  for which the estimate orders K80, P100 and V100 exactly as the measurements do
  (a tie in the estimate counts as wrong);
* calibrated_mape (extra): the same error for what the simulator actually uses on GPU
  types the table lacks -- K80 and P100 predicted from the measured V100 rate times the
  estimator's K80/V100 (P100/V100) ratio, over entries measured on both.

Prints a per-job table, then, as its last line, one JSON object
{"mape": x, "rank_correct_frac": y, "job_types": n, "entries": m, "calibrated_mape": z}.
Run: ``.venv/bin/python benchmarks/estimator_error.py [--table PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler.core.throughput import ThroughputModel
from shared.domain.workloads import estimate

SCORED_TYPES = ("k80", "p100", "v100")


@dataclass(frozen=True, kw_only=True)
class Score:
    mape: float
    rank_correct_frac: float
    job_types: int
    entries: int
    calibrated_mape: float
    wrong_order: tuple[str, ...]


def _copy_rate(job_type: str, gpu_type: str, n: int) -> float:
    """The estimate in the model's unit: a copy's steps/s (the estimator counts a step per
    worker, ``ThroughputModel`` one step of the whole copy: ``shared.domain.progress``)."""
    return estimate(job_type, gpu_type, n) / n


def _order(rates: dict[str, float]) -> tuple[str, ...]:
    return tuple(sorted(rates, key=rates.__getitem__))


def score(model: ThroughputModel) -> Score:
    errors: list[float] = []
    for (job_type, gpu_type, n), measured in sorted(model.rates.items()):
        if gpu_type in SCORED_TYPES and measured > 0:
            errors.append(abs(_copy_rate(job_type, gpu_type, n) - measured) / measured)
    calibrated: list[float] = []
    for (job_type, gpu_type, n), measured in sorted(model.rates.items()):
        reference = model.rates.get((job_type, "v100", n), 0.0)
        reference_estimate = estimate(job_type, "v100", n)
        if gpu_type in ("k80", "p100") and measured > 0 and reference > 0 and reference_estimate > 0:
            ratio = estimate(job_type, gpu_type, n) / reference_estimate
            calibrated.append(abs(reference * ratio - measured) / measured)
    ranked = 0
    wrong: list[str] = []
    job_types = [j for j in model.job_types
                 if all((j, t, 1) in model.rates for t in SCORED_TYPES)]
    for job_type in job_types:
        measured_rates = {t: model.rates[(job_type, t, 1)] for t in SCORED_TYPES}
        estimated = {t: estimate(job_type, t, 1) for t in SCORED_TYPES}
        tie = len(set(estimated.values())) < len(estimated)
        if not tie and _order(measured_rates) == _order(estimated):
            ranked += 1
        else:
            wrong.append(job_type)
    return Score(mape=statistics.fmean(errors), rank_correct_frac=ranked / len(job_types),
                 job_types=len(job_types), entries=len(errors),
                 calibrated_mape=statistics.fmean(calibrated), wrong_order=tuple(wrong))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default=None, help="Gavel throughput JSON (packaged copy by default)")
    args = parser.parse_args(argv)
    model = ThroughputModel.from_gavel_table(args.table)
    print(f"{'job type':34s} {'n':>2s} " + " ".join(f"{t + ' meas/est':>17s}" for t in SCORED_TYPES))
    for job_type in model.job_types:
        for n in sorted({n for j, _, n in model.rates if j == job_type}):
            cells = []
            for t in SCORED_TYPES:
                measured = model.rates.get((job_type, t, n))
                shown = "-" if measured is None else f"{measured:7.2f}"
                cells.append(f"{shown:>8s}/{_copy_rate(job_type, t, n):8.2f}")
            print(f"{job_type:34s} {n:2d} " + " ".join(cells))
    result = score(model)
    print("wrong order at scale 1: " + (", ".join(result.wrong_order) or "none"))
    print(json.dumps({"mape": round(result.mape, 4), "rank_correct_frac": round(result.rank_correct_frac, 4),
                      "job_types": result.job_types, "entries": result.entries,
                      "calibrated_mape": round(result.calibrated_mape, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
