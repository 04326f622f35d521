"""Hadar's ledger: GPUs committed per row (node h, GPU type r) and future round, and prices.

Rows are the (node, type) pairs of the cluster, in cluster order then type order. Slot 0 of
the horizon is the round being planned. ``z[t, row]`` counts committed GPUs (never above
``cap[row]``): that is the feasibility constraint, per row and slot. ``hist[r, t, b]``
counts the rows of type r whose (cap, z) falls in bucket b at slot t; from it the ledger
knows, per (type, slot), whether some row has >= w free GPUs and how many GPUs are free
(w, x up to the largest gang), so ``hadar/dp.round_costs`` reads "the cheapest W GPUs of
some types at slot t" from small tables, never scanning nodes.

Prices are per GPU type and block of slots, nodes being placement detail. Slots are cut
into blocks of ``block`` consecutive slots (PRICE_BLOCK; the last block may be shorter);
the priced resource (r, b) holds ``C_r x |b|`` GPU-rounds (C_r: GPUs of type r in the
cluster), ``Z[r, b]`` of them committed, and every GPU of type r at a slot of block b costs
``k(Z[r, b] / (C_r |b|))`` (``hadar/prices.PriceCurve``). A row priced alone (``C`` GPUs of
one node) gives a price with C + 1 values: two on clusters of one GPU per (node, type)
(aws-5, lab-5, gavel-108), where it said nothing; per type and block it takes
``C_r |b| + 1`` values (lab-5 with 8-slot blocks: 9; gavel-108: 289).

``price[t, row]`` (its type's price at t), ``cum_price`` (prefix sums over slots),
``node_min[r, t, w]`` (price of a GPU of type r at t if some row of type r has >= w free
GPUs, else +inf) and ``marginal[r, t, x]`` (the same if type r has >= x free GPUs at t) are
derived from those tables on demand.

A ``Commitment`` is one job's committed schedule: per absolute round, GPUs per row, and the
steps it is expected to make. The ledger is rebuilt from the surviving commitments at the
start of each round (``Ledger.load``), so its arrays always equal the sum of what the
commitments hold; ``LedgerState`` (policy state) is immutable and carries commitments,
the committed array for inspection, and the running value bounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import PolicyState
from services.scheduler.policies.hadar.prices import PriceCurve
from shared.errors import HadarError
from shared.persistence.codec import snapshot_type

PRICE_BLOCK = 8   # slots per priced block of a GPU type's capacity


class LedgerError(HadarError):
    """A commitment would exceed a row's capacity or release more than was committed."""


@snapshot_type("policy.hadar.RowLayout", formerly="services.scheduler.policies.hadar_ledger.RowLayout")
@dataclass(frozen=True, kw_only=True, eq=False)
class RowLayout:
    node_ids: tuple[str, ...]
    types: tuple[str, ...]          # the cluster's GPU types, sorted
    row_node: np.ndarray            # (HR,) node index
    row_type: np.ndarray            # (HR,) type index
    row_cap: np.ndarray             # (HR,) GPUs of that type on that node
    keys: tuple[tuple[str, str, int], ...]  # (node id, type, capacity) per row

    @classmethod
    def of(cls, cluster: Cluster) -> RowLayout:
        types = cluster.types
        tindex = {t: i for i, t in enumerate(types)}
        nodes, rtypes, caps, keys = [], [], [], []
        for i, node in enumerate(cluster.nodes):
            for t in node.types:
                cap = node.gpus.count(t)
                nodes.append(i)
                rtypes.append(tindex[t])
                caps.append(cap)
                keys.append((node.node_id, t, cap))
        return cls(node_ids=tuple(n.node_id for n in cluster.nodes), types=types,
                   row_node=np.array(nodes, dtype=np.int64), row_type=np.array(rtypes, dtype=np.int64),
                   row_cap=np.array(caps, dtype=np.int64), keys=tuple(keys))

    @property
    def rows(self) -> int:
        return len(self.keys)


