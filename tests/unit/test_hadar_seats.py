"""The seat MIP (hadar/seats): the due gangs seated together, against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.policies import make_policy
from services.scheduler.policies.hadar import seats as S
from services.scheduler.policies.hadar.profile import Option
from services.scheduler.policies.hadar.seats import Seat, SeatAsk, seat_gangs
from tests.unit.test_hadar import advance, check_plan, clusters, job, job_lists, request


def node(r: int, n_types: int, rate: float) -> Option:
    return Option(label=f"{r}@node", one_node=True, gpu_type=r, eligible=np.arange(n_types) == r, rate=rate)


def spread(types: list[int], n_types: int, rate: float) -> Option:
    return Option(label=f"{types}@spread", one_node=False, gpu_type=min(types),
                  eligible=np.isin(np.arange(n_types), types), rate=rate)


def ask(job_id: str, width: int, due: float, options: list[Option], n_types: int, *, rank: float = 0.0,
        now: list[float] | None = None, held: tuple[list[int], list[int]] | None = None,
        restart_share: float = 0.0, per_worker: list[float] | None = None) -> SeatAsk:
    return SeatAsk(job_id=job_id, width=width, due=due, rank=rank, options=tuple(options),
                   per_worker=np.array(per_worker) if per_worker is not None else None,
                   now=np.array(now if now is not None else [0.0] * n_types),
                   held=(np.array(held[0]), np.array(held[1])) if held is not None else None,
                   restart_share=restart_share)


def gpus_per_row(seats: dict[str, Seat], n_rows: int) -> np.ndarray:
    used = np.zeros(n_rows, dtype=int)
    for s in seats.values():
        np.add.at(used, s.rows, s.counts)
    return used


def test_two_half_nodes_and_a_whole_node_all_fit_when_packed():
    # Two 8-GPU nodes of one type; gangs of 4, 4 and 8. One at a time by rows, the two
    # 4-GPU gangs can land on different nodes and leave the 8-GPU gang nothing.
    row_type, row_cap = np.array([0, 0]), np.array([8, 8])
    asks = [ask("a", 4, 1.0, [node(0, 1, 1.0)], 1), ask("b", 4, 1.0, [node(0, 1, 1.0)], 1),
            ask("c", 8, 1.0, [node(0, 1, 1.0)], 1)]
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.zeros(1), singles_now=np.zeros(1),
                     budget=16.0)
    assert got is not None and set(got) == {"a", "b", "c"}
    assert got["a"].rows.tolist() == got["b"].rows.tolist() != got["c"].rows.tolist()


def test_a_gang_never_takes_the_gpus_reserved_for_tight_single_gpu_jobs():
    row_type, row_cap = np.array([0, 1]), np.array([2, 2])
    asks = [ask("g", 2, 1.0, [node(1, 2, 2.0), spread([0, 1], 2, 1.0)], 2)]
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.array([2.0, 1.0]),
                     singles_now=np.array([1.0, 1.0]), budget=2.0)
    assert got == {}
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.array([1.0, 1.0]),
                     singles_now=np.array([1.0, 1.0]), budget=2.0)
    assert got is not None and got["g"].rows.tolist() == [0, 1] and got["g"].counts.tolist() == [1, 1]


def test_of_two_seats_the_one_that_leaves_the_single_gpu_jobs_their_gpus():
    # The fast node's GPUs go to single-GPU jobs in the LP's slice; the slow node is idle.
    row_type, row_cap = np.array([0, 1]), np.array([4, 4])
    asks = [ask("g", 4, 1.0, [node(0, 2, 1.0), node(1, 2, 1.5)], 2)]
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.zeros(2),
                     singles_now=np.array([0.0, 4.0]), budget=4.0)
    assert got is not None and got["g"].rows.tolist() == [0]


def test_a_gang_due_its_turn_still_runs_where_it_must_displace_a_single_gpu_job():
    row_type, row_cap = np.array([0]), np.array([4])
    asks = [ask("g", 4, 0.5, [node(0, 1, 1.0)], 1)]
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.zeros(1),
                     singles_now=np.array([4.0]), budget=2.0)
    assert got is not None and set(got) == {"g"}


def test_a_spread_seat_takes_the_slowest_gpus_its_option_may_use():
    row_type, row_cap = np.array([0, 1]), np.array([4, 4])
    asks = [ask("g", 4, 1.0, [spread([0, 1], 2, 1.0)], 2, per_worker=[3.0, 1.0])]
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.zeros(2), singles_now=np.zeros(2),
                     budget=4.0)
    assert got is not None and got["g"].rows.tolist() == [1] and got["g"].counts.tolist() == [4]


def test_a_gang_keeps_its_seat_of_last_round_among_equal_ones():
    row_type, row_cap = np.array([0, 0, 0]), np.array([2, 2, 2])
    asks = [ask("g", 4, 1.0, [spread([0], 1, 1.0)], 1, held=([1, 2], [2, 2]))]
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.zeros(1), singles_now=np.zeros(1),
                     budget=4.0)
    assert got is not None and got["g"].rows.tolist() == [1, 2] and got["g"].counts.tolist() == [2, 2]


def test_the_budget_runs_the_most_due_gang_of_two_that_do_not_fit_it_together():
    row_type, row_cap = np.array([0, 0]), np.array([4, 4])
    asks = [ask("low", 4, 0.4, [node(0, 1, 1.0)], 1), ask("high", 4, 0.6, [node(0, 1, 1.0)], 1)]
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=np.zeros(1), singles_now=np.zeros(1),
                     budget=4.0)
    assert got is not None and set(got) == {"high"}


# ---------------------------------------------------------------- against brute force

def candidate_seats(a: SeatAsk, row_type: np.ndarray, row_cap: np.ndarray) -> list[tuple[int, dict[int, int]]]:
    """Every seat of gang ``a``: (option, {row: GPUs})."""
    out = []
    for o, option in enumerate(a.options):
        if option.one_node:
            out += [(o, {h: a.width}) for h in range(row_cap.size)
                    if row_type[h] == option.gpu_type and row_cap[h] >= a.width]
            continue
        rows = [h for h in range(row_cap.size) if option.eligible[row_type[h]]]
        for counts in itertools.product(*[range(min(a.width, int(row_cap[h])) + 1) for h in rows]):
            if sum(counts) == a.width:
                out.append((o, {h: n for h, n in zip(rows, counts) if n}))
    return out


def value_of(asks: list[SeatAsk], chosen: dict[int, tuple[int, dict[int, int]]], row_type: np.ndarray,
             row_cap: np.ndarray, reserved: np.ndarray, singles_now: np.ndarray,
             budget: float) -> tuple[float, float] | None:
    """The module docstring's two objectives for ``chosen`` (gang -> seat): which gangs run,
    then where; None if infeasible."""
    used = np.zeros(row_cap.size)
    for _, rows in chosen.values():
        for h, n in rows.items():
            used[h] += n
    by_type = np.bincount(row_type, weights=used, minlength=reserved.size)
    count = np.bincount(row_type, weights=row_cap, minlength=reserved.size)
    if (used > row_cap).any() or (by_type > count - reserved + 1e-9).any():
        return None
    if sum(asks[g].width for g in chosen) > budget + max(a.width for a in asks) / 2.0 + 1e-9:
        return None
    runs = 0.0
    total = -S.DISPLACE * float(np.maximum(by_type - (count - singles_now), 0.0).sum())
    for g, (o, rows) in chosen.items():
        a, option = asks[g], asks[g].options[o]
        types = (np.arange(reserved.size) == option.gpu_type) if option.one_node else option.eligible
        fit = min(1.0, float(a.now[types].sum()) / a.width)
        best = max(x.rate for x in a.options)
        runs += a.width * a.due * (1 + S.TIE * (1 - a.rank))
        total += a.width * a.due * (S.PREFER * fit + S.RATE * option.rate / best)
        total -= S.ROW_TIE * sum(h * n for h, n in rows.items()) / row_cap.size
        if not option.one_node and a.per_worker is not None:
            speed = a.per_worker / a.per_worker.max()
            total -= S.FAST_GPU * sum(speed[row_type[h]] * n for h, n in rows.items())
        held = dict(zip(a.held[0].tolist(), a.held[1].tolist())) if a.held is not None else None
        if held == rows:
            total += a.width * (S.MOVE_SHARE * a.due * min(1.0, a.restart_share) + S.KEEP_BONUS)
    return runs, total


@st.composite
def instances(draw: st.DrawFn) -> tuple:
    n_types = draw(st.integers(1, 2))
    n_rows = draw(st.integers(1, 3))
    row_type = np.array(draw(st.lists(st.integers(0, n_types - 1), min_size=n_rows, max_size=n_rows)))
    row_cap = np.array(draw(st.lists(st.sampled_from([1, 2, 4]), min_size=n_rows, max_size=n_rows)))
    asks = []
    for g in range(draw(st.integers(1, 3))):
        width = draw(st.sampled_from([2, 3, 4]))
        options = [node(r, n_types, draw(st.floats(0.5, 2.0))) for r in range(n_types) if draw(st.booleans())]
        if draw(st.booleans()) or not options:
            types = sorted(set(draw(st.lists(st.integers(0, n_types - 1), min_size=1, max_size=n_types))))
            options.append(spread(types, n_types, draw(st.floats(0.2, 1.0))))
        held = None
        if draw(st.booleans()):
            rows = [h for h in range(n_rows) if draw(st.booleans())]
            if rows:
                counts = [draw(st.integers(1, 4)) for _ in rows]
                held = (rows, counts)
        asks.append(ask(f"j{g}", width, draw(st.floats(0.1, 1.5)), options, n_types, rank=g / 3,
                        now=draw(st.lists(st.sampled_from([0.0, 1.0, 2.5]), min_size=n_types, max_size=n_types)),
                        held=held, restart_share=draw(st.sampled_from([0.0, 0.7])),
                        per_worker=draw(st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=n_types,
                                                 max_size=n_types))))
    count = np.bincount(row_type, weights=row_cap, minlength=n_types)
    reserved = np.minimum(count, draw(st.lists(st.integers(0, 1), min_size=n_types, max_size=n_types)))
    singles_now = np.array(draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=n_types, max_size=n_types)))
    budget = draw(st.sampled_from([2.0, 4.0, 8.0, 16.0]))
    return asks, row_type, row_cap, reserved, singles_now, budget


@settings(max_examples=150, deadline=None)
@given(instances())
def test_the_mip_finds_the_best_seats_brute_force_finds(instance: tuple):
    asks, row_type, row_cap, reserved, singles_now, budget = instance
    got = seat_gangs(asks, row_type=row_type, row_cap=row_cap, reserved=reserved, singles_now=singles_now,
                     budget=budget)
    assert got is not None
    options = [[None, *candidate_seats(a, row_type, row_cap)] for a in asks]
    values = [v for v in (value_of(asks, {g: s for g, s in enumerate(pick) if s is not None}, row_type, row_cap,
                                   reserved, singles_now, budget)
                          for pick in itertools.product(*options)) if v is not None]
    most = max(runs for runs, _ in values)
    best = max(where for runs, where in values if runs >= most - 1e-6)
    index = {a.job_id: g for g, a in enumerate(asks)}
    mine = {index[job_id]: (s.option, dict(zip(s.rows.tolist(), s.counts.tolist()))) for job_id, s in got.items()}
    for g, (o, rows) in mine.items():
        assert sum(rows.values()) == asks[g].width and (o, rows) in candidate_seats(asks[g], row_type, row_cap)
    mine_value = value_of(asks, mine, row_type, row_cap, reserved, singles_now, budget)
    assert mine_value is not None and mine_value[0] == pytest.approx(most, abs=1e-6)
    assert mine_value[1] == pytest.approx(best, abs=1e-6)


# ---------------------------------------------------------------- in Hadar's rounds

@settings(max_examples=40, deadline=None)
@given(clusters(), job_lists(max_jobs=6))
def test_every_gang_hadar_seats_runs_on_exactly_its_seat(cluster, jobs):
    policy = make_policy("hadar", seat_gangs=True)
    req = request(cluster, jobs)
    for _ in range(3):
        plan = policy.plan(req)
        check_plan(req, plan)
        for job_id, info in plan.explain.items():
            if "critical_seat" in info:
                placed = sorted((p.node_id, cluster.by_id[p.node_id].gpus[i]) for p in plan.placements
                                if p.job_id == job_id for i in p.gpus)
                seat = sorted((node_id, gpu_type) for node_id, gpu_type, n in info["critical_seat"]
                              for _ in range(n))
                assert placed == seat
        req = advance(req, plan)
        if not req.jobs:
            break


def test_hadar_seats_the_gangs_of_a_round_when_they_are_due():
    # Two 8-GPU nodes and three long gangs (4, 4 and 8 GPUs) that together fill them: all
    # three are critical from the first round, and all three run on their seats.
    cluster = Cluster(name="t", nodes=tuple(Node(node_id=f"n{i}", gpus=("v100",) * 8) for i in range(2)))
    jobs = [job(f"g{w}{i}", "ResNet-50 (batch size 32)", workers=w, steps=5_000_000)
            for i, w in enumerate((4, 4, 8))]
    req = request(cluster, jobs)
    plan = make_policy("hadar", seat_gangs=True).plan(req)
    check_plan(req, plan)
    seated = {job_id for job_id, info in plan.explain.items() if "critical_seat" in info}
    assert seated == {j.job_id for j in jobs} and not plan.waiting
