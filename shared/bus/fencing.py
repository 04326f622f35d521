"""Fenced publishers: all-or-nothing batches from one active writer of a role.

A :class:`FencedPublisher` is what a replicated role (the scheduler with a standby) publishes
through. Guarantees, on :class:`~shared.bus.MemoryBus` and :class:`~shared.bus.KafkaBus`
alike (``tests/contract/test_fencing.py``):

* **Fencing.** Starting a publisher with a ``fencing_id`` fences every publisher started
  earlier with the same id: from then on each of their :meth:`~FencedPublisher.publish_all`
  calls raises :class:`Fenced` and publishes nothing, and a batch one of them had open is
  discarded. So a replica that was frozen past its lease and resumes cannot publish after the
  replica that took over has started, whatever it believes.
* **Atomic batches.** The events of one :meth:`~FencedPublisher.publish_all` become visible
  to every consumer and every :meth:`~shared.bus.base.Bus.read` together, or not at all
  (Kafka: a transaction; consumers read committed records only). A batch becomes visible
  when the broker has written its commit markers, an instant after ``publish_all`` returns,
  so a read started at once may not see it yet; starting a newer publisher of the same id
  waits for them (so a successor that fences first reads every batch its predecessor
  committed).
* A failure that is not fencing raises a :class:`~shared.bus.base.BusError` (``retriable``
  when the broker may come back); the batch is then not visible, except when the failure
  came while committing (``BusError.maybe_visible``): the caller must treat such a batch as
  possibly published.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from shared.bus.base import BusError
from shared.wire.events import Event

__all__ = ["Fenced", "FencedPublisher", "BatchFailed"]


class Fenced(BusError):
    """A newer publisher with the same fencing id started: this one can never publish again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


class BatchFailed(BusError):
    """A batch was not published; ``maybe_visible``: the failure came while committing, so it
    may yet be (treat it as published)."""

    def __init__(self, message: str, *, retriable: bool, maybe_visible: bool) -> None:
        super().__init__(message, retriable=retriable)
        self.maybe_visible = maybe_visible


class FencedPublisher(abc.ABC):
    """Publishes batches of events, atomically, as the one writer of ``fencing_id``."""

    fencing_id: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Claim ``fencing_id``: fence every earlier publisher of it (their open batch is
        discarded). Idempotent for this publisher."""

    @abc.abstractmethod
    async def publish_all(self, events: Sequence[Event]) -> list[tuple[int, int]]:
        """Publish ``events`` (each to its own topic and key) as one atomic batch; returns
        each one's (partition, offset). Raises :class:`Fenced` if a newer publisher of the
        id started, :class:`BatchFailed` otherwise. Batches of one publisher never overlap."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the client (a batch still open is discarded). Idempotent."""
