"""The scheduler's settings, and the part of them every recorded round carries.

:class:`SchedulerConfig` is what ``hadar serve scheduler`` and the embedded demo build
(from flags, the environment or a file); it validates itself, so every way of starting a
scheduler rejects the same bad values with the same message.

:class:`DecisionSettings` is the subset a round's decision depends on -- the policy and its
options, the seed, the round length and the heartbeat period that decided which nodes
were live. The live scheduler writes it into every RoundStarted, and replay and start-up
recovery read it back from there, so a recorded round is re-derived with exactly the
settings it was decided with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.policies import POLICY_NAMES, PolicyChoice, UnknownPolicy
from shared.domain.deadline import CONSOLIDATION_WAIT_S, LATE_COPY_S
from shared.runtime.config import FieldError
from shared.wire.events import RoundStarted

__all__ = ["SchedulerConfig", "DecisionSettings"]


@dataclass(frozen=True, kw_only=True)
class DecisionSettings:
    """Everything besides the folded events that a round's plan depends on."""

    choice: PolicyChoice
    seed: int
    round_s: float
    heartbeat_s: float

    @classmethod
    def of_round(cls, started: RoundStarted) -> DecisionSettings:
        """The settings ``started`` recorded. Logs written before rounds recorded their
        settings carry defaults: no options, seed 0, the round's own length."""
        round_s = started.round_s or (started.ends_at - started.started_at)
        return cls(choice=PolicyChoice.recorded(started.policy, started.policy_options), seed=started.seed,
                   round_s=round_s, heartbeat_s=started.heartbeat_s)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's settings; ``hadar serve scheduler`` loads them with
    :func:`shared.runtime.config.load_config` (flags, ``HADAR_SCHEDULER_*``, ``--config`` file).

    ``policy_options``: keyword options of the policy's constructor (JSON values).
    ``late_copy_s`` and ``consolidation_wait_s``: the next round waits for the previous
    round's models until its deadline plus both (``shared.domain.deadline``, the rule the tracker
    decides late rounds by with its ``finish_timeout_s``: keep ``late_copy_s`` equal to it).
    ``round_overhead_factor``: a round is never shorter than this times the measured
    start-up + consolidation overhead (:mod:`services.scheduler.live.round_length`; 0: off).
    ``group``: consumer group id (also the owner of its snapshots). ``source``: the events'
    ``source``. ``snapshot_every``: with an object store, write a state snapshot after every
    this many rounds (0: never); ``snapshots_kept``: how many of them to keep. ``standby``:
    run as one of several replicas, active only while it holds the role
    (:mod:`shared.runtime.leadership`; ``lease_ttl_s``: how long the active one may go without
    renewing before a standby takes over). An invalid value raises
    :class:`~shared.runtime.config.FieldError` naming the field."""

    policy: str = "hadare"
    policy_options: dict[str, Any] = field(default_factory=dict)
    round_s: float = 360.0
    heartbeat_s: float = 5.0
    late_copy_s: float = LATE_COPY_S
    consolidation_wait_s: float = CONSOLIDATION_WAIT_S
    round_overhead_factor: float = 3.0
    seed: int = 0
    group: str = "hadar-scheduler"
    source: str = "scheduler"
    snapshot_every: int = 10
    snapshots_kept: int = 3
    standby: bool = False
    lease_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lease_ttl_s) and 1.0 <= self.lease_ttl_s <= 3600):
            raise FieldError("lease_ttl_s", f"must be in 1..3600 seconds, got {self.lease_ttl_s}")
        if not 0 <= self.snapshot_every <= 1_000_000:
            raise FieldError("snapshot_every", f"must be in 0..1000000 rounds, got {self.snapshot_every}")
        if not 1 <= self.snapshots_kept <= 1000:
            raise FieldError("snapshots_kept", f"must be in 1..1000, got {self.snapshots_kept}")
        for name in ("round_s", "heartbeat_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise FieldError(name, f"must be a finite number > 0, got {value}")
        for name in ("late_copy_s", "consolidation_wait_s", "round_overhead_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise FieldError(name, f"must be a finite number >= 0, got {value}")
        if not 0 <= self.seed < 2**63:
            raise FieldError("seed", f"must be in 0..2**63-1, got {self.seed}")
        for name in ("group", "source"):
            if not getattr(self, name):
                raise FieldError(name, "must not be empty")
        try:
            PolicyChoice(name=self.policy, options=self.policy_options)
        except UnknownPolicy as exc:
            field_name = "policy" if self.policy not in POLICY_NAMES else "policy_options"
            raise FieldError(field_name, str(exc)) from None

    @property
    def fencing_id(self) -> str:
        """The transactional id the active replica publishes rounds and renewals under
        (under the group's name: the scheduler principal's ACL prefix)."""
        return f"{self.group}-rounds"

    @property
    def choice(self) -> PolicyChoice:
        return PolicyChoice(name=self.policy, options=self.policy_options)

    @property
    def decision_settings(self) -> DecisionSettings:
        return DecisionSettings(choice=self.choice, seed=self.seed, round_s=self.round_s,
                                heartbeat_s=self.heartbeat_s)
