"""Hadar's dual subroutine: the cheapest schedule of one job at current prices.

Three steps (notation of ``hadar.py``'s docstring):

1. ``round_costs``: for each option o of the job and slot t, kappa_o(t) = the cost of the
   cheapest W GPUs the option may use at slot t (+inf if none), read from the ledger's
   tables (``hadar/ledger.Ledger``, kept up to date on every commit). Node option of type
   r: W x node_min[r, t, W], the price of a GPU of type r at t if a row of type r has >= W
   free GPUs. Spread option: the sum of the W smallest of marginal[r, t, 1..W] over the
   eligible types r (marginal[r, t, x] = type r's price if it has >= x free GPUs at t).
   Prices are per type and block of slots (``hadar/ledger``).
   O(K x H x R x W) for K options, H slots, R types.
2. ``best_choice``: the DP over rounds. For option o the job needs n_o = ceil(R / s_o)
   rounds (R remaining steps, s_o steps per round). D_o[tau][m], the least cost of m
   rounds among slots < tau, satisfies D[tau][m] = min(D[tau-1][m], D[tau-1][m-1] +
   kappa_o(tau-1)); its solution is the sum of the m smallest kappa_o in the prefix
   (``prefix_costs``: direct window sums when kappa_o is monotone, else a sort of each
   prefix, O(K H^2 log H)). Candidates: complete by tau (n_o <= tau <= H), payoff
   u(tau) - D_o[tau][n_o]. Only if no option can complete inside the horizon: partial
   (m < n_o rounds in it, the rest after it), payoff u(H + n_o - m) x m / n_o - D_o[H][m]
   (utility prorated by the share of work inside the horizon). The best payoff wins;
   ties go to the first option (node options before spread), then the earliest tau.
3. ``pick_gpus``: concrete rows for the chosen option and slots. First try one set of
   rows for all the chosen slots ("sticky": no migration between rounds): exactly where
   the job ran last round if the option may use those GPUs and they are free in every
   slot (any other placement restarts it), else rows by summed price over the slots,
   with enough free GPUs in every slot; fall back to the cheapest rows slot by slot
   (exactly the kappa of step 1). Price ties are broken by the profile's ``tie_order``.
   Keeping only part of the old placement would still restart the job, so it is all or
   nothing (a preference for the old rows among equally priced ones, tried first, left
   1.59 restarts per job on Sia's workloads against 1.43).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from services.scheduler.policies.hadar.ledger import Ledger
from services.scheduler.policies.hadar.profile import JobProfile


@dataclass(frozen=True, kw_only=True, eq=False)
class Choice:
    option: int            # index into the profile's options
    slots: np.ndarray      # chosen slots (relative to the round planned), ascending
    completion: float      # estimated completion, in rounds from now
    finishes: bool         # completes inside the horizon
    utility: float
    cost: float            # lower bound: per-slot cheapest GPUs
    payoff: float


def round_costs(ledger: Ledger, profile: JobProfile) -> np.ndarray:
    """kappa[o, t]: cost of the cheapest GPUs for option o at slot t (+inf when none)."""
    opts = profile.options
    w = profile.workers
    costs = np.empty((len(opts), ledger.horizon))
    node_idx = [i for i, o in enumerate(opts) if o.one_node]
    spread_idx = [i for i, o in enumerate(opts) if not o.one_node]
    if node_idx:
        costs[node_idx] = w * ledger.node_min[[opts[i].gpu_type for i in node_idx], :, w]
    if spread_idx:
        elig = np.array([opts[i].eligible for i in spread_idx])                  # (S, R)
        marg = np.where(elig[:, :, None, None], ledger.marginal[None, :, :, :w], np.inf)  # (S, R, H, W)
        marg = marg.transpose(0, 2, 1, 3).reshape(len(spread_idx), ledger.horizon, -1)
        cheapest = np.partition(marg, w - 1, axis=-1)[..., :w]
        costs[spread_idx] = cheapest.sum(axis=-1)
    return costs


def prefix_costs(costs: np.ndarray, need: np.ndarray) -> np.ndarray:
    """C[o, tau - 1] = sum of the need[o] smallest of costs[o, :tau] (+inf if fewer are finite).

    Rows that are +inf on a prefix and finite after it are summed directly when the finite
    part is non-increasing (the need slots just before tau) or non-decreasing (the first
    need finite slots); other rows sort every prefix (O(H^2 log H)).
    """
    k, h = costs.shape
    finite = np.isfinite(costs)
    if finite.all():
        step = np.diff(costs, axis=1)
        if not step.any():                      # every row constant: need x the price
            tau = np.arange(1, h + 1)[None, :]
            return np.where(tau >= need[:, None], (need * costs[:, 0])[:, None], np.inf)
        # axis given: arrays (numpy's stubs say "or a scalar")
        nonincreasing = cast(np.ndarray, (step <= 0).all(axis=1))
        nondecreasing = cast(np.ndarray, (step >= 0).all(axis=1))
        if (nonincreasing | nondecreasing).all():
            cs = np.zeros((k, h + 1))
            np.cumsum(costs, axis=1, out=cs[:, 1:])
            flat = cs.ravel()
            offset = (h + 1) * np.arange(k)
            start = np.arange(1, h + 1)[None, :] - need[:, None]
            window = cs[:, 1:] - flat[np.maximum(start, 0) + offset[:, None]]
            first = flat[offset + np.minimum(need, h)]
            out: np.ndarray = np.where(nonincreasing[:, None], window, first[:, None])
            out[start < 0] = np.inf
            return out
    n_inf = h - finite.sum(axis=1)
    suffix = (finite == (np.arange(h)[None, :] >= n_inf[:, None])).all(axis=1)
    vals = np.where(finite, costs, 0.0)
    step = np.where(np.arange(h - 1)[None, :] >= n_inf[:, None], np.diff(vals, axis=1), 0.0)
    nonincreasing = suffix & (step <= 0).all(axis=1)
    nondecreasing = suffix & (step >= 0).all(axis=1)
    cs = np.concatenate([np.zeros((k, 1)), np.cumsum(vals, axis=1)], axis=1)
    tau = np.arange(1, h + 1)[None, :]
    start = tau - need[:, None]
    ok = start >= n_inf[:, None]
    window = cs[:, 1:] - np.take_along_axis(cs, np.minimum(np.maximum(start, 0), h), axis=1)
    rows = np.arange(k)
    first = (cs[rows, np.minimum(n_inf + need, h)] - cs[rows, n_inf])[:, None]
    out = np.where(ok & nonincreasing[:, None], window, np.where(ok & nondecreasing[:, None], first, np.inf))
    for o in np.flatnonzero(~(nonincreasing | nondecreasing)):
        if need[o] <= h:
            prefix = np.where(np.tri(h, dtype=bool), costs[o][None, :], np.inf)
            prefix.sort(axis=-1)
            out[o] = np.cumsum(prefix[:, : need[o]], axis=-1)[:, -1]
            out[o, : need[o] - 1] = np.inf
    return out


def best_choice(costs: np.ndarray, steps: np.ndarray, remaining: float,
                utility_at: Callable[[np.ndarray], np.ndarray]) -> Choice | None:
    """The best-payoff schedule (payoff may be <= 0), or None if no schedule exists.

    ``steps[o]``: steps per round of option o (> 0); ``utility_at(tau)``: utility of
    completing tau rounds from now (elementwise, non-increasing). Partial schedules are
    candidates only when no option can complete the job inside the horizon.
    """
    k, h = costs.shape
    if k == 0 or remaining <= 0:
        return None
    need = np.maximum(1, np.ceil(remaining / steps - 1e-9)).astype(np.int64)
    taus = np.arange(1, h + 1)
    o: int | np.intp = 0
    j: int | np.intp = 0
    found = False
    if (need <= h).any():
        payoff = utility_at(taus.astype(float))[None, :] - prefix_costs(costs, need)
        o, j = np.unravel_index(int(np.argmax(payoff)), payoff.shape)
        found = bool(np.isfinite(payoff[o, j]))
    if found:
        slots = np.sort(np.argsort(costs[o, : j + 1], kind="stable")[: need[o]])
        finishes, completion = True, float(j + 1)
    else:
        m = taus[None, :]
        ordered = np.sort(costs, axis=1)
        partial_ok = (m < need[:, None]) & np.isfinite(ordered)
        if not partial_ok.any():
            return None
        eta = np.where(partial_ok, h + need[:, None] - m, h + 1).astype(float)
        value = utility_at(eta.ravel()).reshape(k, h) * (m / need[:, None])
        payoff = np.where(partial_ok, value - np.cumsum(ordered, axis=1), -np.inf)
        o, j = np.unravel_index(int(np.argmax(payoff)), payoff.shape)
        slots = np.sort(np.argsort(costs[o], kind="stable")[: j + 1])
        finishes, completion = False, float(h + need[o] - (j + 1))
    cost = float(costs[o, slots].sum())
    best = float(payoff[o, j])
    return Choice(option=int(o), slots=slots, completion=completion, finishes=finishes,
                  utility=best + cost, cost=cost, payoff=best)


def select_rows(price: np.ndarray, free: np.ndarray, allowed: np.ndarray, need: int, order: np.ndarray,
                one_row: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Cheapest ``need`` GPUs over rows (ties by ``order``): (rows, counts) or None."""
    p, f = price[order], free[order]
    ok = allowed[order] & (f >= (need if one_row else 1))
    pos = np.flatnonzero(ok)
    if not pos.size:
        return None
    vals = p[pos]
    if one_row:
        j = pos[int(np.argmin(vals))]
        return order[[j]], np.array([need])
    if f[pos].sum() < need:
        return None
    if pos.size > need:
        kth = np.partition(vals, need - 1)[need - 1]
        strict = vals < kth
        head = pos[strict][np.argsort(vals[strict], kind="stable")]
        pos = np.concatenate([head, pos[vals == kth][: need - head.size]])
    got = np.cumsum(f[pos])
    last = int(np.searchsorted(got, need))
    chosen = pos[: last + 1]
    counts = f[chosen].copy()
    counts[-1] -= got[last] - need
    return order[chosen], counts


