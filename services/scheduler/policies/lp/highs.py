"""The one door to the LP solver: HiGHS, called through its own Python binding.

Every LP of the policies and the simulator's bounds has the form

    minimise cost . x   subject to   a_ub @ x <= b_ub,   lower <= x <= upper

and is solved here. scipy's ``linprog(method="highs")`` runs the same solver, but around each
solve it re-checks every option, converts the inputs twice and fills the bound marginals in a
Python loop: 1.76 ms a call against 0.58 ms here on a 20 x 40 LP; on the first six days of
Hadar's Philly replay (small LPs, two a round) that wrapper was a quarter of the run. The
model HiGHS receives is the one ``linprog`` hands it (the matrix column-wise in canonical
order, the same bounds, presolve on, dual simplex), and ``pyproject.toml`` pins highspy to
the HiGHS release scipy bundles, so the same vertex comes back bit for bit
(``tests/unit/test_lp_highs.py`` holds them side by side).

Each thread has one solver, cleared before every call: no basis carries over from one LP to
the next, so an answer never depends on what was solved before it, and calls from several
threads share nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import highspy  # type: ignore[import-untyped]
import numpy as np
from scipy.sparse import csc_array, issparse

# A bound pair as linprog takes it: (lower, upper), None for unbounded on that side.
Bound = tuple[float | None, float | None]
Bounds = Sequence[Bound] | Bound | np.ndarray


@dataclass(frozen=True, kw_only=True)
class LpResult:
    """``x`` is the optimal point when ``ok``; otherwise ``message`` says why there is none."""

    ok: bool
    x: np.ndarray
    message: str


def solver_version() -> str:
    """The HiGHS release that solves (``major.minor.patch``)."""
    return str(_solver().version())


def _options(*, simplex_only: bool) -> highspy.HighsOptions:
    options = highspy.HighsOptions()
    options.presolve = "on"
    options.output_flag = False
    options.log_to_console = False
    options.simplex_strategy = 1        # dual simplex, as linprog asks
    if simplex_only:
        options.solver = "simplex"
    return options


_CHOOSE = _options(simplex_only=False)
_SIMPLEX = _options(simplex_only=True)


MIP_MAX_NODES = 20_000
MIP_ABS_GAP = 1e-7


def _mip_options() -> highspy.HighsOptions:
    """Branch and bound on the model as given. HiGHS 1.12 prints
    ``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();`` to stdout
    from C++, whatever ``output_flag`` says, whenever it repairs an incumbent that fails on
    the original model: one found on the presolved model, by a sub-MIP heuristic, or after
    its symmetry handling or a root restart. Stdout carries the services' JSON log lines, so
    all of those are off; the seat MIPs (``hadar/seats``) are small enough not to need them.
    A node limit rather than a time limit keeps the answer independent of the machine's load."""
    options = _options(simplex_only=False)
    options.presolve = "off"
    options.mip_detect_symmetry = False
    options.mip_heuristic_run_rins = False
    options.mip_heuristic_run_rens = False
    options.mip_heuristic_run_root_reduced_cost = False
    options.mip_heuristic_run_zi_round = False
    options.mip_heuristic_run_shifting = False
    options.mip_heuristic_run_feasibility_jump = False
    options.mip_max_nodes = MIP_MAX_NODES
    options.mip_rel_gap = 0.0           # proven optimal: a model's own small tie-break terms decide
    options.mip_abs_gap = MIP_ABS_GAP
    return options


_MIP = _mip_options()


_PER_THREAD = threading.local()


def _solver() -> highspy.Highs:
    """This thread's solver, cleared: no model, basis, solution or option carries over.

    One per thread rather than one per call: each ``highspy.Highs()`` leaves about 0.3 KiB
    behind that no collection frees (its callback objects hold it from C++), which over a
    Philly replay's 52,000 LPs, or a scheduler's months of rounds, is memory never returned.
    """
    solver = getattr(_PER_THREAD, "solver", None)
    if solver is None:
        solver = _PER_THREAD.solver = highspy.Highs()
    solver.clear()
    return solver


