"""Which GPU types each job should train on this round: the makespan LP's type split.

The fork lower bound (``services/scheduler/sim/bounds.py``) is an LP over GPU-seconds; solved on
the *remaining* work of the active jobs at the round start, its optimum says how a
makespan-optimal run divides each GPU type among the jobs. HadarE's priced pass lets a job
use only the types this split gives it (its back-fill pass may use any), so jobs that
are efficient on a slow type are kept for it instead of finishing early on the fast types
and leaving the slow ones to jobs that crawl there at the end.

Ties. The LP has many optimal splits; a second LP picks, among those within ``slack`` of
the optimal T (default 1%), the one that minimises sum_j u_j sum_r X[j,r] with u_j the
job's urgency (Smith's ratio, normalised): the jobs first in line get the types on which
their work takes the fewest GPU-seconds, the others take up the rest.

LP: the makespan LP of ``policies/lp/model.py`` on :func:`~services.scheduler.policies.lp.model.fork_lp`'s
data (divisible work, all jobs present now). Result: for each job,
the types r with X[j,r] > SHARE_EPS x its GPU-seconds (a job with none keeps every type
it can run on). Solved with scipy's HiGHS; on failure every job keeps every type.
Cost: two LPs with J x R + 1 variables and J + R + J x R rows per round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import JobState
from services.scheduler.policies.lp.highs import solve as solve_lp
from services.scheduler.policies.lp.model import Columns, fork_lp, makespan_lp

__all__ = ["type_split", "SHARE_EPS"]

SHARE_EPS = 1e-6


def type_split(jobs: Sequence[JobState], cluster: Cluster,
               credited: Callable[[JobState, str, int], float], *,
               urgency: Sequence[float] | None = None, slack: float = 0.0) -> dict[str, set[str]]:
    """job id -> the GPU types the makespan LP gives it (see module docstring)."""
    if not jobs or not cluster.types:
        return {}
    lp = fork_lp(jobs, cluster, credited)
    types, rho = lp.types, lp.rho
    n_j, n_r = rho.shape
    cols = Columns.of(lp)
    cost, a_ub, b_ub, upper = makespan_lp(lp, cols)
    res = solve_lp(cost, a_ub, b_ub, upper)
    if res.ok and urgency is not None:
        # among splits within (1 + slack) of the optimal T: fewest GPU-seconds for urgent jobs
        weights = np.asarray(urgency, dtype=float)
        weights = weights / max(float(weights.max()), 1e-300)
        n_c = cols.job.size
        second = np.concatenate([weights[cols.job], np.zeros(cost.size - n_c)])
        upper[n_c] = (0.0, float(res.x[n_c]) * (1.0 + slack))
        again = solve_lp(second, a_ub, b_ub, upper)
        if again.ok:
            res = again
    everything = {j.job_id: {r for r, v in zip(types, rho[i]) if v > 0} for i, j in enumerate(jobs)}
    if not res.ok:
        return everything
    x = cols.per_job_type(res.x[:cols.job.size], (n_j, n_r))
    out = {}
    for i, j in enumerate(jobs):
        total = x[i].sum()
        got = {types[r] for r in range(n_r) if x[i, r] > SHARE_EPS * max(total, 1e-12)}
        out[j.job_id] = got or everything[j.job_id]
    return out
