"""The tracker's settings (light: ``hadar serve tracker`` validates them before importing the service)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.domain.deadline import LATE_COPY_S
from shared.domain.model_meta import Mode
from shared.runtime.config import FieldError

__all__ = ["TrackerConfig", "MAX_RETRY_S", "default_consolidation_threads"]

MAX_RETRY_S = 60.0      # the longest back-off between two attempts at a round or a completion
MAX_CONSOLIDATION_THREADS = 256


def default_consolidation_threads() -> int:
    """1. Averaging is memory-bound: on the 2-core development machine two threads gave
    0.93-1.13x of one on a quiet machine (1.2x beside two CPU hogs) for +32 MiB of staging
    (``benchmarks/consolidate.py --threads 2``), so more threads are an operator's choice
    for a machine with more memory bandwidth, not the default."""
    return 1


@dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """The tracker's settings; ``hadar serve tracker`` loads them with
    :func:`shared.runtime.config.load_config` (flags, ``HADAR_TRACKER_*``, ``--config`` file).

    ``mode``: weigh copies by the steps each did, or uniformly. ``finish_timeout_s``: how
    long after a round's deadline missing copies are waited for (``shared.domain.deadline``: the
    scheduler's ``late_copy_s``, same default). ``tick_s``: how often due
    rounds are checked, also the first retry's back-off. ``max_attempts``: attempts at
    consolidating a round (or completing a job) before it is given up; the default, 6,
    gives up about 31 s of back-off after the first failure (tick 1 s), within the
    scheduler's default ``consolidation_wait_s`` of 60 s. ``chunk_bytes``: accumulator
    chunk, also the size of each ranged read from the store. ``consolidation_threads``:
    threads that average a round's chunks (1..256; default 1, see
    :func:`default_consolidation_threads`; the model is the same bytes whatever the number).
    ``consolidation_jobs``: jobs whose due rounds are consolidated at once (1..64; one job's
    rounds always in order), so one job's download overlaps another's averaging and upload,
    and the next round no longer waits for the jobs one after another. ``temp_dir``: where
    consolidated models are staged (None: the system's). An invalid value raises
    :class:`~shared.runtime.config.FieldError` naming the field.

    Object lifecycle (:mod:`services.tracker.lifecycle` has the rules):
    ``keep_round_models``: round models kept per running job, the latest announced ones
    (>= 1; a model an open round starts from is kept too). ``delete_checkpoints``: delete
    the checkpoints of decided rounds. ``delete_completed_models``: delete every round
    model of a completed job (its final model is a copy of the latest). ``straggler_sweep_s``:
    how long after a job completed its objects are swept once more, for checkpoints
    uploaded late (0: no second sweep).

    State snapshots (:mod:`services.tracker.snapshot`): ``snapshot_every``: write one after
    every this many rounds the tracker decided itself (0: never; restarts read the whole
    log); ``snapshots_kept``: how many are kept (the newest).

    Replicas (:mod:`services.tracker.standby`): ``standby``: run as one of several replicas,
    active only while it holds the role (:mod:`shared.runtime.leadership`); ``lease_ttl_s``:
    how long the active one may go without renewing before a standby takes over.
    """

    group: str = "hadar-tracker"
    mode: Mode = "steps"
    finish_timeout_s: float = LATE_COPY_S
    tick_s: float = 1.0
    max_attempts: int = 6
    chunk_bytes: int = 8 << 20
    consolidation_threads: int = field(default_factory=default_consolidation_threads)
    consolidation_jobs: int = 4
    temp_dir: str | None = None
    keep_round_models: int = 2
    delete_checkpoints: bool = True
    delete_completed_models: bool = True
    straggler_sweep_s: float = 600.0
    snapshot_every: int = 10
    snapshots_kept: int = 3
    source: str = "tracker"
    standby: bool = False
    lease_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lease_ttl_s) and 1.0 <= self.lease_ttl_s <= 3600):
            raise FieldError("lease_ttl_s", f"must be in 1..3600 seconds, got {self.lease_ttl_s}")
        if self.mode not in ("steps", "uniform"):
            raise FieldError("mode", f"must be 'steps' or 'uniform', got {self.mode!r}")
        if not self.finish_timeout_s >= 0:
            raise FieldError("finish_timeout_s", f"must be >= 0, got {self.finish_timeout_s}")
        if not self.tick_s > 0:
            raise FieldError("tick_s", f"must be > 0, got {self.tick_s}")
        if not 1 <= self.max_attempts <= 1000:
            raise FieldError("max_attempts", f"must be in 1..1000, got {self.max_attempts}")
        if self.chunk_bytes < 8:
            raise FieldError("chunk_bytes", f"must be >= 8, got {self.chunk_bytes}")
        if not 1 <= self.consolidation_threads <= MAX_CONSOLIDATION_THREADS:
            raise FieldError("consolidation_threads",
                             f"must be in 1..{MAX_CONSOLIDATION_THREADS}, got {self.consolidation_threads}")
        if not 1 <= self.consolidation_jobs <= 64:
            raise FieldError("consolidation_jobs", f"must be in 1..64, got {self.consolidation_jobs}")
        if not 1 <= self.keep_round_models <= 1_000_000:
            raise FieldError("keep_round_models", f"must be in 1..1000000, got {self.keep_round_models}")
        if not 0 <= self.straggler_sweep_s <= 1e9:
            raise FieldError("straggler_sweep_s", f"must be in 0..1e9, got {self.straggler_sweep_s}")
        if not 0 <= self.snapshot_every <= 1_000_000:
            raise FieldError("snapshot_every", f"must be in 0..1000000 rounds, got {self.snapshot_every}")
        if not 1 <= self.snapshots_kept <= 1000:
            raise FieldError("snapshots_kept", f"must be in 1..1000, got {self.snapshots_kept}")

    @property
    def fencing_id(self) -> str:
        """The transactional id the active replica publishes its announcements and renewals
        under (under the group's name: the tracker principal's ACL prefix)."""
        return f"{self.group}-models"
