"""Scores the roofline estimator against Sia's measured step times (data it was not fitted on).

Data: Sia's artifact (github.com/siasosp23/artifacts, SOSP'23), ``shared/domain/data/sia``:
five applications' step times on one node of T4s (``aws``), RTX 2080 Tis (``rtx``) and A100s
(``dgx-ext``). Figures: ``shared.domain.sia_figures``. Scored, per the issue's two figures:

* mape: mean absolute percentage error of the estimated samples/s per GPU against the
  measured ``local_bsz / step_time``, over every row of a one-node placement (1 to 8 GPUs,
  each with the figures for that many replicas; an estimate that says the batch does not
  fit counts as rate 0, a 100% error);
* pair_correct_frac: over (application, pair of GPU types), the fraction where the
  estimate says which of the two is faster as the measurements do, each application at
  the largest per-GPU batch measured on one GPU of all three types (step times
  interpolated between measured batches, as the simulator reads them);
* mape_largest_batch: the same error over each (application, type)'s largest batch on one
  GPU only, where the GPU's work dominates the step (at small batches the fixed cost per
  step -- 20-400 ms in these profiles, mostly framework ops, AdaptDL's per-tensor gradient
  statistics among them -- decides the step time);
* factor: the geometric mean of max(est/meas, meas/est) over the same rows -- symmetric,
  where MAPE caps an underestimate at 100% and so rewards "does not fit" over a rate 3x
  too high -- and how many rows the estimate wrongly says do not fit;
* per-type MAPE, and the same figures with every application's ``tf32`` off, side by side
  (the main figures use each application's own ``tf32``);
* mape_anchored: the error once the job was measured on one other type, as the profiler then
  re-estimates (``services.profiler.estimate.anchored_rates``): for every row and every other
  type measured at the same placement and batch (step times interpolated as above), that
  type's measured rate times the estimate's ratio of the two types; per (measured, estimated)
  type pair too.

Prints a table per application, then one JSON object as its last line.
Run: ``.venv/bin/python benchmarks/estimator_sia.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler.sim.sia_profiles import APPLICATIONS, CLUSTER_GPU_TYPE, AppProfile
from shared.domain import gpus
from shared.domain.sia_figures import sia_figures
from shared.domain.workloads import JobFigures


@dataclass(frozen=True, kw_only=True)
class SiaScore:
    mape: float
    mape_by_type: dict[str, float]
    mape_largest_batch: float
    factor: float
    unfit: int
    pair_correct_frac: float
    pairs: int
    rows: int
    wrong_pairs: tuple[str, ...]
    mape_anchored: float
    mape_anchored_by_pair: dict[str, float]


def _rate(figures: JobFigures, gpu_type: str, n: int) -> float:
    """Estimated samples/s per GPU at ``figures.batch_size`` per GPU on ``n`` GPUs of a node."""
    step = gpus.estimate_step(gpus.gpu_spec(gpu_type), figures, n)
    return figures.batch_size / step.step_s if step.fits else 0.0


def score(*, tf32: bool | None = None, verbose: bool = False) -> SiaScore:
    """``tf32``: None scores each application's figures as they are; False turns TF32 off for all."""
    def figures(app: str, batch: int, replicas: int = 1) -> JobFigures:
        job = sia_figures(app, batch, replicas)
        return job if tf32 is None else replace(job, tf32=tf32)

    errors: dict[str, list[float]] = {t: [] for t in CLUSTER_GPU_TYPE.values()}
    largest: list[float] = []
    logs: list[float] = []
    unfit = 0
    pairs: list[bool] = []
    wrong: list[str] = []
    anchored: dict[str, list[float]] = {}
    for app in APPLICATIONS:
        profiles = {t: AppProfile.load(app, cluster) for cluster, t in CLUSTER_GPU_TYPE.items()}
        for t, profile in profiles.items():
            for row in profile.rows:
                if len(row.placement) != 1:
                    continue
                measured = row.local_bsz / row.step_s
                n = row.placement[0]
                estimated = _rate(figures(app, row.local_bsz, n), t, n)
                errors[t].append(abs(estimated - measured) / measured)
                if estimated > 0:
                    logs.append(abs(math.log(estimated / measured)))
                else:
                    unfit += 1
                for anchor, other in profiles.items():
                    step = other.step_and_sync_s((n,), row.local_bsz) if anchor != t else None
                    at_anchor = _rate(figures(app, row.local_bsz, n), anchor, n)
                    if step is not None and at_anchor > 0:
                        guess = row.local_bsz / step[0] * estimated / at_anchor
                        anchored.setdefault(f"{anchor}->{t}", []).append(abs(guess - measured) / measured)
            top = max((r for r in profile.rows if r.placement == (1,)), key=lambda r: r.local_bsz)
            measured = top.local_bsz / top.step_s
            largest.append(abs(_rate(figures(app, top.local_bsz), t, 1) - measured) / measured)
        single = {t: sorted(r.local_bsz for r in p.rows if r.placement == (1,)) for t, p in profiles.items()}
        batch = min(b[-1] for b in single.values())
        measured_rate: dict[str, float] = {}
        for t, profile in profiles.items():
            step = profile.step_and_sync_s((1,), batch)
            if step is not None:
                measured_rate[t] = batch / step[0]
        estimated_rate = {t: _rate(figures(app, batch), t, 1) for t in measured_rate}
        for a, b in itertools.combinations(sorted(measured_rate), 2):
            right = (measured_rate[a] > measured_rate[b]) == (estimated_rate[a] > estimated_rate[b])
            pairs.append(right)
            if not right:
                wrong.append(f"{app}@{batch}: {a}/{b}")
        if verbose:
            cells = "  ".join(f"{t} {measured_rate[t]:7.1f}/{estimated_rate[t]:7.1f}" for t in sorted(measured_rate))
            print(f"{app:12s} batch {batch:4d}  samples/s measured/estimated: {cells}")
    everything = [e for es in errors.values() for e in es]
    return SiaScore(mape=statistics.fmean(everything),
                    mape_by_type={t: statistics.fmean(es) for t, es in errors.items() if es},
                    mape_largest_batch=statistics.fmean(largest),
                    factor=math.exp(statistics.fmean(logs)), unfit=unfit,
                    pair_correct_frac=sum(pairs) / len(pairs), pairs=len(pairs), rows=len(everything),
                    wrong_pairs=tuple(wrong),
                    mape_anchored=statistics.fmean(e for es in anchored.values() for e in es),
                    mape_anchored_by_pair={k: statistics.fmean(es) for k, es in sorted(anchored.items())})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    before = score(tf32=False)
    after = score(verbose=True)
    for name, result in (("every tf32 off", before), ("as figured", after)):
        by_type = ", ".join(f"{t} {m:.2f}" for t, m in result.mape_by_type.items())
        by_pair = ", ".join(f"{k} {m:.2f}" for k, m in result.mape_anchored_by_pair.items())
        print(f"{name}: mape {result.mape:.2f} ({by_type}), at the largest batch "
              f"{result.mape_largest_batch:.2f}; factor {result.factor:.2f} ({result.unfit} rows unfit); "
              f"pairs right {result.pair_correct_frac:.2f}; "
              f"wrong: {', '.join(result.wrong_pairs) or 'none'}; after one measured type: mape "
              f"{result.mape_anchored:.2f} ({by_pair})")
    print(json.dumps({"mape": round(after.mape, 4), "pair_correct_frac": round(after.pair_correct_frac, 4),
                      "pairs": after.pairs, "rows": after.rows,
                      "mape_by_type": {t: round(m, 4) for t, m in after.mape_by_type.items()},
                      "mape_largest_batch": round(after.mape_largest_batch, 4),
                      "factor": round(after.factor, 4), "unfit_rows": after.unfit,
                      "factor_without_tf32": round(before.factor, 4),
                      "mape_without_tf32": round(before.mape, 4),
                      "mape_largest_batch_without_tf32": round(before.mape_largest_batch, 4),
                      "pair_correct_frac_without_tf32": round(before.pair_correct_frac, 4),
                      "mape_anchored": round(after.mape_anchored, 4),
                      "mape_anchored_by_pair": {k: round(m, 4) for k, m in after.mape_anchored_by_pair.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
