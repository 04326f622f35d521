"""One active replica of a role, and standbys that take over when it stops renewing.

Mechanism: every replica of ``role`` follows ``hadar.leadership``. The active one publishes a
:class:`~shared.wire.events.LeaderRenewed` every ``ttl_s / 3`` through the role's
:class:`~shared.bus.fencing.FencedPublisher`. A standby that has seen no new renewal for
``ttl_s`` (measured on its own clock from the last renewal it saw, or from its own start: a
new standby first gives a live holder a full ``ttl_s`` to show itself) takes over: it starts
its own fenced publisher of the role -- which fences the old holder's --, publishes the next
term, and only then returns from :meth:`Leadership.acquire`, so whatever it reads afterwards
includes every batch the old holder ever committed.

Guarantees:

* **Safety does not rest on clocks or timeouts.** A holder frozen past ``ttl_s`` (SIGSTOP, a
  long pause) that resumes still believes it leads, but every publish through its fenced
  publisher -- its renewals and the service's own batches -- raises
  :class:`~shared.bus.fencing.Fenced` once a successor started; :meth:`Leadership.hold` then
  raises :class:`LeadershipLost`. Two standbys that take over at once fence each other in
  turn; the one that started last keeps the role, the other gets :class:`LeadershipLost` at its
  first publish.
* **Liveness:** a standby takes over within 1.5 ``ttl_s`` (the lease, and a stagger fixed per
  replica name so that replicas started together rarely claim at once) + one poll
  (``ttl_s / 5``) + the time to start a publisher after the holder's last renewal, as long
  as the bus is reachable. While the bus is not, nobody can take over (nor publish).
* Terms only grow: a successor's term is one more than the highest it has read.

Why Kafka's log and transactions rather than consumer-group membership: group rebalances hand
a partition to whichever member sorts first, so a standby joining would move the role away
from a healthy holder, and fencing would still be needed for a holder frozen past its
session. Fencing alone is the part Kafka guarantees; the renewals only decide *when* to fence.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import uuid
import zlib
from dataclasses import dataclass, replace

import structlog

from shared.bus import Bus, BusError
from shared.bus.fencing import Fenced, FencedPublisher
from shared.clock import Clock, SystemClock
from shared.errors import HadarError
from shared.wire.events import LeaderRenewed
from shared.wire.topics import LEADERSHIP

__all__ = ["Leadership", "LeadershipLost", "LeaseView", "observe", "due_to_take_over", "stagger", "default_holder",
           "add_standby_args"]


def add_standby_args(parser: argparse.ArgumentParser) -> None:
    """``--standby``, ``--lease-ttl-s`` and ``--holder``: the flags of a single-writer
    service that runs as one of several replicas (the scheduler, the tracker)."""
    parser.add_argument("--standby", action="store_true", default=None,
                        help="one of several replicas: wait as a standby, take over when the active one stops "
                             "renewing for --lease-ttl-s, step down (exit 3) when a newer one takes over")
    parser.add_argument("--lease-ttl-s", type=float, default=None,
                        help="with --standby: seconds without a renewal before a standby takes over (default: 10)")
    parser.add_argument("--holder", default=None,
                        help="with --standby: this replica's name in hadar.leadership (default: host, pid and a "
                             "random suffix)")

RENEWALS_PER_TTL = 3
POLLS_PER_TTL = 5


class LeadershipLost(HadarError):
    """A newer replica took the role over: this one must stop acting as its holder."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


@dataclass(frozen=True, kw_only=True)
class LeaseView:
    """What one candidate knows of ``role``: the highest term read, its holder, and when
    (this candidate's clock) it last saw a new renewal -- or started watching."""

    term: int = 0
    holder: str | None = None
    seen_at: float = 0.0


def observe(view: LeaseView, renewal: LeaderRenewed, *, now: float) -> LeaseView:
    """``view`` after reading ``renewal`` at ``now``; a renewal of an older term changes nothing."""
    if renewal.term < view.term:
        return view
    return replace(view, term=renewal.term, holder=renewal.holder, seen_at=now)


def due_to_take_over(view: LeaseView, *, now: float, ttl_s: float, stagger_s: float = 0.0) -> bool:
    """True once no renewal has been seen for ``ttl_s`` + ``stagger_s``."""
    return now - view.seen_at >= ttl_s + stagger_s


def stagger(holder: str, ttl_s: float) -> float:
    """A fixed extra wait in [0, ttl_s / 2) per holder name, so that replicas started together
    rarely claim the role at the same moment (if they do, fencing settles it)."""
    return ttl_s * (zlib.crc32(holder.encode()) % 1000) / 2000


