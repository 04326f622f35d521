"""The event bus: one port (:class:`Bus`), two implementations with the same contract.

``MemoryBus`` runs in one process (demo, unit tests); ``KafkaBus`` talks to Apache Kafka.
Guarantees are stated in :mod:`shared.bus.base`.
"""

from shared.bus.base import AckTracker, Bus, BusError, Delivery, Position, Subscription
from shared.bus.kafka import KafkaBus
from shared.bus.memory import MemoryBus

__all__ = ["AckTracker", "Bus", "BusError", "Delivery", "KafkaBus", "MemoryBus", "Position",
           "Subscription"]
