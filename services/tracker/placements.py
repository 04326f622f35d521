"""Which placements of each round the tracker has read: the index a round's completeness rests on.

Per round: how many Assignments its RoundStarted announced and which (job, copy, node) were
read; the latest round known; how many jobs still have each round open. Kept for the last
:data:`ROUND_HISTORY` rounds and for any round still open, so it stays small however
long the tracker runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.persistence.codec import snapshot_type

__all__ = ["PlacementIndex", "ROUND_HISTORY"]

ROUND_HISTORY = 16          # rounds behind the latest whose placements are kept (if none is open)


@snapshot_type("tracker.PlacedRound", formerly="services.tracker.placements._Round")
@dataclass(kw_only=True)
class _Round:
    expected: int | None = None                                     # RoundStarted.assignments
    placed: set[tuple[str, int, str]] = field(default_factory=set)  # (job, copy, node)


@snapshot_type("tracker.PlacementIndex", formerly="services.tracker.placements.PlacementIndex")
class PlacementIndex:
    """See the module docstring. ``latest``: the highest round of any RoundStarted or
    recorded Assignment (-1 before any)."""

    def __init__(self) -> None:
        self._rounds: dict[int, _Round] = {}
        self._open: dict[int, int] = {}
        self.latest = -1

    def __len__(self) -> int:
        return len(self._rounds)

    def started(self, round_: int, assignments: int) -> bool:
        """Record a RoundStarted; True if it changed what the round expects."""
        placements = self._rounds.setdefault(round_, _Round())
        changed = placements.expected != assignments
        placements.expected = assignments
        self.latest = max(self.latest, round_)
        return changed

    def seen(self, round_: int, job_id: str, copy: int, node_id: str) -> bool:
        placements = self._rounds.get(round_)
        return placements is not None and (job_id, copy, node_id) in placements.placed

    def place(self, round_: int, job_id: str, copy: int, node_id: str) -> None:
        self._rounds.setdefault(round_, _Round()).placed.add((job_id, copy, node_id))
        self.latest = max(self.latest, round_)

    def opened(self, round_: int) -> None:
        """A job has ``round_`` open: its placements are kept until it is closed."""
        self._open[round_] = self._open.get(round_, 0) + 1

    def closed(self, round_: int) -> None:
        self._open[round_] -= 1
        if not self._open[round_]:
            del self._open[round_]

    @property
    def cutoff(self) -> int:
        """Rounds below this count as fully placed whatever was read of them."""
        return self.latest - ROUND_HISTORY

    def complete(self, round_: int) -> bool:
        """Whether every Assignment of ``round_`` has been read: none can still arrive."""
        placements = self._rounds.get(round_)
        if placements is None or placements.expected is None:
            return round_ < self.cutoff
        return len(placements.placed) >= placements.expected

    def known(self, round_: int) -> bool:
        """Whether the round may be consolidated as placed: all its Assignments read, or no
        RoundStarted says how many there are."""
        placements = self._rounds.get(round_)
        return placements is None or placements.expected is None or len(placements.placed) >= placements.expected

    def prune(self) -> None:
        """Forget rounds below the cutoff that no job has open."""
        for number in [n for n in self._rounds if n < self.cutoff and n not in self._open]:
            del self._rounds[number]