def _column_bounds(bounds: Bounds | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    if bounds is None:
        return np.zeros(n), np.full(n, np.inf)
    pairs = np.array(bounds, dtype=float)          # None -> nan
    if pairs.ndim == 1:
        pairs = np.broadcast_to(pairs, (n, 2))
    if pairs.shape != (n, 2):
        raise ValueError(f"bounds have shape {pairs.shape}, the LP has {n} columns")
    lower = np.where(np.isnan(pairs[:, 0]), -np.inf, pairs[:, 0])
    upper = np.where(np.isnan(pairs[:, 1]), np.inf, pairs[:, 1])
    return lower, upper


def solve(cost: np.ndarray, a_ub: object, b_ub: np.ndarray, bounds: Bounds | None = None,
          *, simplex_only: bool = False, integral: np.ndarray | None = None) -> LpResult:
    """Minimise ``cost . x`` subject to ``a_ub @ x <= b_ub`` and the column bounds.

    ``a_ub`` is a scipy sparse matrix or a dense array; ``bounds`` is a pair for every column,
    one pair for all, an (n, 2) array, or None for ``x >= 0`` (linprog's conventions).
    ``simplex_only`` keeps HiGHS on the simplex (linprog's ``method="highs-ds"``), so the
    answer is a vertex. ``integral`` (bool per column) makes those columns integer: a MIP,
    solved to optimality (within MIP_ABS_GAP of the objective) in at most MIP_MAX_NODES
    branch-and-bound nodes (``ok`` False past it).
    """
    c = np.ascontiguousarray(cost, dtype=float)
    n = c.size
    matrix = csc_array(a_ub if issparse(a_ub) else np.atleast_2d(np.asarray(a_ub, dtype=float)))
    matrix.sum_duplicates()                       # canonical: sorted rows, no repeats
    m = matrix.shape[0]
    if matrix.shape[1] != n:
        raise ValueError(f"a_ub has {matrix.shape[1]} columns, cost has {n}")
    lower, upper = _column_bounds(bounds, n)
    rhs = np.asarray(b_ub, dtype=float)
    if rhs.shape != (m,):
        raise ValueError(f"b_ub has shape {rhs.shape}, a_ub has {m} rows")
    if n == 0:   # HiGHS calls a model without columns empty, not solved: 0 <= b_ub decides
        feasible = bool(np.all(rhs >= 0.0))
        return LpResult(ok=feasible, x=np.empty(0), message="optimal" if feasible else "Infeasible")
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = m
    lp.col_cost_ = c
    lp.col_lower_ = lower
    lp.col_upper_ = upper
    lp.row_lower_ = np.full(m, -np.inf)
    lp.row_upper_ = rhs
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = n
    lp.a_matrix_.num_row_ = m
    lp.a_matrix_.start_ = matrix.indptr
    lp.a_matrix_.index_ = matrix.indices
    lp.a_matrix_.value_ = matrix.data
    mip = integral is not None and bool(np.any(integral))
    if mip:
        lp.integrality_ = [highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous
                           for flag in np.asarray(integral, dtype=bool).tolist()]
    solver = _solver()
    solver.passOptions(_MIP if mip else _SIMPLEX if simplex_only else _CHOOSE)
    if mip:   # a root restart re-presolves (the options object does not carry this one)
        solver.setOptionValue("mip_allow_restart", False)
    if solver.passModel(lp) == highspy.HighsStatus.kError:
        return LpResult(ok=False, x=np.empty(0), message="HiGHS refused the model")
    solver.run()
    status = solver.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        return LpResult(ok=False, x=np.empty(0), message=solver.modelStatusToString(status))
    return LpResult(ok=True, x=np.array(solver.getSolution().col_value), message="optimal")
