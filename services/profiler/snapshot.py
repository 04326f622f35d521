"""What the profiler saves in a state snapshot, and the offsets it covers.

A profiler snapshot (``shared.persistence.snapshot`` format, service ``"profiler"``) holds its whole
:class:`ProfilerState` -- job specs, which jobs were estimated, each copy's last report,
each key's EWMA and last published rate, and each node's GPU types -- and, for the three
topics the profiler replays at start (``hadar.throughput``, ``hadar.jobs`` and
``hadar.nodes``), the offset of every partition up to which
that state covers them: what the start-up replay read, then the jobs it handled and the
estimates it published itself.

A restart from it replays those three topics from the recorded offsets only, exactly as a
whole-log restart replays them from the start (seeding published rates, remembering jobs
and estimates), so no job is estimated twice and smoothing resumes from the snapshot's
EWMA (a whole-log restart resumes from the last published rate). Its consumer group
resumes where it committed, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.profiler.state import ProfilerState
from shared.persistence.codec import snapshot_type
from shared.persistence.snapshot import SnapshotCorrupt, StateSnapshot

__all__ = ["SERVICE", "ProfilerSnapshot", "capture", "restore"]

SERVICE = "profiler"


@snapshot_type("profiler.ProfilerSnapshot", formerly="services.profiler.snapshot.ProfilerSnapshot")
@dataclass(frozen=True, kw_only=True)
class ProfilerSnapshot:
    state: ProfilerState



def capture(state: ProfilerState, offsets: dict[str, int], *, created_at: float) -> StateSnapshot:
    """A snapshot of ``state`` covering ``offsets`` (``"topic:partition" -> next offset``); dump
    it before the state changes (the store numbers it)."""
    return StateSnapshot(service=SERVICE, created_at=created_at, offsets=dict(offsets),
                         body=ProfilerSnapshot(state=state))


def restore(snapshot: StateSnapshot, *, alpha: float, threshold: float) -> ProfilerState:
    """The state of a loaded profiler snapshot, with this profiler's smoothing settings;
    :class:`SnapshotCorrupt` if it is not one."""
    body = snapshot.body
    if not (isinstance(body, ProfilerSnapshot) and isinstance(body.state, ProfilerState)):
        raise SnapshotCorrupt("not a profiler snapshot body")
    state = body.state
    state.fill_added_attributes()
    state.alpha, state.threshold = alpha, threshold   # settings come from the config, not the snapshot
    return state
