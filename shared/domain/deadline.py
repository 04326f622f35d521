"""One deadline rule for a round, shared by the scheduler and the tracker.

A round's copies are due at the round's deadline (``RoundStarted.ends_at``, the
``deadline`` of its Assignments). Copies that have not reported by then are waited for
``late_copy_s`` more -- a worker may have started late on a loaded machine, or its node
may be back from a short outage. At :func:`copies_given_up_at` the tracker decides the
round with the copies that finished (a lost sibling never costs the others' work), and
the scheduler keeps waiting for that decision (a model, or RoundAbandoned) for
``consolidation_wait_s`` more, the time consolidation may take, before
:func:`next_round_gives_up_at` plans the next round without it.

Guarantees: the scheduler never plans past a round the tracker may still decide -- with
the same ``late_copy_s`` on both sides, :func:`next_round_gives_up_at` is never earlier
than :func:`copies_given_up_at` -- so a late round's work is never retrained from an older
model because one side ran out of patience before the other. Pure functions of their
arguments; no clock.
"""

from __future__ import annotations

import math

__all__ = ["LATE_COPY_S", "CONSOLIDATION_WAIT_S", "copies_given_up_at", "next_round_gives_up_at",
           "check_wait"]

LATE_COPY_S = 120.0          # default wait for a missing copy after the round's deadline
CONSOLIDATION_WAIT_S = 60.0  # default wait for the model once the copies are given up on


def check_wait(name: str, value: float) -> float:
    """``value`` if it is a finite number >= 0; ValueError naming ``name`` otherwise."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def copies_given_up_at(deadline: float, *, late_copy_s: float) -> float:
    """When a round with copies still missing is decided without them: its ``deadline``
    plus ``late_copy_s``. The tracker consolidates the finished copies then."""
    return deadline + check_wait("late_copy_s", late_copy_s)


def next_round_gives_up_at(deadline: float, *, late_copy_s: float, consolidation_wait_s: float) -> float:
    """When the scheduler stops waiting for a round's decision and plans the next round
    anyway: :func:`copies_given_up_at` plus ``consolidation_wait_s``."""
    return copies_given_up_at(deadline, late_copy_s=late_copy_s) + check_wait(
        "consolidation_wait_s", consolidation_wait_s)
