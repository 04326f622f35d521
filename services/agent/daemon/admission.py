"""Which copies this node runs: the agent's decisions, pure (no I/O, no clock, no asyncio).

The daemon hands every RoundStarted, JobCancelled and Assignment to an :class:`Admission`
and carries out the :class:`Verdict`: preempt the copies it names, then ignore, skip (ack),
refuse (dead-letter with ``detail``, count by ``code``) or admit the event.

**Which round is believed.** ``latest_round`` (-1 at first) is the newest round the agent
believes. A round r > latest is believed at once if r <= latest + ``max_round_leap`` (8):
the scheduler numbers rounds one by one, also across its restarts (it recovers the last
round from the log), and an agent sees a round more than one ahead only while it catches
up on a backlog (RoundStarted events are keyed by round, so rounds lie on different
partitions, read unevenly). A round further ahead is a *claim*: refused
(``round_far_ahead``), and believed only when another event -- another id -- claims a round
within ``max_round_leap`` of it, as a real scheduler's next RoundStarted and its other
assignments of the round do. So one forged event, whatever its round, never moves the
belief. (The daemon seeds the belief from the log's recent RoundStarted events at start,
so a restarted agent believes the current round before it meets its own unfinished
assignment again.)

**What a believed round makes stale** is bounded too: only rounds *close* behind it, in
[latest - max_round_leap, latest). A live assignment far behind the believed round cannot
come from a scheduler that really reached that round (rounds start after the previous one
ends, or earlier only after one that placed nothing, so old rounds' deadlines have
passed): the belief was forged, or the scheduler's log was reset. Such an assignment is
judged on its own (deadline, validity, GPUs) and does not move the belief. Hence even a
forged *stream* of far rounds leaves real assignments running; what a forged round can do
is preempt the running copies once, when it is believed, and one inside the leap can make
up to ``max_round_leap`` rounds stale.

**An Assignment for this node** is decided in this order:

1. ``duplicate`` (skip): its copy (job, round, copy) is here or was admitted (last 4096);
2. ``stale`` (skip): its deadline has passed or its round is close behind ``latest_round``
   (above), or later (step 5) a GPU it names is held by a copy of a newer round;
3. refused when implausible (:func:`services.agent.daemon.validation.assignment_problem`:
   ``deadline``, ``gpus``, ``ranks``, ``rendezvous``, ``start_from``);
4. refused ``round_far_ahead`` unless its round is believed (above);
5. refused ``gpu_busy`` if a GPU it names is held by another copy of its round;
6. admitted. Copies of older rounds holding its GPUs are preempted (the new round needs
   them); if its round is newer than ``latest_round``, so is every older-round copy it does
   not continue. ``wait_for`` names every preempted copy still on its GPUs: the daemon
   starts its workers only once those have exited.

**Guarantees** (checked by a Hypothesis state machine in tests/unit/test_agent_admission.py):
every GPU is held by at most one admitted copy, so at most ``len(gpus)`` copies are admitted;
with the daemon honouring ``wait_for``, no GPU ever runs two copies' workers; no method raises
on a valid event. Skips are what replays and redeliveries produce and are not dead-lettered.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from services.agent.daemon.validation import assignment_problem
from shared.domain.ownership import cancel_refusal
from shared.wire.events import Assignment, JobCancelled, RoundStarted

__all__ = ["Admission", "AdmissionLimits", "CopyKey", "Preemption", "Verdict", "copy_name"]

CopyKey = tuple[str, int, int]   # (job, round, copy)
SEEN_LIMIT = 4096
CLAIMS_LIMIT = 32
OWNERS_LIMIT = 4096   # owners of the latest jobs assigned here: enough for every job it still runs

Action = Literal["ignore", "accept", "skip", "refuse", "admit"]


def copy_name(key: CopyKey) -> str:
    return "/".join(map(str, key))


@dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    """``max_round_leap``: rounds ahead of the believed one that are believed without a second
    event; ``max_deadline_ahead_s``: how far ahead an assignment's deadline may lie."""

    max_round_leap: int = 8
    max_deadline_ahead_s: float = 86_400.0

    def __post_init__(self) -> None:
        if self.max_round_leap < 1:
            raise ValueError(f"max_round_leap must be >= 1, got {self.max_round_leap}")
        if not self.max_deadline_ahead_s > 0:
            raise ValueError(f"max_deadline_ahead_s must be > 0, got {self.max_deadline_ahead_s}")