def default_holder(role: str) -> str:
    """A name for this replica: host, process and a random suffix (a restart is a new holder)."""
    return f"{role}-{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Leadership:
    """The role ``role`` for replica ``holder``, fenced under ``fencing_id`` (also the id of
    the publisher the service publishes its own batches with: :attr:`publisher`)."""

    def __init__(self, bus: Bus, *, role: str, fencing_id: str, holder: str | None = None,
                 ttl_s: float = 10.0, clock: Clock | None = None, source: str = "") -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.bus = bus
        self.role = role
        self.fencing_id = fencing_id
        self.holder = holder or default_holder(role)
        self.ttl_s = ttl_s
        self.clock = clock or SystemClock()
        self.source = source or role
        self.view = LeaseView()
        self.term: int | None = None   # this replica's term once it holds the role
        self._publisher: FencedPublisher | None = None
        self._next: dict[int, int] = {}   # leadership partition -> next offset to read
        self._log = structlog.get_logger(__name__).bind(role=role, holder=self.holder)

    @property
    def publisher(self) -> FencedPublisher:
        """The fenced publisher of the role; only after :meth:`acquire`."""
        if self._publisher is None:
            raise RuntimeError("leadership not acquired")
        return self._publisher

    async def _read_new(self) -> None:
        async for d in self.bus.read(LEADERSHIP, start=dict(self._next)):
            self._next[d.partition] = max(self._next.get(d.partition, 0), d.offset + 1)
            if isinstance(d.event, LeaderRenewed) and d.event.role == self.role:
                self.view = observe(self.view, d.event, now=self.clock.time())

    async def acquire(self) -> int:
        """Wait until the role is free, take it over (fencing the old holder) and return
        this replica's term. A candidate fenced before its first renewal was committed (a
        rival claimed at the same moment) has done nothing as the holder: it goes back to
        waiting, giving the rival a full ``ttl_s`` to renew."""
        await self.bus.ensure_topics([LEADERSHIP])
        self.view = replace(self.view, seen_at=self.clock.time())
        while True:
            await self._await_silence()
            try:
                return await self._claim()
            except LeadershipLost:
                self._log.info("leadership.claim_lost", term=self.view.term)
            except BusError as exc:   # the bus away while claiming: nothing held yet, try again
                self._log.warning("leadership.claim_failed", error=f"{type(exc).__name__}: {exc}"[:200])
            await self.stop()
            await self._read_new()
            self.view = replace(self.view, seen_at=self.clock.time())

    async def _await_silence(self) -> None:
        poll_s = self.ttl_s / POLLS_PER_TTL
        while True:
            await self._read_new()
            if due_to_take_over(self.view, now=self.clock.time(), ttl_s=self.ttl_s,
                                stagger_s=stagger(self.holder, self.ttl_s)):
                return
            await self.clock.sleep(poll_s)

    async def _claim(self) -> int:
        publisher = self.bus.fenced_publisher(self.fencing_id)
        self._publisher = publisher
        await publisher.start()   # from here on the old holder cannot publish
        await self._read_new()   # a renewal committed just before the fencing: outbid its term
        term = self.view.term + 1
        await self._renew(term)
        self.term = term
        self._log.info("leadership.acquired", term=term, previous_holder=self.view.holder,
                       previous_term=self.view.term)
        return term

    async def _renew(self, term: int) -> None:
        renewal = LeaderRenewed(ts=self.clock.time(), source=self.source, role=self.role, holder=self.holder,
                                term=term, ttl_s=self.ttl_s)
        try:
            await self.publisher.publish_all([renewal])
        except Fenced as exc:
            raise LeadershipLost(f"{self.role}: term {term} of {self.holder} taken over by a newer replica") from exc

    async def hold(self) -> None:
        """Renew every ``ttl_s / 3`` until cancelled; raise :class:`LeadershipLost` when a
        newer replica fenced this one. A renewal that fails otherwise (the bus away) is
        logged and retried at the next period."""
        if self.term is None:
            raise RuntimeError("leadership not acquired")
        while True:
            await self.clock.sleep(self.ttl_s / RENEWALS_PER_TTL)
            try:
                await self._renew(self.term)
            except LeadershipLost:
                raise
            except Exception as exc:   # BusError and the like: a successor can only fence us
                self._log.warning("leadership.renew_failed", term=self.term, error=f"{type(exc).__name__}: {exc}"[:200])

    async def stop(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            with contextlib.suppress(Exception):
                await publisher.stop()