@snapshot_type("policy.hadar.Commitment", formerly="services.scheduler.policies.hadar_ledger.Commitment")
@dataclass(frozen=True, kw_only=True, eq=False)
class Commitment:
    job_id: str
    rounds: np.ndarray     # (m,) absolute rounds, ascending
    rows: np.ndarray       # (k,) row indices (of the layout it was committed on)
    counts: np.ndarray     # (m, k) GPUs per round and row; each round sums to W
    steps: np.ndarray      # (m,) steps expected per round
    base_done: float       # the job's steps_done when committed
    finishes: bool         # the schedule completes the job inside the horizon
    signature: tuple[float, ...]
    option: str
    utility: float
    cost: float

    def expected_done(self, before_round: int) -> float:
        """Steps the job should have done by the start of ``before_round``."""
        return self.base_done + float(self.steps[self.rounds < before_round].sum())


@snapshot_type("policy.hadar.LedgerState", formerly="services.scheduler.policies.hadar_ledger.LedgerState")
@dataclass(frozen=True, kw_only=True, eq=False)
class LedgerState(PolicyState):
    """Hadar's policy state, carried in ``Plan.state`` from one round to the next."""

    round: int
    horizon: int
    round_s: float
    layout: RowLayout
    commitments: Mapping[str, Commitment]
    committed: np.ndarray  # (horizon, HR) z after this round's planning, slot 0 = ``round``
    value_lo: float
    value_hi: float
    target_end: int = -1   # E of ``hadar/critical`` (-1: none)
    gang_credit: Mapping[str, float] = field(default_factory=dict)   # ``hadar/gangs.gang_dues``