@dataclass(frozen=True, kw_only=True)
class Preemption:
    key: CopyKey
    reason: str


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What to do with one event.

    ``action``: ``ignore`` (not for this node), ``accept`` (acted on: see ``preempt``),
    ``skip`` (stale or duplicate), ``refuse`` (dead-letter it) or ``admit`` (start the copy
    once every copy in ``wait_for`` has exited). ``code``/``detail`` say why for skip and
    refuse. ``preempt``: copies to stop, whatever the action.
    """

    action: Action
    code: str = ""
    detail: str = ""
    preempt: tuple[Preemption, ...] = ()
    wait_for: tuple[CopyKey, ...] = ()


IGNORE = Verdict(action="ignore")
ACCEPT = Verdict(action="accept")


class Admission:
    """The copies admitted on one node and the round it believes; see the module rules."""

    def __init__(self, *, node_id: str, gpus: Iterable[int], limits: AdmissionLimits | None = None) -> None:
        self.node_id = node_id
        self.gpus = frozenset(gpus)
        self.limits = limits or AdmissionLimits()
        self._latest = -1
        self._claims: deque[tuple[int, str]] = deque(maxlen=CLAIMS_LIMIT)   # (round, event id) not believed
        self._running: dict[CopyKey, tuple[int, ...]] = {}    # admitted, holding these GPUs
        self._draining: dict[CopyKey, tuple[int, ...]] = {}   # preempted, workers not yet exited
        self._seen: OrderedDict[CopyKey, None] = OrderedDict()
        self._assigned: dict[int, set[tuple[str, int]]] = {}  # round -> (job, copy) admitted here
        self._owners: OrderedDict[str, str] = OrderedDict()     # job -> its user, from its Assignments

    @property
    def latest_round(self) -> int:
        return self._latest

    @property
    def running(self) -> Mapping[CopyKey, tuple[int, ...]]:
        """Admitted copies and the GPUs each holds (disjoint)."""
        return MappingProxyType(self._running)

    @property
    def draining(self) -> Mapping[CopyKey, tuple[int, ...]]:
        """Preempted copies whose workers have not exited yet, and the GPUs they were on."""
        return MappingProxyType(self._draining)

    # ------------------------------------------------------------ events

    def round_started(self, event: RoundStarted) -> Verdict:
        if event.round <= self._latest:
            return ACCEPT
        if not self._believe(event.round, event.id):
            return self._far(event.round)
        return Verdict(action="accept", preempt=tuple(self._advance(event.round)))

    def cancelled(self, event: JobCancelled) -> Verdict:
        """Preempt the job's copies, unless the cancellation names a user other than the
        job's owner (the user of its Assignments): then refuse it [not_owner]."""
        refusal = cancel_refusal(event, self._owners.get(event.job_id))
        if refusal is not None:
            return Verdict(action="refuse", code="not_owner", detail=refusal)
        job_id, reason = event.job_id, event.reason
        why = f"job cancelled: {reason}" if reason else "job cancelled"
        return Verdict(action="accept", preempt=tuple(self._preempt(key, why) for key in list(self._running)
                                                      if key[0] == job_id))

    def assignment(self, a: Assignment, *, now: float) -> Verdict:
        if a.node_id != self.node_id:
            return IGNORE
        key: CopyKey = (a.job_id, a.round, a.copy)
        if key in self._seen or key in self._running or key in self._draining:
            return Verdict(action="skip", code="duplicate", detail=f"copy {copy_name(key)} was assigned here before")
        if a.deadline <= now:
            return Verdict(action="skip", code="stale", detail=f"deadline passed {now - a.deadline:.0f} s ago")
        if self._latest - self.limits.max_round_leap <= a.round < self._latest:
            return Verdict(action="skip", code="stale", detail=f"round {a.round} is older than round {self._latest}")
        problem = assignment_problem(a, gpus=self.gpus, now=now,
                                     max_deadline_ahead_s=self.limits.max_deadline_ahead_s)
        if problem is not None:
            return Verdict(action="refuse", code=problem.code, detail=problem.detail)
        if a.round > self._latest and not self._believe(a.round, a.id):
            return self._far(a.round)
        wanted = set(a.gpus)
        displaced: list[CopyKey] = []
        for holder, gpus in self._running.items():
            shared = wanted.intersection(gpus)
            held = f"GPU {min(shared)} is held by copy {copy_name(holder)} (round {holder[1]})" if shared else ""
            if shared and holder[1] > a.round:
                return Verdict(action="skip", code="stale", detail=held)
            if shared and holder[1] == a.round:
                return Verdict(action="refuse", code="gpu_busy", detail=held)
            if shared:
                displaced.append(holder)
        self._remember(key)
        self._assigned.setdefault(a.round, set()).add((a.job_id, a.copy))
        self._owners[a.job_id] = a.job.user
        self._owners.move_to_end(a.job_id)
        while len(self._owners) > OWNERS_LIMIT:
            self._owners.popitem(last=False)
        preempt = [self._preempt(h, f"round {a.round} needs its GPUs for {copy_name(key)}") for h in displaced]
        if a.round > self._latest:
            preempt.extend(self._advance(a.round))
        wait_for = tuple(sorted(k for k, gpus in self._draining.items() if wanted.intersection(gpus)))
        self._running[key] = a.gpus
        return Verdict(action="admit", preempt=tuple(preempt), wait_for=wait_for)

    def exited(self, key: CopyKey) -> None:
        """The copy's workers are gone: its GPUs are free."""
        self._running.pop(key, None)
        self._draining.pop(key, None)

    # ------------------------------------------------------------ rules

    def _believe(self, round_: int, event_id: str) -> bool:
        """Whether ``round_`` (> latest) is believed; a round not believed is kept as a claim."""
        leap = self.limits.max_round_leap
        if round_ <= self._latest + leap:
            return True
        if any(other != event_id and abs(claimed - round_) <= leap for claimed, other in self._claims):
            return True
        if (round_, event_id) not in self._claims:
            self._claims.append((round_, event_id))
        return False

    def _far(self, round_: int) -> Verdict:
        leap = self.limits.max_round_leap
        return Verdict(action="refuse", code="round_far_ahead",
                       detail=f"round {round_} is {round_ - self._latest} rounds ahead of round {self._latest}, "
                              f"the latest believed; more than {leap} ahead needs a second event to agree")

    def _advance(self, round_: int) -> list[Preemption]:
        """Believe ``round_``: preempt every older-round copy it does not continue."""
        self._latest = round_
        continued = self._assigned.get(round_, set())
        out = [self._preempt(key, f"round {round_} started without this copy") for key in list(self._running)
               if key[1] < round_ and (key[0], key[2]) not in continued]
        for old in [r for r in self._assigned if r < round_ - 1]:
            del self._assigned[old]
        kept = [c for c in self._claims if c[0] > round_]
        self._claims.clear()
        self._claims.extend(kept)
        return out

    def _preempt(self, key: CopyKey, reason: str) -> Preemption:
        self._draining[key] = self._running.pop(key)
        return Preemption(key=key, reason=reason)

    def _remember(self, key: CopyKey) -> None:
        self._seen[key] = None
        if len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)
