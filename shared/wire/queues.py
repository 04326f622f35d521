"""Teams on one cluster, as the wire carries them: queue definitions and each round's standing.

An operator keeps the queues in a YAML file and applies it with ``hadar queues apply``,
which publishes a :class:`~shared.wire.events.QueuesApplied` carrying one
:class:`QueueConfig`: the latest one applied is in force (the scheduler, replay and the
simulator all read the same history). Every job belongs to one queue (``JobSpec.queue``;
empty: ``QueueConfig.default_queue``). Each RoundStarted carries a :class:`QueueStanding`
per queue: what the round gave it, so ``hadar queues`` and the metrics show what the
scheduler decided, not a recomputation. The rules are in
``services/scheduler/core/queues.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire.records import InvalidEvent, Record, check_queue_name, require

__all__ = ["QueueSpec", "QueueConfig", "QueueStanding", "MAX_QUEUES", "MAX_GPUS"]

MAX_QUEUES = 256
MAX_GPUS = 1 << 20


def _check_gpus(counts: dict[str, int], where: str) -> None:
    for gpu_type, n in counts.items():
        require(0 < len(gpu_type) <= 32, f"{where}: a GPU type is 1-32 characters")
        if not 0 <= n <= MAX_GPUS:
            raise InvalidEvent(f"{where}[{gpu_type!r}]: must be in 0..{MAX_GPUS}, got {n}")


@dataclass(frozen=True, kw_only=True)
class QueueSpec(Record):
    """One team's queue.

    ``quota``: GPUs of each type the queue is promised (its nominal quota); ``weight``: its
    share of idle capacity against other queues with demand; ``borrowing_limit``: GPUs beyond
    its quota it may borrow when others leave them idle (None: any idle GPU, 0: none);
    ``user_max_gpus``: the most GPUs (the jobs' W, summed) one user's jobs in it may ask for
    at once, and ``user_max_queued`` how many of one user's jobs it takes at once (None: no
    limit); jobs past either wait."""

    name: str
    weight: float = 1.0
    quota: dict[str, int] = field(default_factory=dict)
    borrowing_limit: int | None = None
    user_max_gpus: int | None = None
    user_max_queued: int | None = None

    def _check(self) -> None:
        check_queue_name(self.name, "QueueSpec.name")
        if not 0 < self.weight <= 1000:
            raise InvalidEvent(f"QueueSpec.weight: must be in (0, 1000], got {self.weight}")
        _check_gpus(self.quota, "QueueSpec.quota")
        for name in ("borrowing_limit", "user_max_gpus", "user_max_queued"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_GPUS:
                raise InvalidEvent(f"QueueSpec.{name}: must be in 0..{MAX_GPUS}, got {value}")

    @property
    def nominal(self) -> int:
        return sum(self.quota.values())


@dataclass(frozen=True, kw_only=True)
class QueueConfig(Record):
    """The queues in force. ``fair_share_half_life_s``: how fast a queue's past use stops
    counting against it when queues compete for idle GPUs (usage halves every half-life)."""

    queues: tuple[QueueSpec, ...]
    default_queue: str
    fair_share_half_life_s: float = 86400.0

    def _check(self) -> None:
        require(1 <= len(self.queues) <= MAX_QUEUES, f"QueueConfig.queues: 1..{MAX_QUEUES} queues")
        names = [q.name for q in self.queues]
        require(len(set(names)) == len(names), "QueueConfig.queues: two queues with one name")
        require(self.default_queue in names, "QueueConfig.default_queue: must name one of the queues")
        if not (60 <= self.fair_share_half_life_s <= 365 * 86400):
            raise InvalidEvent("QueueConfig.fair_share_half_life_s: must be between a minute and a year, "
                               f"got {self.fair_share_half_life_s}")

    def queue(self, name: str) -> QueueSpec | None:
        return next((q for q in self.queues if q.name == name), None)

    def queue_of(self, requested: str) -> str:
        """The queue a job that names ``requested`` belongs to ("" is the default queue)."""
        return requested or self.default_queue


@dataclass(frozen=True, kw_only=True)
class QueueStanding(Record):
    """What one round gave a queue: GPUs it was entitled to by type (``entitled``: its
    guaranteed part plus what it borrowed), how many of them were borrowed beyond its
    quota, how many of its quota it lent to others, its decayed fair-share ``usage``
    (normalized GPU-seconds) and its jobs: ``pending`` (visible to the policy but not
    placed, or held by a limit) and ``running``."""

    name: str
    entitled: dict[str, int] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)
    borrowed: int = 0
    lent: int = 0
    usage: float = 0.0
    pending: int = 0
    running: int = 0

    def _check(self) -> None:
        check_queue_name(self.name, "QueueStanding.name")
        _check_gpus(self.entitled, "QueueStanding.entitled")
        _check_gpus(self.used, "QueueStanding.used")
        require(0 <= self.borrowed <= MAX_GPUS and 0 <= self.lent <= MAX_GPUS,
                "QueueStanding.borrowed/lent: must be in 0..2^20")
        require(self.usage >= 0 and self.pending >= 0 and self.running >= 0,
                "QueueStanding.usage/pending/running: must be >= 0")
