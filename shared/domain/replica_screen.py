"""Which replicas of a round may be averaged: the screen the tracker applies before it averages.

Pure: numbers in (what each replica did to the round's starting model), verdicts out. The
tracker measures the numbers (:mod:`services.tracker.averaging.screening`) and leaves the
rejected replicas out of the average, each with its reason (in the model's ``rejected``,
the announcement, ``hadar logs``).

Why: a copy's replica is trusted for its weights and for the steps it claims, and steps
decide its weight. A node that plants weights in a copy's checkpoint key and claims the
copy's whole budget took 83% of a round's weight and ruined the job (issue 26). The screen
bounds what one replica can do to the model, whoever wrote it.

The rule. For replica ``i`` let ``s_i`` be its steps this round (as weighed: clamped to its
budget) and ``D_i = ||w_i - w_0||``, the L2 norm over every floating tensor the starting
model ``w_0`` also holds (same name, dtype and shape; optimizer state ``optim.*`` is not a
weight and is not compared), accumulated in float64. A replica is rejected, with its
reason, when

1. **not finite**: a NaN or inf in any of those tensors (then ``D_i`` is not computed);
2. **too far**: ``D_i > TOO_FAR x ||w_0||`` (``TOO_FAR`` = 10), when ``||w_0|| > 0``, or
   ``D_i`` overflows float64 -- no honest round moves a model by ten times its own size;
   this is the only bound a round of one copy gets;
3. **out of line**, among the *peers* (the replicas not rejected by 1 or 2 that did at
   least one step), when there are at least two: with ``m`` the lower median of the peers'
   steps, each replica's per-step update is ``u_i = D_i / max(s_i, m)``, and a replica is
   rejected when ``u_i > OUT_OF_LINE x r`` (``OUT_OF_LINE`` = 4), ``r`` the lower median of
   the peers' ``u`` (the lower median: the smaller middle value; of two, the smaller).

Why per step, not per sqrt(step). Over ``s`` SGD steps an update is a drift that grows like
``s`` plus noise that grows like ``sqrt(s)`` or, once the model sits in its basin, hardly at
all. Dividing by ``s`` allows the most growth an honest copy shows (linear), so the copies
that did the most steps -- those that carry the round -- are never the odd ones out;
dividing by ``sqrt(s)`` would reject them in the drift regime (by ``sqrt`` of the steps
ratio). The price is paid by copies with *few* steps, whose per-step noise looks large:
hence ``max(s_i, m)`` -- a copy that did fewer steps than the median copy is judged as if it
had done the median's (it has no business moving the model further than the median copy),
so only copies at or above the median are compared per step. An honest replica is then
rejected only when the steps of the replicas at or above the median differ by more than
``OUT_OF_LINE`` (saturated noise) or ``OUT_OF_LINE**2`` (growing noise), or, of two, when
the one with fewer steps did under 1/16 (1/4 saturated) of the other's -- a copy that
carried little weight. A forger gains at most linearly by claiming steps, which are clamped
to the copy's budget; claiming fewer than ``m`` gains nothing.

Why the lower median. With three or more peers it is the median: one replica, whatever it
holds, cannot move it or ``m``. With two it is the smaller: a replica far out of line with the
other is rejected, and only the one that moved the model further per step (the direction
that ruins a model) can be; the peer at ``r`` is never out of line, so the rule never
rejects every peer. What remains possible: a forged replica within ``OUT_OF_LINE`` of an
honest update (it moves the model at most a few honest rounds' worth, which later rounds
train back), or, of two, a forged replica that did *not* move the model, which leaves the
round adding nothing (the honest sibling is then out of line with it).

Replicas claiming 0 steps are judged (``u_i = D_i / m``: an honest one is the starting model
itself) but are no peers. Without a starting model (a round that starts from seed) only
rule 1 applies, in the average itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["ReplicaUpdate", "Screened", "Rule", "RULES", "screen", "step_floor", "per_step", "OUT_OF_LINE",
           "TOO_FAR"]

OUT_OF_LINE = 4.0    # x the round's lower-median per-step update
TOO_FAR = 10.0       # x the starting model's norm

Rule = Literal["non_finite", "too_far", "out_of_line"]
RULES: tuple[Rule, ...] = ("non_finite", "too_far", "out_of_line")


@dataclass(frozen=True, kw_only=True)
class ReplicaUpdate:
    """What one replica did to the starting model: ``update_norm`` is ``D_i`` (NaN when
    ``non_finite`` names the first tensor found holding NaN or inf)."""

    copy: int
    steps: int
    update_norm: float
    non_finite: str | None = None


@dataclass(frozen=True, kw_only=True)
class Screened:
    """A replica the screen rejects: which ``rule``, and the ``reason`` (one line)."""

    copy: int
    rule: Rule
    reason: str


def step_floor(peers: Sequence[ReplicaUpdate]) -> int:
    """``m``: the lower median of the peers' steps (1 with no peer)."""
    steps = sorted(max(u.steps, 1) for u in peers)
    return steps[(len(steps) - 1) // 2] if steps else 1


def per_step(update: ReplicaUpdate, floor: int = 1) -> float:
    """``u_i``: the update's norm per step, counting at least ``floor`` steps (and at least 1)."""
    return update.update_norm / max(update.steps, floor, 1)


def screen(updates: Sequence[ReplicaUpdate], *, start_norm: float, out_of_line: float = OUT_OF_LINE,
           too_far: float = TOO_FAR) -> tuple[Screened, ...]:
    """The replicas of ``updates`` the rule rejects (see the module docstring), by copy id.

    ``start_norm``: ``||w_0||`` over the compared tensors. Raises ``ValueError`` for a
    caller's mistake (a factor below 1, a negative or NaN norm of a finite replica).
    """
    if out_of_line < 1.0 or too_far < 1.0:
        raise ValueError("out_of_line and too_far must be >= 1")
    if not (math.isfinite(start_norm) and start_norm >= 0.0):
        raise ValueError(f"start_norm must be finite and >= 0, got {start_norm!r}")
    rejected: list[Screened] = []
    kept: list[ReplicaUpdate] = []
    for u in updates:
        if u.non_finite is not None:
            rejected.append(Screened(copy=u.copy, rule="non_finite",
                                     reason=f"non-finite values (NaN or inf) in tensor {u.non_finite[:120]!r}"))
            continue
        if math.isnan(u.update_norm) or u.update_norm < 0.0:
            raise ValueError(f"copy {u.copy}: update_norm must be >= 0, got {u.update_norm!r}")
        if math.isinf(u.update_norm) or (start_norm > 0.0 and u.update_norm > too_far * start_norm):
            rejected.append(Screened(copy=u.copy, rule="too_far", reason=(
                f"moved the model by {u.update_norm:.4g}, more than {too_far:g}x the starting model's "
                f"norm {start_norm:.4g}")))
            continue
        kept.append(u)
    peers = [u for u in kept if u.steps >= 1]
    if len(peers) >= 2:
        floor = step_floor(peers)
        reference = sorted(per_step(u, floor) for u in peers)[(len(peers) - 1) // 2]    # the lower median
        for u in kept:
            if per_step(u, floor) > out_of_line * reference:
                rejected.append(Screened(copy=u.copy, rule="out_of_line", reason=(
                    f"update {u.update_norm:.4g} over {u.steps} steps ({per_step(u, floor):.4g}/step) is more "
                    f"than {out_of_line:g}x the round's median {reference:.4g}/step")))
    return tuple(sorted(rejected, key=lambda s: s.copy))
