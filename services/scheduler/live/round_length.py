"""How long a round must be to make progress: measured round overhead x a safety factor.

A round spends part of its length not training: its copies start (a worker process, or a
warm worker's reload of the consolidated model), and after its deadline the tracker
consolidates their checkpoints before the next round may start. If that overhead
approaches the round length, rounds end before any copy trained -- no progress at all.
So the live scheduler never plans a round shorter than

    round_s = max(configured_round_s, factor x overhead_s)

where ``overhead_s`` is the lower median of the measured overheads of the last ``WINDOW``
(3) rounds that had one: a cost that lasts two rounds of three stretches the next round,
a single outlier does not -- a first start's spawn before warm rounds, or one round whose
consolidation waited out a broker outage (which once stretched the next round to 64 s
with nothing assigned). A round's overhead is its start-up plus its consolidation:

* start-up: per copy, from the round's start to its first training step, estimated from
  the copy's first Progress report of the round as
  ``ts - started_at - steps_round / (samples_per_s / (batch_size x workers))`` (the time
  it had been training, at the rate it reports), at least 0; the round's start-up is the
  slowest copy's;
* consolidation: from the round's deadline until the tracker had decided every job that
  ran in it (model announced or round given up), as the scheduler waited for it.

``factor`` 0 turns stretching off. Everything here is pure: the service feeds in what it
folded and measured, and records the length it used in the RoundStarted, so replay
re-derives the round with the same length without measuring anything.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["RoundCosts", "Stretch", "stretched_round_s", "copy_startup_s", "WINDOW"]

WINDOW = 3        # rounds whose overheads count (their lower median)
KEPT = 16         # rounds remembered


def copy_startup_s(*, ts: float, started_at: float, steps_round: int, samples_per_s: float,
                   batch_size: int, workers: int) -> float:
    """A copy's start-up in its round, from its first Progress report (module formula)."""
    trained_s = steps_round * batch_size * workers / samples_per_s if samples_per_s > 0 else 0.0
    return max(0.0, ts - started_at - trained_s)


@dataclass(frozen=True, kw_only=True)
class Stretch:
    round_s: float            # the length to plan with
    configured_s: float
    overhead_s: float | None  # None: nothing measured yet

    @property
    def stretched(self) -> bool:
        return self.round_s > self.configured_s


def stretched_round_s(configured_s: float, overheads: list[float], factor: float) -> Stretch:
    """``max(configured_s, factor x lower_median(overheads))``; ``overheads`` of recent rounds."""
    overhead = sorted(overheads)[(len(overheads) - 1) // 2] if overheads else None
    if overhead is None or factor <= 0:
        return Stretch(round_s=configured_s, configured_s=configured_s, overhead_s=overhead)
    return Stretch(round_s=max(configured_s, factor * overhead), configured_s=configured_s, overhead_s=overhead)


class RoundCosts:
    """Measured start-up and consolidation per round (the last ``KEPT``), folded in by the service."""

    def __init__(self) -> None:
        self._startup: OrderedDict[int, float] = OrderedDict()
        self._consolidation: dict[int, float] = {}
        self._copies: set[tuple[int, str, int]] = set()

    def startup(self, round_: int, job_id: str, copy: int, seconds: float) -> None:
        """A copy's start-up; only its first report of the round counts."""
        if (round_, job_id, copy) in self._copies:
            return
        self._copies.add((round_, job_id, copy))
        self._startup[round_] = max(self._startup.get(round_, 0.0), seconds)
        self._trim()

    def consolidation(self, round_: int, seconds: float) -> None:
        self._consolidation[round_] = max(0.0, seconds)
        self._startup.setdefault(round_, 0.0)
        self._trim()

    def overheads(self) -> list[float]:
        """Overhead (start-up + consolidation) of the last ``WINDOW`` rounds measured."""
        rounds = sorted(self._startup)[-WINDOW:]
        return [self._startup[r] + self._consolidation.get(r, 0.0) for r in rounds]

    def _trim(self) -> None:
        while len(self._startup) > KEPT:
            old = min(self._startup)
            del self._startup[old]
            self._consolidation.pop(old, None)
            self._copies = {c for c in self._copies if c[0] != old}