def _runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [lo, hi) of consecutive slots."""
    if int(slots[-1]) - int(slots[0]) + 1 == slots.size:
        return [(int(slots[0]), int(slots[-1]) + 1)]
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [slots.size]])
    return [(int(slots[a]), int(slots[b - 1]) + 1) for a, b in zip(starts, ends)]


def _sticky(ledger: Ledger, profile: JobProfile, index: int, slots: np.ndarray,
            types: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """One set of rows for all ``slots``: cheapest by summed price (rows of one type cost the
    same: then the row with the least committed over the slots first), free in every slot.

    Candidate rows are examined cheapest first (ties in the profile's tie order), 4W at a
    time, until enough of them have the GPUs free in every slot.
    """
    option = profile.options[index]
    w = profile.workers
    need_free = w if option.one_node else 1
    cand = profile.candidates[index]
    if types is not None:
        cand = cand[types[ledger.layout.row_type[cand]]]
        if not cand.size:
            return None
    cum, fill = ledger.cum_type_price(), ledger.cum_fill
    runs = _runs(slots)
    by_type = sum(cum[:, hi] - cum[:, lo] for lo, hi in runs)      # (R,) summed price of a GPU of each type
    rank = np.unique(by_type, return_inverse=True)[1].reshape(-1)
    share = sum(fill[hi, cand] - fill[lo, cand] for lo, hi in runs) / slots.size   # in [0, 1]
    vals = 2.0 * rank[ledger.layout.row_type[cand]] + share   # by price, then emptiest row
    window = slice(runs[0][0], runs[0][1]) if len(runs) == 1 else slots
    take = min(cand.size, 4 * w)
    while take:
        if take < cand.size:
            kth = np.partition(vals, take - 1)[take - 1]
            pick = np.flatnonzero(vals < kth)
            pick = np.concatenate([pick, np.flatnonzero(vals == kth)[: take - pick.size]])
            pick = pick[np.argsort(vals[pick], kind="stable")]
        else:
            pick = np.argsort(vals, kind="stable")
        rows = cand[pick]
        free = ledger.cap[rows] - ledger.z[window][:, rows].max(axis=0)
        usable = free >= need_free
        if option.one_node:
            if usable.any():
                return rows[[int(np.argmax(usable))]], np.array([w])
        elif free[usable].sum() >= w:
            rows, free = rows[usable], free[usable]
            got = np.cumsum(free)
            last = int(np.searchsorted(got, w))
            counts = free[: last + 1].copy()
            counts[-1] -= got[last] - w
            return rows[: last + 1], counts
        if take == cand.size:
            return None
        take = min(cand.size, 4 * take)
    return None


def _keeps(ledger: Ledger, profile: JobProfile, index: int, slots: np.ndarray, types: np.ndarray | None,
           rows: np.ndarray, counts: np.ndarray) -> bool:
    """Whether option ``index`` can run on exactly ``counts`` GPUs of ``rows`` in every slot."""
    option = profile.options[index]
    row_type = ledger.layout.row_type[rows]
    if int(counts.sum()) != profile.workers or (option.one_node and rows.size != 1):
        return False
    if not option.eligible[row_type].all() or (types is not None and not types[row_type].all()):
        return False
    return bool((ledger.cap[rows] - ledger.z[slots][:, rows].max(axis=0) >= counts).all())


def pick_gpus(ledger: Ledger, profile: JobProfile, index: int, slots: np.ndarray, *, sticky: bool = True,
              types: np.ndarray | None = None,
              keep: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """(rows (k,), counts (len(slots), k), same rows in all slots) for option ``index``.

    With ``sticky``, the same rows in every slot when such rows exist: ``keep`` (rows,
    counts: where the job ran last round) when the option may use all of them and they are
    free in every slot, since any other placement is a restart; else the cheapest. Without,
    the cheapest rows slot by slot, which is exactly what ``round_costs`` priced. ``types``
    (bool per GPU type) narrows the option's eligible types: a spread option of level r may
    use every type at least as fast as r, and the cheapest of those is often an idle fast
    type that some other job was given. None if the GPUs are not there.
    """
    option = profile.options[index]
    if sticky and keep is not None and _keeps(ledger, profile, index, slots, types, *keep):
        return keep[0], np.repeat(keep[1][None, :], slots.size, axis=0), True
    found = _sticky(ledger, profile, index, slots, types) if sticky else None
    if found is not None:
        rows, counts = found
        return rows, np.repeat(counts[None, :], slots.size, axis=0), True
    row_type = ledger.layout.row_type
    allowed = option.eligible[row_type] if types is None else option.eligible[row_type] & types[row_type]
    per_slot = []
    for t in slots:
        got = select_rows(ledger.type_price[row_type, t], ledger.free(int(t)), allowed, profile.workers,
                          profile.tie_order,
                          option.one_node)
        if got is None:
            return None
        per_slot.append(got)
    rows = np.unique(np.concatenate([r for r, _ in per_slot]))
    counts = np.zeros((slots.size, rows.size), dtype=np.int64)
    for i, (r, c) in enumerate(per_slot):
        counts[i, np.searchsorted(rows, r)] = c
    return rows, counts, False
