"""The direct HiGHS door returns what scipy's linprog returns, vertex for vertex.

The policies' pinned results (Sia's streams, the sweep's tables) were computed through
``linprog(method="highs")``; moving to the binding must not move one of them, so where both
run the same HiGHS release the comparison is exact equality of the optimal point, not a
tolerance. A scipy that bundles another release may pick another optimal vertex among ties:
then the optimal values must still agree.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, csr_matrix
from scipy.sparse import random as sparse_random

from services.scheduler.policies.lp.highs import solve, solver_version


def _scipy_highs() -> str | None:
    try:   # scipy does not publish its bundled HiGHS's version; read it where it keeps it
        from scipy.optimize._highspy import _core
    except ImportError:
        return None
    return f"{_core.HIGHS_VERSION_MAJOR}.{_core.HIGHS_VERSION_MINOR}.{_core.HIGHS_VERSION_PATCH}"


SAME_RELEASE = _scipy_highs() == solver_version()


def _lp(seed: int) -> tuple[np.ndarray, object, np.ndarray, list[tuple[float, float | None]]]:
    rng = np.random.default_rng(seed)
    m, n = int(rng.integers(3, 40)), int(rng.integers(3, 120))
    a = sparse_random(m, n, density=0.25, random_state=seed, format="csr")
    cost = -rng.random(n)
    cost[rng.random(n) < 0.3] = 0.0                   # ties: many optimal vertices
    b = rng.random(m) * 3.0
    bounds = [(0.0, 1.0 if rng.random() < 0.6 else None) for _ in range(n)]
    return cost, a, b, bounds


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("method", ["highs", "highs-ds"])
def test_the_same_vertex_as_linprog(seed: int, method: str) -> None:
    cost, a, b, bounds = _lp(seed)
    ref = linprog(cost, A_ub=a, b_ub=b, bounds=bounds, method=method)
    got = solve(cost, a, b, bounds, simplex_only=method == "highs-ds")
    assert got.ok == (ref.status == 0)
    if got.ok:
        assert float(cost @ got.x) == pytest.approx(ref.fun, rel=1e-9, abs=1e-9)
        if SAME_RELEASE:
            np.testing.assert_array_equal(got.x, ref.x)


def test_bounds_in_each_form_linprog_takes() -> None:
    cost, a, b, _ = _lp(3)
    n = cost.size
    pairs = [(0.0, 0.5)] * n
    for form in ((0.0, 0.5), pairs, np.array(pairs)):
        got = solve(cost, a, b, form)
        np.testing.assert_array_equal(got.x, linprog(cost, A_ub=a, b_ub=b, bounds=form, method="highs").x)
    default = solve(cost, a, b)
    np.testing.assert_array_equal(default.x, linprog(cost, A_ub=a, b_ub=b, method="highs").x)


def test_dense_and_coo_with_repeated_entries() -> None:
    # coo entries at one place add up, as in linprog (the cuts modules build such matrices).
    a = coo_matrix(([1.0, 1.0, 1.0], ([0, 0, 1], [0, 0, 1])), shape=(2, 2))
    got = solve(np.array([-1.0, -1.0]), a, np.array([1.0, 1.0]))
    np.testing.assert_allclose(got.x, [0.5, 1.0])
    dense = solve(np.array([-1.0, -1.0]), a.toarray(), np.array([1.0, 1.0]))
    np.testing.assert_array_equal(dense.x, got.x)


def test_infeasible_and_unbounded_say_so() -> None:
    infeasible = solve(np.array([1.0]), np.array([[1.0]]), np.array([-1.0]), [(0.0, None)])
    assert not infeasible.ok and "nfeasible" in infeasible.message
    unbounded = solve(np.array([-1.0]), np.array([[-1.0]]), np.array([1.0]), [(0.0, None)])
    assert not unbounded.ok and "nbounded" in unbounded.message


def test_no_rows_or_no_columns() -> None:
    free = solve(np.array([-1.0, 2.0]), csr_matrix((0, 2)), np.zeros(0), [(0.0, 3.0), (1.0, 4.0)])
    np.testing.assert_array_equal(free.x, [3.0, 1.0])
    assert solve(np.zeros(0), csr_matrix((2, 0)), np.ones(2)).ok
    assert not solve(np.zeros(0), csr_matrix((2, 0)), np.array([1.0, -1.0])).ok


def test_a_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="columns"):
        solve(np.zeros(3), np.ones((2, 2)), np.ones(2))
    with pytest.raises(ValueError, match="rows"):
        solve(np.zeros(2), np.ones((2, 2)), np.ones(3))
    with pytest.raises(ValueError, match="bounds"):
        solve(np.zeros(2), np.ones((2, 2)), np.ones(2), [(0.0, 1.0)] * 3)


def test_an_answer_does_not_depend_on_what_was_solved_before_or_where() -> None:
    first = [solve(*_lp(seed)) for seed in (5, 6, 7)]
    again = [solve(*_lp(seed)) for seed in (7, 6, 5)][::-1]
    with ThreadPoolExecutor(max_workers=2) as pool:
        elsewhere = list(pool.map(lambda seed: solve(*_lp(seed)), (5, 6, 7)))
    for a, b, c in zip(first, again, elsewhere):
        assert a.ok and b.ok and c.ok
        np.testing.assert_array_equal(a.x, b.x)
        np.testing.assert_array_equal(a.x, c.x)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_solving_keeps_no_memory_per_call() -> None:
    # A fresh highspy.Highs() per call left ~0.3 KiB each that no collection freed: these
    # 6,000 solves grew the process by ~1.9 MiB; with one solver per thread, by nothing.
    cost, a, b, bounds = _lp(11)
    for _ in range(200):
        solve(cost, a, b, bounds)
    before = _rss_kib()
    for _ in range(6000):
        solve(cost, a, b, bounds)
    assert _rss_kib() - before < 512


@pytest.mark.parametrize("seed", range(20))
def test_integer_columns_give_the_optimum_brute_force_gives_and_nothing_on_stdout(seed, capfd):
    # A knapsack with a side constraint and one continuous slack column: small enough to
    # enumerate. HiGHS's MIP prints repaired incumbents to stdout from C++ under some
    # options (lp/highs._mip_options); stdout carries the services' JSON logs.
    rng = np.random.default_rng(seed)
    n = 7
    value, weight, other = rng.integers(1, 20, n), rng.integers(1, 10, n), rng.integers(0, 5, n)
    cap = float(weight.sum() // 2)
    a_ub = np.vstack([np.append(weight, 0.0), np.append(other, -1.0)])
    cost = np.append(-value, 0.5).astype(float)          # the slack s >= other . x - 6 costs 0.5 a unit
    got = solve(cost, a_ub, np.array([cap, 6.0]), [(0, 1)] * n + [(0, None)],
                integral=np.array([True] * n + [False]))
    assert got.ok and np.allclose(got.x[:n], np.round(got.x[:n]))
    best = min(-value @ x + 0.5 * max(0.0, other @ x - 6.0)
               for x in (np.array([(k >> i) & 1 for i in range(n)]) for k in range(2 ** n)) if weight @ x <= cap)
    assert cost @ got.x == pytest.approx(best, abs=1e-6)
    assert capfd.readouterr().out == ""
