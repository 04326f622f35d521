"""Seats for the round's due gangs, chosen together: which run, and on exactly which GPUs.

Why. The timeline rule (``hadar/timeline``) rounds the LP's slice of this round to whole
gangs. Rounded one at a time (``gangs.whole_gangs``: by how overdue, then Smith's order), the
first gangs take GPUs a later one needed; and a gang named only by the GPU types it may use
takes, at its row choice, GPUs counted for another. Traced on Sia's workload 2 (every job
at the first arrival, no restarts) 0.63 critical gangs a round were chosen and not placed,
and each such round of the gang that ends last moved the target end E.

Formulation, for the gangs whose *due* (``gangs.gang_dues``: the part of this round the
LP gives the gang, plus its rounding credit) is positive, on the cluster's rows (h = one GPU
type on one node, C_h GPUs). A seat is one of the gang's placement options
(``hadar/profile.Option``) on concrete rows: a node option of type r on one row of type r
with C_h >= W; a spread option as integer GPUs n_h on rows of its eligible types, summing
to W. Binary z (node seat on row h) and y (spread seat), integer n. Constraints: each gang
at most one seat (run_g); GPUs of each row at most C_h; GPUs of each type at most C_r less
``reserved_r`` (the tight and near-tight single-GPU jobs', ``gangs.tight_singles``: never
the GPU of the job that sets E); sum_g W_g run_g at most the rounding's budget plus half
the widest gang (as ``gangs.whole_gangs``); kept_g only on the gang's seat of last round
(the same GPUs on every row: anything else restarts it); d_r >= GPUs of type r seated
beyond those the LP leaves after its single-GPU jobs. Two objectives, in turn
(lexicographic, as the one-at-a-time rounding decides: which gangs run, by their dues
alone, then where):

    1. max  sum_g W_g due_g (1 + TIE (1 - rank_g)) run_g
    2. max  sum_go W_g due_g (PREFER fit_go + RATE rate_o / best_g) seat_go
            + sum_g W_g (MOVE_SHARE due_g min(1, restart_g / round) + KEEP_BONUS) kept_g
            - DISPLACE sum_r d_r - FAST_GPU (speed of each spread seat's GPUs) - ROW_TIE (row index)
       with the first objective held at its optimum.

rank_g is the gang's place in Smith's order over [0, 1); fit_go the part of W the LP's
slice gives gang g on option o's types; rate_o / best_g the option's planned rate over the
gang's fastest.

Weights. Which gangs run is decided first, by their dues alone: with a price on the GPUs of
single-GPU jobs inside one objective, gangs stayed off their turn (a flat 3 per GPU ended
the gang-heavy trace of README "Known limits" 1.052 / 1.080 / 1.058x the bound on seeds 2,
3 and 6, against 1.040-1.048). Where they run trades three things, measured on that trace
(seeds 1-6) and on Sia's eight streams with Sia's restarts (``--policies hadar``):

* the option's rate (RATE = 0.5 of the rate ratio per GPU and unit of due): at 0.02 (in one
  objective with the others) gangs kept slow spread seats, and Sia's streams ran 36% more GPU-hours than before seats;
* a GPU the slice gives a single-GPU job (DISPLACE per GPU): at 0.1 gangs took those for
  faster seats, mean JCT +4.1% on the gang-heavy trace; at 1 gangs took slow seats rather
  than any, and seeds 3 and 6 ended 1.061 / 1.055x the bound. At 0.3 the trace ends
  1.040-1.047x at mean JCT -3.4%, and Sia's streams 1.46x at -6.5% against the one-at-a-time
  rounding (README "Results");
* keeping the seat of last round: a quarter of the share of the round a restart costs
  (measured on the first formulation, on Sia's streams: the whole share 1.77x the bound;
  0.5 / 0.25 / 0.125 / 0: 1.53 / 1.50 / 1.53 / 1.56x).

PREFER (the LP's types) at 1 rather than 0.04 gave the same on the gang-heavy trace and
1.55x on Sia's streams.

Off by default (Hadar's ``seat_gangs``). On aws-5-multi seed 3 an 8-GPU gang seated on the
fast GPUs of the single-GPU job that later sets E ended the run 3.5% after the laxity rule
(``test_hadar_timeline``'s ``test_gangs_end_no_later_than_under_the_laxity_rule``); a rate
term of 0.1 or less, or strict non-displacement (2 per GPU, the single-GPU jobs' slice rounded
up), kept that run on time but ended gang-heavy seeds 3 and 6 at 1.074-1.084x. Reserving the
GPUs of single-GPU jobs *near* their limit too (``timeline.NEAR_LAXITY``) keeps it on time,
and Sia's streams and the gang-heavy seeds above within 0.1% of mean JCT (on lab-5-multi with
40 jobs, below, it costs 5.9% of mean JCT; on aws-5-multi with 40 it saves 3.2%). What keeps
it off: mean JCT on Gavel's generated multi-GPU mixes, seed 1, +1.7% / +3.8% / +2.8% / +7.1%
(aws-5-multi 20 and 40 jobs, lab-5-multi 20 and 40); on lab-5-multi with 40 jobs the
single-GPU jobs +8% and the 4-GPU gangs +10%, some 4-GPU gangs seated across two nodes (at the
cross-node rate) rather than on a whole node with a GPU the slice gives, or the reservation
keeps for, a single-GPU job. PREFER 1, DISPLACE 1 or RATE 0.25 narrow that to -0.6% to +4.9%,
but the first two gave back much of Sia's gain before (1.55x, 1.48x; RATE 0.25 not run there);
RATE 1 and DISPLACE 0.1 widen it.

Guarantees: pure; no row or type over its GPUs; no gang over one seat; every seat W GPUs
of one of the gang's options; None (the caller rounds one at a time) when the MIP has more
than MAX_COLUMNS columns or HiGHS does not prove it optimal within its node limit
(``lp/highs.MIP_MAX_NODES``). The MIP is small: a column per (gang, row) for node seats,
per (gang, spread option, row) for spread seats, and rows of one type and size beyond the
first sum W are left out (``_rows_to_consider``). Where every due gang fits, it is solved
once (the second stage with all of them running, the first stage's optimum then), else twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix, vstack

from services.scheduler.policies.hadar.profile import Option
from services.scheduler.policies.lp.highs import MIP_ABS_GAP, LpResult
from services.scheduler.policies.lp.highs import solve as solve_lp

TIE = 1e-3          # Smith's order among gangs of equal due
PREFER = 0.04       # a seat on the types the LP's slice gives the gang
RATE = 0.5          # a faster option
MOVE_SHARE = 0.25   # of a restart's share of the round: the value of keeping a gang's seat
KEEP_BONUS = 1e-3   # per GPU: keep a seat where a restart costs nothing known
DISPLACE = 0.3      # per GPU seated that the LP's slice gives a single-GPU job
FAST_GPU = 1e-2     # per GPU of a spread seat, times its speed: the slowest eligible GPUs first
ROW_TIE = 1e-4      # per GPU, times row index / rows: one answer among equal seats
MAX_COLUMNS = 4000


@dataclass(frozen=True, kw_only=True)
class SeatAsk:
    """One due gang: ``due`` > 0 (``gangs.gang_dues``), ``rank`` in [0, 1) (Smith's order),
    ``options`` (the profile's, by index), ``now`` (GPUs per type the LP's slice gives it),
    ``held`` (rows, GPUs on each: where it ran last round) and ``restart_share`` (the part
    of a round a restart costs it, 0 if unknown)."""

    job_id: str
    width: int
    due: float
    rank: float
    options: tuple[Option, ...]
    now: np.ndarray
    held: tuple[np.ndarray, np.ndarray] | None = None
    restart_share: float = 0.0
    per_worker: np.ndarray | None = None     # (R,) steps/s per worker by type: a spread seat's slow GPUs first


@dataclass(frozen=True, kw_only=True)
class Seat:
    """Where a gang runs this round: option ``option`` (index into its profile's options) on
    ``counts[i]`` GPUs of row ``rows[i]`` (rows ascending, counts summing to W)."""

    job_id: str
    option: int
    rows: np.ndarray
    counts: np.ndarray

    @property
    def spans(self) -> bool:
        return self.rows.size > 1


@dataclass
class _Columns:
    """The MIP's columns as they are added: owner gang, option, row (-1: none), kind."""

    gang: list[int]
    option: list[int]
    row: list[int]
    kind: list[str]          # "node" (z), "spread" (y), "count" (n), "keep", "displaced"
    upper: list[float]
    value: list[float]       # the second stage's objective
    first: list[float]       # the first stage's: which gangs run

    def add(self, gang: int, option: int, row: int, kind: str, upper: float, value: float, first: float = 0.0) -> int:
        self.first.append(first)
        self.gang.append(gang)
        self.option.append(option)
        self.row.append(row)
        self.kind.append(kind)
        self.upper.append(upper)
        self.value.append(value)
        return len(self.gang) - 1


def seat_gangs(asks: Sequence[SeatAsk], *, row_type: np.ndarray, row_cap: np.ndarray, reserved: np.ndarray,
               singles_now: np.ndarray, budget: float) -> dict[str, Seat] | None:
    """The seats of the gangs that run (module docstring); ``reserved`` and ``singles_now``
    are GPUs per type, ``budget`` GPUs. None: not solved (the caller rounds another way)."""
    n_types = reserved.size
    count = np.bincount(row_type, weights=row_cap, minlength=n_types)
    cols = _Columns([], [], [], [], [], [], [])
    rows_a: list[int] = []
    cols_a: list[int] = []
    vals_a: list[float] = []
    rhs: list[float] = []

    def constraint(entries: Sequence[tuple[int, float]], bound: float) -> None:
        row = len(rhs)
        for col, val in entries:
            rows_a.append(row)
            cols_a.append(col)
            vals_a.append(val)
        rhs.append(bound)

    usage: list[list[tuple[int, float]]] = [[] for _ in range(row_cap.size)]   # (column, GPUs per unit) per row
    seen = _rows_to_consider(asks, row_type, row_cap)
    budget_terms: list[tuple[int, float]] = []
    every_gang: list[tuple[float, int]] = []      # (first-stage value, W) of each gang with a seat
    for g, ask in enumerate(asks):
        width = ask.width
        best = max((o.rate for o in ask.options), default=0.0)
        held = _held_map(ask)
        speed = (ask.per_worker / max(float(ask.per_worker.max()), 1e-300) if ask.per_worker is not None
                 else np.zeros(n_types))
        runs = width * ask.due * (1.0 + TIE * (1.0 - ask.rank))       # the first stage's value
        keep_worth = width * (MOVE_SHARE * ask.due * min(1.0, ask.restart_share) + KEEP_BONUS)
        seats: list[int] = []
        for o, option in enumerate(ask.options):
            if option.rate <= 0:
                continue
            types = np.zeros(n_types, dtype=bool)
            if option.one_node:
                types[option.gpu_type] = True
            else:
                types |= option.eligible
            fit = min(1.0, float(ask.now[types].sum()) / width)
            worth = width * ask.due * (PREFER * fit + RATE * option.rate / best)
            if option.one_node:
                for h in np.flatnonzero(seen & (row_type == option.gpu_type) & (row_cap >= width)).tolist():
                    z = cols.add(g, o, h, "node", 1.0, worth - ROW_TIE * width * h / row_cap.size, runs)
                    seats.append(z)
                    usage[h].append((z, float(width)))
                    if held == {h: width}:
                        k = cols.add(g, o, h, "keep", 1.0, keep_worth)
                        constraint([(k, 1.0), (z, -1.0)], 0.0)
                continue
            eligible_rows = np.flatnonzero(seen & option.eligible[row_type]).tolist()
            if int(row_cap[eligible_rows].sum()) < width:
                continue
            y = cols.add(g, o, -1, "spread", 1.0, worth, runs)
            seats.append(y)
            counts = []
            for h in eligible_rows:
                n = cols.add(g, o, h, "count", float(min(width, int(row_cap[h]))),
                             -FAST_GPU * float(speed[row_type[h]]) - ROW_TIE * h / row_cap.size)
                counts.append((n, 1.0))
                usage[h].append((n, 1.0))
            constraint(counts + [(y, -float(width))], 0.0)       # sum_h n_h = W y (with the next)
            constraint([(n, -1.0) for n, _ in counts] + [(y, float(width))], 0.0)
            if held and set(held) <= set(eligible_rows):
                k = cols.add(g, o, -1, "keep", 1.0, keep_worth)
                for n, _ in counts:
                    h = cols.row[n]
                    if h in held:
                        constraint([(k, float(held[h])), (n, -1.0)], 0.0)     # n_h >= held_h kept
                constraint([(k, 1.0), (y, -1.0)], 0.0)
        if seats:
            constraint([(s, 1.0) for s in seats], 1.0)
            budget_terms += [(s, float(width)) for s in seats]
            every_gang.append((runs, width))
    if not budget_terms:
        return {}
    for h, terms in enumerate(usage):
        if terms:
            constraint(terms, float(row_cap[h]))
    left_by_singles = count - singles_now
    for r in range(n_types):
        terms = [term for h in np.flatnonzero(row_type == r).tolist() for term in usage[h]]
        if not terms:
            continue
        constraint(terms, float(count[r] - reserved[r]))
        d = cols.add(-1, -1, -1, "displaced", float(count[r]), -DISPLACE)
        constraint(terms + [(d, -1.0)], float(max(left_by_singles[r], 0.0)))
    gpus_allowed = budget + max(a.width for a in asks) / 2.0
    constraint(budget_terms, gpus_allowed)
    n_cols = len(cols.kind)
    if n_cols > MAX_COLUMNS:
        return None
    a_ub = coo_matrix((vals_a, (rows_a, cols_a)), shape=(len(rhs), n_cols)).tocsr()
    integral = np.array([kind != "displaced" for kind in cols.kind])
    bounds = np.column_stack([np.zeros(n_cols), cols.upper])
    first = np.array(cols.first)
    held_first = vstack([a_ub, coo_matrix(-first[None, :])]).tocsr()

    def where(floor: float) -> LpResult:
        """The second stage: where they run, the first stage's value held at ``floor``."""
        return solve_lp(-np.array(cols.value), held_first, np.array([*rhs, -floor]), bounds, integral=integral)

    # Every gang with a seat running is the first stage's optimum whenever it is feasible
    # (each due is positive), so try that first: one MIP a round, not two, wherever the due
    # gangs all fit (most rounds of a cluster not full, e.g. the Philly replay). Each W due
    # is at least 2 SHARE_EPS, far above the gap, so the answer is the two stages' own.
    if sum(w for _, w in every_gang) <= gpus_allowed:
        res = where(sum(v for v, _ in every_gang) - 2 * MIP_ABS_GAP)
        if res.ok:
            return _read(asks, cols, np.round(res.x))
    res = solve_lp(-first, a_ub, np.array(rhs), bounds, integral=integral)
    if not res.ok:
        return None
    res = where(float(first @ np.round(res.x)) - 2 * MIP_ABS_GAP)   # to within the solver's gap
    if not res.ok:
        return None
    return _read(asks, cols, np.round(res.x))


def _rows_to_consider(asks: Sequence[SeatAsk], row_type: np.ndarray, row_cap: np.ndarray) -> np.ndarray:
    """Rows the MIP needs (bool per row): rows of one type and size are interchangeable
    but for where a gang ran and the row tie, and the seats use at most sum W of them, so
    of each such class the first sum W by index and every row a gang held. Exact, and on a
    cluster of hundreds of like nodes (philly-2000: 250 rows) it keeps the MIP small."""
    limit = sum(a.width for a in asks)
    seen = np.zeros(row_cap.size, dtype=bool)
    for a in asks:
        if a.held is not None:
            seen[a.held[0]] = True
    for key in {(int(t), int(c)) for t, c in zip(row_type.tolist(), row_cap.tolist())}:
        seen[np.flatnonzero((row_type == key[0]) & (row_cap == key[1]))[:limit]] = True
    return seen


def _held_map(ask: SeatAsk) -> dict[int, int]:
    if ask.held is None:
        return {}
    rows, counts = ask.held
    if int(counts.sum()) != ask.width:
        return {}
    return {int(h): int(c) for h, c in zip(rows.tolist(), counts.tolist()) if c > 0}


def _read(asks: Sequence[SeatAsk], cols: _Columns, x: np.ndarray) -> dict[str, Seat]:
    """The seats in the MIP's answer ``x`` (rounded)."""
    spread: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i in np.flatnonzero(x >= 0.5).tolist():
        if cols.kind[i] == "count":
            spread.setdefault((cols.gang[i], cols.option[i]), []).append((cols.row[i], int(x[i])))
    out: dict[str, Seat] = {}
    for i in np.flatnonzero(x >= 0.5).tolist():
        g, o, kind = cols.gang[i], cols.option[i], cols.kind[i]
        if kind == "node":
            got = [(cols.row[i], asks[g].width)]
        elif kind == "spread":
            got = sorted(spread[(g, o)])
        else:
            continue
        out[asks[g].job_id] = Seat(job_id=asks[g].job_id, option=o, rows=np.array([h for h, _ in got], dtype=np.int64),
                                   counts=np.array([n for _, n in got], dtype=np.int64))
    return out
