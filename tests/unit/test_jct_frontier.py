"""``benchmarks/jct_frontier.py``: its MIP is the least sum of completions of non-preemptive
one-GPU schedules under a makespan cap, checked against enumeration on small instances."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from benchmarks.jct_frontier import least_completion


def _enumerate(p: np.ndarray, cap: int | None) -> tuple[float, float] | None:
    """(least sum of completions, its makespan) over every job -> GPU map, shortest first on each GPU."""
    n, m = p.shape
    best = None
    for gpus in itertools.product(range(m), repeat=n):
        total, loads = 0.0, []
        for i in range(m):
            times = sorted(p[j, i] for j in range(n) if gpus[j] == i)
            total += float(np.cumsum(times).sum()) if times else 0.0
            loads.append(sum(times))
        if cap is not None and max(loads) > cap:
            continue
        if best is None or total < best[0] - 1e-9:
            best = (total, float(max(loads)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_mip_matches_enumeration_with_and_without_a_cap(seed: int):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(2, 6)), int(rng.integers(1, 4))
    p = rng.integers(1, 30, size=(n, m))
    free = _enumerate(p, None)
    got = least_completion(p, None, time_limit=10)
    assert got["sum"] == pytest.approx(free[0])
    for cap in (int(free[1]), int(free[1]) - 1, int(np.ceil(p.min(axis=1).sum() / m))):   # the last may fit nothing
        want = _enumerate(p, cap)
        got = least_completion(p, cap, time_limit=10)
        if want is None:
            assert got is None
        else:
            assert got is not None and got["optimal"]
            assert got["sum"] == pytest.approx(want[0]) and got["makespan"] <= cap
