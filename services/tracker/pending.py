"""Reports held until the placements they name are read: a bounded, insertion-ordered buffer.

hadar.progress and hadar.placements are read in parallel, so a copy's CopyFinished may be
read before its Assignment. :class:`~services.tracker.state.TrackerState` holds such a
report here and takes it out again when its (job, round) gets an Assignment, when the
round's placements are all known, or when the round is decided. The buffer never holds
more than its limit; the caller decides what to refuse when it is full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shared.wire.events import CopyFinished

__all__ = ["HeldReport", "PendingReports"]


@dataclass(frozen=True, kw_only=True)
class HeldReport:
    event: CopyFinished
    origin: object


class PendingReports:
    """Held reports by (job, round), oldest first; every operation touches only what it returns
    except :meth:`take_where` and :meth:`evict_first`, which scan (at most ``limit`` entries)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._entries: dict[int, HeldReport] = {}                 # sequence -> report, oldest first
        self._by_round: dict[tuple[str, int], list[int]] = {}     # (job, round) -> sequences
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[HeldReport]:
        return iter(list(self._entries.values()))

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.limit

    def hold(self, report: HeldReport) -> None:
        """Keep ``report``; the caller has made room (``full`` is False)."""
        assert not self.full
        seq, self._next = self._next, self._next + 1
        self._entries[seq] = report
        self._by_round.setdefault((report.event.job_id, report.event.round), []).append(seq)

    def take(self, job_id: str, round_: int) -> list[HeldReport]:
        """Remove and return the reports of (``job_id``, ``round_``), oldest first."""
        return [self._entries.pop(seq) for seq in self._by_round.pop((job_id, round_), [])]

    def take_where(self, keep_out: Callable[[CopyFinished], bool]) -> list[HeldReport]:
        """Remove and return every report whose event satisfies ``keep_out``, oldest first."""
        chosen = [seq for seq, r in self._entries.items() if keep_out(r.event)]
        return [self._remove(seq) for seq in chosen]

    def evict_first(self, which: Callable[[CopyFinished], bool]) -> HeldReport | None:
        """Remove and return the oldest report satisfying ``which``; None if there is none."""
        seq = next((s for s, r in self._entries.items() if which(r.event)), None)
        return None if seq is None else self._remove(seq)

    def _remove(self, seq: int) -> HeldReport:
        report = self._entries.pop(seq)
        key = (report.event.job_id, report.event.round)
        remaining = [s for s in self._by_round[key] if s != seq]
        if remaining:
            self._by_round[key] = remaining
        else:
            del self._by_round[key]
        return report