class Ledger:
    """The working ledger of one planning round (mutable; frozen into ``LedgerState``).

    Besides ``z`` and ``hist`` it keeps ``Z`` (committed GPU-rounds per type and block),
    ``type_price[r, t]``, ``cum_fill`` (prefix sums over slots of each row's committed share,
    to prefer emptier rows among equally priced ones) and, for gang sizes up to
    ``max_workers``, ``node_ok[r, t, w]`` (0 if some row of type r has >= w free GPUs at slot
    t, else +inf) and ``marg_ok[r, t, x]`` (0 if type r has >= x free GPUs at t, else +inf).
    All are updated for the touched rows, types, blocks and (type, slot) pairs on every commit
    and release.
    """

    def __init__(self, *, layout: RowLayout, horizon: int, round_: int, curve: PriceCurve,
                 max_workers: int = 8, block: int = PRICE_BLOCK) -> None:
        self.layout = layout
        self.horizon = horizon
        self.round = round_
        self.curve = curve
        self.cap = layout.row_cap
        self.max_workers = max(1, int(max_workers))
        self.commitments: dict[str, Commitment] = {}
        self.z = np.zeros((horizon, layout.rows), dtype=np.int64)
        max_cap = int(self.cap.max()) if layout.rows else 1
        pairs = sorted((z / c, c, z) for c in range(1, max_cap + 1) for z in range(c + 1))
        self.bucket_id = np.full((max_cap + 1, max_cap + 1), -1, dtype=np.int64)
        for b, (_, c, z) in enumerate(pairs):
            self.bucket_id[c, z] = b
        self.bucket_free = np.array([c - z for _, c, z in pairs], dtype=np.int64)
        ntypes = len(layout.types)
        self.block = max(1, int(block))
        self.block_of = np.arange(horizon) // self.block
        self.block_len = np.bincount(self.block_of, minlength=int(self.block_of[-1]) + 1 if horizon else 0)
        self.type_cap = np.bincount(layout.row_type, weights=self.cap, minlength=ntypes)
        self.Z = np.zeros((ntypes, self.block_len.size), dtype=np.int64)
        self._inv_block_cap = 1.0 / (np.maximum(self.type_cap, 1)[:, None] * self.block_len[None, :])
        self.type_price = np.empty((ntypes, horizon))
        self._cum_type_price = np.zeros((ntypes, horizon + 1))
        self.cum_fill = np.zeros((horizon + 1, layout.rows))   # prefix sums over slots of z / cap
        self.hist = np.empty((ntypes, horizon, len(pairs)), dtype=np.int64)
        self.node_ok = np.empty((ntypes, horizon, self.max_workers + 1))
        self.marg_ok = np.empty((ntypes, horizon, self.max_workers))
        # constants of ``_tables``: row i of a batch is shifted by i * step, past any running value
        pairs_max = ntypes * horizon
        x = np.arange(self.max_workers + 1)
        step = int(self.cap.sum()) + max_cap + self.max_workers + 1
        self._shift = step * np.arange(pairs_max)[:, None]
        self._marg_query = x[None, 1:] + self._shift
        self._node_query = x[None, :] + self._shift
        self._base = len(pairs) * np.arange(pairs_max)[:, None]
        self._found = np.append(np.zeros(len(pairs)), np.inf)
        self._refresh()

    # ------------------------------------------------------------------ prices

    @property
    def price(self) -> np.ndarray:
        """(H, rows): the price of one GPU of each row at each slot (its type's price)."""
        price: np.ndarray = self.type_price[self.layout.row_type].T
        return price

    @property
    def cum_price(self) -> np.ndarray:
        """(H + 1, rows): ``cum_price[t, row]`` = sum of price[:t, row]."""
        cum: np.ndarray = self.cum_type_price()[self.layout.row_type].T
        return cum

    def cum_type_price(self) -> np.ndarray:
        """(R, H + 1): prefix sums of ``type_price`` over slots (kept up to date; do not modify)."""
        return self._cum_type_price

    @property
    def node_min(self) -> np.ndarray:
        """(R, H, W + 1): price of a GPU of type r at t if a row of type r has >= w free, else inf."""
        return self.node_ok + self.type_price[:, :, None]

    @property
    def marginal(self) -> np.ndarray:
        """(R, H, W): price of the x-th free GPU of type r at t (+inf when fewer are free)."""
        return self.marg_ok + self.type_price[:, :, None]

    def _reprice(self) -> None:
        fill = np.minimum(self.Z * self._inv_block_cap, 1.0)
        self.type_price[:] = (self.curve.floor * (self.curve.ceiling / self.curve.floor) ** fill)[:, self.block_of]
        np.cumsum(self.type_price, axis=1, out=self._cum_type_price[:, 1:])

    # ------------------------------------------------------------------ bulk

    def load(self, commitments: Iterable[Commitment]) -> list[str]:
        """Add commitments in order; return the ids of those that no longer fit (dropped)."""
        dropped = []
        cap = self.cap
        for c in commitments:
            slots, rows, counts = self._cells(c)
            np.add.at(self.z, (slots, rows), counts)
            if slots.size and (self.z[slots, rows] > cap[rows]).any():
                np.subtract.at(self.z, (slots, rows), counts)
                dropped.append(c.job_id)
                continue
            self.commitments[c.job_id] = c
        self._refresh()
        return dropped

    def _refresh(self) -> None:
        cap = self.cap[None, :]
        t = np.arange(self.horizon)[:, None]
        self.Z[:] = 0
        np.add.at(self.Z, (np.broadcast_to(self.layout.row_type[None, :], self.z.shape),
                           np.broadcast_to(self.block_of[:, None], self.z.shape)), self.z)
        self._reprice()
        buckets = self.bucket_id[cap, self.z]
        nb = self.hist.shape[2]
        index = (self.layout.row_type[None, :] * self.horizon + t) * nb + buckets
        self.hist[:] = np.bincount(index.ravel(), minlength=self.hist.size).reshape(self.hist.shape)
        np.cumsum(self.z / np.maximum(cap, 1), axis=0, out=self.cum_fill[1:])
        flat = self.hist.reshape(-1, nb)
        node_ok, marg_ok = self._tables(flat)
        self.node_ok[:] = node_ok.reshape(self.node_ok.shape)
        self.marg_ok[:] = marg_ok.reshape(self.marg_ok.shape)

    def _tables(self, hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(node_ok, marg_ok) rows (0 found, +inf not) for histogram rows ``hist`` (P, B).

        Both are "first bucket where a running quantity reaches x" per row, found with one
        ``searchsorted`` over the rows laid end to end, each shifted past the one before.
        """
        p = hist.shape[0]
        if p == 0:
            return np.empty((0, self.max_workers + 1)), np.empty((0, self.max_workers))
        shift = self._shift[:p]
        cum_free = np.cumsum(hist * self.bucket_free, axis=1)
        run_max = np.maximum.accumulate(np.where(hist > 0, self.bucket_free, 0), axis=1)
        marg = np.searchsorted((cum_free + shift).ravel(), self._marg_query[:p].ravel()).reshape(p, -1)
        node = np.searchsorted((run_max + shift).ravel(), self._node_query[:p].ravel()).reshape(p, -1)
        base = self._base[:p]
        return self._found[node - base], self._found[marg - base]

    # ------------------------------------------------------------------ incremental

    def commit(self, c: Commitment) -> None:
        if c.job_id in self.commitments:
            raise LedgerError(f"{c.job_id} is already committed")
        self._apply(c, sign=1)
        self.commitments[c.job_id] = c

    def release(self, job_id: str) -> Commitment | None:
        c = self.commitments.pop(job_id, None)
        if c is not None:
            self._apply(c, sign=-1)
        return c

    def _window(self, c: Commitment) -> tuple[np.ndarray, np.ndarray]:
        """(slots of ``c``'s rounds inside the horizon, their rows of ``c.counts``)."""
        rel = c.rounds - self.round
        keep = (rel >= 0) & (rel < self.horizon)
        return rel[keep], c.counts[keep]

    def _cells(self, c: Commitment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        window, counts = self._window(c)
        tt, kk = np.nonzero(counts)
        return window[tt], c.rows[kk], counts[tt, kk]

    def _apply(self, c: Commitment, *, sign: int) -> None:
        window, counts = self._window(c)
        if not window.size:
            return
        tt, kk = np.nonzero(counts)
        slots, rows, delta = window[tt], c.rows[kk], counts[tt, kk]
        caps = self.cap[rows]
        old = self.z[slots, rows]
        new = old + sign * delta
        if (new > caps).any() if sign > 0 else (new < 0).any():
            raise LedgerError("commitment outside [0, capacity]")
        types = self.layout.row_type[rows]
        h, nb = self.horizon, self.hist.shape[2]
        flat_hist = self.hist.reshape(-1)
        base = (types * h + slots) * nb
        np.subtract.at(flat_hist, base + self.bucket_id[caps, old], 1)
        np.add.at(flat_hist, base + self.bucket_id[caps, new], 1)
        self.z[slots, rows] = new
        np.add.at(self.Z, (types, self.block_of[slots]), sign * delta)
        self._reprice()
        first = int(window[0])
        self.cum_fill[first + 1:, c.rows] = (self.cum_fill[first, c.rows]
                                            + np.cumsum(self.z[first:, c.rows] / self.cap[c.rows], axis=0))
        used_types = np.array(sorted(set(self.layout.row_type[c.rows].tolist())))
        pairs = (used_types[:, None] * h + window[None, :]).ravel()   # every touched (type, slot), maybe more
        node_ok, marg_ok = self._tables(self.hist.reshape(-1, nb)[pairs])
        self.node_ok.reshape(-1, self.max_workers + 1)[pairs] = node_ok
        self.marg_ok.reshape(-1, self.max_workers)[pairs] = marg_ok

    # ------------------------------------------------------------------ queries

    def free(self, slot: int) -> np.ndarray:
        left: np.ndarray = self.cap - self.z[slot]
        return left

    def freeze(self, *, round_s: float, target_end: int = -1,
               gang_credit: Mapping[str, float] | None = None) -> LedgerState:
        return LedgerState(round=self.round, horizon=self.horizon, round_s=round_s, layout=self.layout,
                           commitments=dict(self.commitments), committed=self.z.copy(),
                           value_lo=self.curve.value_lo, value_hi=self.curve.value_hi, target_end=target_end,
                           gang_credit=dict(gang_credit or {}))


def remap(c: Commitment, old: RowLayout, new: RowLayout, from_round: int) -> Commitment | None:
    """``c`` on ``new``'s rows, or None if a row it still needs (round >= from_round) is gone."""
    if old is new or old.keys == new.keys:
        return c
    index = {k: i for i, k in enumerate(new.keys)}
    future = cast(np.ndarray, c.counts[c.rounds >= from_round].any(axis=0))   # axis given: an array
    rows = np.empty_like(c.rows)
    for j, row in enumerate(c.rows):
        target = index.get(old.keys[row])
        if target is None:
            if future[j]:
                return None
            target = -1
        rows[j] = target
    keep = rows >= 0
    return Commitment(job_id=c.job_id, rounds=c.rounds, rows=rows[keep], counts=c.counts[:, keep],
                      steps=c.steps, base_done=c.base_done, finishes=c.finishes, signature=c.signature,
                      option=c.option, utility=c.utility, cost=c.cost)
