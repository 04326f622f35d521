"""What the scheduler saves in a state snapshot, and how a restart resumes from it.

A scheduler snapshot (``shared.persistence.snapshot`` format, service ``"scheduler"``; numbered by the
store like every snapshot) holds, after round ``next_round - 1`` was published:

* ``state``: the whole :class:`SchedulerState` (jobs, nodes, rates, kept rounds, the
  event-id window used for dedupe),
* ``previous``: the last plan, with the policy's carried state (Hadar's ledger, Gavel's
  books, ...) and ``previous_key``, the policy configuration that made it,
* ``next_round``,
* ``dead_letters``: the origins of the bad records counted in ``hadar_scheduler_dead_letters``,
  as ``"topic:partition" -> [offset, ...]`` (plain msgpack: cheap for many; None in a
  snapshot written before they were kept),
* offsets: for every input topic-partition the next record not folded, for every
  partition of ``hadar.placements`` the next record after the scheduler's own rounds, and
  for every partition of ``hadar.deadletter`` the next letter not counted.

Restarting from it (:func:`resume`) replays only the records from those offsets: recorded
rounds from ``next_round`` on are re-derived exactly as a whole-log restart re-derives them
(``rerun``, same checks), earlier rounds are not read at all, and ``hadar.deadletter`` is
read only after the letters ``dead_letters`` already count (from its start for a snapshot
without them). Because the snapshot is the live state itself and the inputs after it are
folded by the same rule, the plans after a restart are the ones an uninterrupted scheduler
makes (``tests/unit/test_scheduler_snapshot.py``,
``benchmarks/recovery.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from services.scheduler.core.policy import Plan
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import import_all
from shared.persistence.codec import snapshot_type
from shared.persistence.snapshot import SnapshotCorrupt, StateSnapshot
from shared.wire.topics import DEADLETTER, PLACEMENTS

__all__ = ["SERVICE", "SchedulerSnapshot", "capture", "restore", "input_offsets", "dead_letter_origins",
           "dead_letter_start"]

SERVICE = "scheduler"

# Every type a snapshot may hold registers itself where it is defined (a policy's state
# beside the policy); importing every policy makes all of them known before one is read.
import_all()


@snapshot_type("scheduler.SchedulerSnapshot", formerly="services.scheduler.snapshot.SchedulerSnapshot")
@dataclass(frozen=True, kw_only=True)
class SchedulerSnapshot:
    """The body of a scheduler snapshot (see the module docstring)."""

    state: SchedulerState
    previous: Plan | None
    previous_key: tuple[str, str] | None
    next_round: int
    dead_letters: dict[str, list[int]] | None = None   # None: written before they were kept



def capture(*, state: SchedulerState, previous: Plan | None, previous_key: tuple[str, str] | None,
            next_round: int, folded: dict[str, int], placed: dict[int, int], created_at: float,
            dead_letters: Iterable[tuple[str, int, int]] = (), lettered: dict[int, int] | None = None) -> StateSnapshot:
    """A snapshot of the scheduler after round ``next_round - 1`` (``state`` is not copied:
    dump it before the state changes; ``dead_letters`` and ``lettered`` are)."""
    offsets = dict(folded)
    offsets.update({f"{PLACEMENTS}:{p}": o for p, o in placed.items()})
    offsets.update({f"{DEADLETTER}:{p}": o for p, o in (lettered or {}).items()})
    letters: dict[str, list[int]] = {}
    for topic, partition, offset in dead_letters:
        letters.setdefault(f"{topic}:{partition}", []).append(offset)
    body = SchedulerSnapshot(state=state, previous=previous, previous_key=previous_key, next_round=next_round,
                             dead_letters={tp: sorted(found) for tp, found in sorted(letters.items())})
    return StateSnapshot(service=SERVICE, created_at=created_at, offsets=offsets, body=body)


def restore(snapshot: StateSnapshot) -> SchedulerSnapshot:
    """The body of a loaded scheduler snapshot; :class:`SnapshotCorrupt` if it is not one."""
    body = snapshot.body
    if not (isinstance(body, SchedulerSnapshot) and isinstance(body.state, SchedulerState)
            and (body.previous is None or isinstance(body.previous, Plan))
            and isinstance(body.next_round, int) and body.next_round >= 0):
        raise SnapshotCorrupt("not a scheduler snapshot body")
    key = body.previous_key
    if key is not None and not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
        raise SnapshotCorrupt("malformed policy key")
    letters = body.dead_letters
    if letters is not None and not (isinstance(letters, dict) and all(
            isinstance(tp, str) and tp.rpartition(":")[2].isdigit() and isinstance(offsets, list)
            and all(type(o) is int for o in offsets) for tp, offsets in letters.items())):
        raise SnapshotCorrupt("malformed dead-letter origins")
    # A snapshot written before sizes were folded: no job's size is known yet (the estimates
    # before it are not replayed), so HadarE charges those jobs nothing, as it did then.
    vars(body.state).setdefault("sizes", {})
    vars(body.state).setdefault("queues", None)   # written before queues existed: none applied
    return body


def input_offsets(snapshot: StateSnapshot) -> tuple[dict[str, int], dict[int, int]]:
    """(folded input offsets as ``"topic:partition" -> offset``, placements ``partition -> offset``)."""
    own = (f"{PLACEMENTS}:", f"{DEADLETTER}:")
    folded = {tp: o for tp, o in snapshot.offsets.items() if not tp.startswith(own)}
    return folded, snapshot.partition_offsets(PLACEMENTS)


def dead_letter_origins(body: SchedulerSnapshot) -> Iterator[tuple[str, int, int]]:
    """(topic, partition, offset) of every bad record ``body`` counted (none if it did not keep them)."""
    for tp, offsets in (body.dead_letters or {}).items():
        topic, _, partition = tp.rpartition(":")
        for offset in offsets:
            yield topic, int(partition), offset


def dead_letter_start(snapshot: StateSnapshot, body: SchedulerSnapshot) -> dict[int, int] | None:
    """Where to read ``hadar.deadletter`` from after restoring ``body``: past the letters its
    ``dead_letters`` count, or from the start (None) if it does not carry them."""
    return snapshot.partition_offsets(DEADLETTER) if body.dead_letters is not None else None
