"""``hadar serve tracker --standby``: its settings, and the rule that a standby tracker's store
writes need a fresh confirmation of the role (:mod:`services.tracker.standby`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.tracker.cli import tracker_config
from services.tracker.config import TrackerConfig
from services.tracker.standby import CONFIRM_FRACTION, StandbyTracker
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.runtime.config import FieldError
from shared.runtime.leadership import LeadershipLost
from shared.store import LocalStore
from shared.wire.events import LeaderRenewed
from shared.wire.topics import LEADERSHIP

TTL = 10.0


def test_serve_tracker_takes_the_standby_flags() -> None:
    def config(*argv: str) -> TrackerConfig:
        return tracker_config(build_parser().parse_args(["serve", "tracker", *argv]))

    assert config() == TrackerConfig() and not TrackerConfig().standby and TrackerConfig().lease_ttl_s == 10.0
    standby = config("--standby", "--lease-ttl-s", "20")
    assert standby.standby and standby.lease_ttl_s == 20.0
    assert build_parser().parse_args(["serve", "tracker", "--holder", "t-1"]).holder == "t-1"
    # transactional ids under the group's name: the tracker principal's ACL prefix
    assert TrackerConfig().fencing_id == "hadar-tracker-models"
    for bad in (0.5, 3601.0, float("nan")):
        with pytest.raises(FieldError, match="lease_ttl_s"):
            TrackerConfig(lease_ttl_s=bad)


async def renewals(bus: MemoryBus) -> list[tuple[str, int]]:
    return [(d.event.holder, d.event.term) async for d in bus.read(LEADERSHIP) if isinstance(d.event, LeaderRenewed)]


async def test_a_store_write_needs_a_recent_confirmation_and_a_fenced_one_writes_nothing(tmp_path: Path) -> None:
    clock = FakeClock()
    bus = MemoryBus(clock=clock)
    await bus.start()
    store = LocalStore(tmp_path)
    await store.start()
    stepped: list[bool] = []
    tracker = StandbyTracker(bus=bus, store=store, clock=clock, holder="a",
                             on_stepped_down=lambda: stepped.append(True),
                             config=TrackerConfig(standby=True, lease_ttl_s=TTL))
    assert tracker.health()["role"] == "standby"
    with pytest.raises(LeadershipLost):   # not holding the role: nothing is written
        await tracker.store.put("models/j/0.safetensors", b"x")
    assert not await store.exists("models/j/0.safetensors")
    assert await tracker.leadership.acquire() == 1
    assert await renewals(bus) == [("a", 1)]

    await tracker.store.put("models/j/0.safetensors", b"0")   # confirmed first ...
    await tracker.store.delete("checkpoints/j/0/n0/0.safetensors")   # ... and that covers a write right after
    assert await renewals(bus) == [("a", 1)] * 2
    clock.advance(TTL / CONFIRM_FRACTION)   # a pause: it might have been one past the lease
    await tracker.store.put("models/j/1.safetensors", b"1")
    assert await renewals(bus) == [("a", 1)] * 3

    await bus.fenced_publisher(tracker.config.fencing_id).start()   # a successor took over meanwhile
    clock.advance(TTL)
    with pytest.raises(LeadershipLost):
        await tracker.store.put("models/j/2.safetensors", b"2")
    assert not await store.exists("models/j/2.safetensors")
    assert stepped == [True] and tracker.health()["role"] == "stepped_down" and not tracker.health()["ok"]
    with pytest.raises(LeadershipLost):   # and stays down: no confirmation is even tried
        await tracker.store.put("models/j/3.safetensors", b"3")
    assert await renewals(bus) == [("a", 1)] * 3
    await tracker.stop()
    await bus.stop()


class SlowStore(LocalStore):
    """A store whose writes take ``write_s`` of the clock (a long upload, or a freeze inside one)."""

    def __init__(self, root: Path, clock: FakeClock) -> None:
        super().__init__(root)
        self.clock, self.write_s = clock, 0.0
        self.during: Callable[[], Awaitable[None]] | None = None

    async def put(self, key: str, data: bytes, *, owner: str | None = None) -> None:
        await super().put(key, data, owner=owner)
        self.clock.advance(self.write_s)
        if self.during is not None:
            await self.during()


async def leading(tmp_path: Path) -> tuple[MemoryBus, SlowStore, StandbyTracker]:
    clock = FakeClock()
    bus = MemoryBus(clock=clock)
    await bus.start()
    store = SlowStore(tmp_path, clock)
    await store.start()
    tracker = StandbyTracker(bus=bus, store=store, clock=clock, holder="a",
                             config=TrackerConfig(standby=True, lease_ttl_s=TTL))
    await tracker.leadership.acquire()
    return bus, store, tracker


async def test_a_write_that_outlasted_its_confirmation_is_checked_after_and_a_lost_role_is_said(
        tmp_path: Path) -> None:
    bus, store, tracker = await leading(tmp_path)
    store.write_s = TTL / CONFIRM_FRACTION
    await tracker.store.put("models/j/0.safetensors", b"0")   # slow but still leading: confirmed again after
    assert await renewals(bus) == [("a", 1)] * 3 and tracker.stepped_down is None

    async def successor() -> None:
        await bus.fenced_publisher(tracker.config.fencing_id).start()
    store.during = successor   # frozen inside the write past the lease: a successor took over
    with pytest.raises(LeadershipLost):
        await tracker.store.put("models/j/1.safetensors", b"1")
    assert await store.exists("models/j/1.safetensors")   # the write itself could not be stopped ...
    assert "may have raced a newer replica" in (tracker.stepped_down or "")   # ... but it is said
    await tracker.stop()


async def test_a_publisher_refusing_for_good_gives_the_role_up(tmp_path: Path) -> None:
    _, store, tracker = await leading(tmp_path)
    await tracker.leadership.publisher.stop()   # dropped (Kafka: its abort failed): no batch of this term again
    with pytest.raises(LeadershipLost):
        await tracker.store.put("models/j/0.safetensors", b"0")
    assert not await store.exists("models/j/0.safetensors")
    assert "refused it for good" in (tracker.stepped_down or "")
    await tracker.stop()


async def test_once_stepped_down_nothing_is_written_even_right_after_a_confirmation(tmp_path: Path) -> None:
    _, store, tracker = await leading(tmp_path)
    await tracker.store.put("models/j/0.safetensors", b"0")   # confirmed just now
    tracker._step_down("taken over (its renewal was refused)")
    with pytest.raises(LeadershipLost):
        await tracker.store.delete("models/j/0.safetensors")
    assert await store.exists("models/j/0.safetensors")
    await tracker.stop()
