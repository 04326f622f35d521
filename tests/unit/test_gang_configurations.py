"""``benchmarks/gang_configurations.py``: Hall's condition decides whether whole gangs fit,
and column generation reaches the configuration LP that enumerating every configuration
solves."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import linprog

from benchmarks.gang_configurations import GangOption, configuration_lp, fits


def _fits_by_search(chosen: list[tuple[int, frozenset[int]]], count: list[int]) -> bool:
    """Whether each gang can take its W GPUs from its own types: every split tried."""
    def place(i: int, left: tuple[int, ...]) -> bool:
        if i == len(chosen):
            return True
        width, types = chosen[i]
        order = sorted(types)
        for split in itertools.product(*(range(left[r] + 1) for r in order)):
            if sum(split) == width:
                rest = list(left)
                for r, n in zip(order, split):
                    rest[r] -= n
                if place(i + 1, tuple(rest)):
                    return True
        return False
    return place(0, tuple(count))


@pytest.mark.parametrize("seed", range(40))
def test_halls_condition_is_whether_the_gangs_fit(seed: int):
    rng = np.random.default_rng(seed)
    count = [int(c) for c in rng.integers(0, 5, size=3)]
    chosen = []
    for _ in range(int(rng.integers(1, 4))):
        types = frozenset(int(r) for r in np.flatnonzero(rng.random(3) < 0.6)) or frozenset({0})
        chosen.append((int(rng.integers(1, 5)), types))
    assert fits(chosen, count) == _fits_by_search(chosen, count)


def test_two_gangs_that_cannot_share_four_gpus_take_turns():
    # the fluid LP would run them side by side, 3 + 2 GPUs of 4, in 12.5 s; whole, 20 s
    got = configuration_lp([3, 2], [[GangOption(types=frozenset({0}), rate=1.0)]] * 2, [10.0, 10.0], [4.0])
    assert got.converged
    assert got.value == pytest.approx(20.0)


def _by_enumeration(widths, options, steps, count) -> float:
    columns = []
    for pick in itertools.product(*[[None, *opts] for opts in options]):
        chosen = [(w, o.types) for w, o in zip(widths, pick) if o is not None]
        if chosen and fits(chosen, count):
            columns.append([0.0 if o is None else o.rate for o in pick])
    a = np.array(columns).T
    res = linprog(np.ones(a.shape[1]), A_ub=-a, b_ub=-np.asarray(steps, dtype=float), bounds=(0, None), method="highs")
    return float(res.fun)


@pytest.mark.parametrize("seed", range(12))
def test_column_generation_reaches_the_lp_over_every_configuration(seed: int):
    rng = np.random.default_rng(100 + seed)
    count = [float(c) for c in rng.integers(2, 7, size=2)]
    n = int(rng.integers(2, 6))
    widths = [int(rng.integers(1, 5)) for _ in range(n)]
    # every job may spread over both types (so it fits alone), and may have a faster one-type option
    options = [[GangOption(types=frozenset({0, 1}), rate=float(rng.uniform(0.5, 1.5)))]
               + [GangOption(types=frozenset({r}), rate=float(rng.uniform(0.5, 3.0))) for r in (0, 1)
                  if rng.random() < 0.7]
               for _ in range(n)]
    steps = [float(rng.uniform(10, 100)) for _ in range(n)]
    got = configuration_lp(widths, options, steps, count)
    assert got.converged
    assert got.value == pytest.approx(_by_enumeration(widths, options, steps, count), rel=2e-4)
    assert got.lower <= got.value <= got.lower * (1 + 2e-4)
