"""The retrying publish (shared/bus/retry.py): what it does while the bus holds a record.

Kafka's idempotent producer keeps an accepted record and retries it until the broker is
back, so the acknowledgement of a publish during an outage neither fails nor arrives. These
tests drive :func:`publish_until` through a MemoryBus whose acknowledgements the test holds
and releases (the real client's behaviour is exercised on a real broker in
tests/integration/test_long_outage.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from shared.bus import BusError, MemoryBus
from shared.bus.retry import Outcome, RetryPolicy, bus_send, publish_until
from shared.wire.events import Event, RoundStarted
from shared.wire.topics import PLACEMENTS


class HeldAcks(MemoryBus):
    """A MemoryBus that accepts every record but acknowledges it only when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Event] = []
        self.held: list[tuple[asyncio.Future[tuple[int, int]], Event]] = []

    async def publish(self, event: Event, *, topic: str | None = None, key: str | None = None) -> tuple[int, int]:
        # The test's own publishes (an Assignment to the agent) are written at once; only the
        # pipelined ones, the agent's results, are held.
        return await (await super().publish_pipelined(event, topic=topic, key=key))

    async def publish_pipelined(self, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        self.sent.append(event)
        ack: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self.held.append((ack, event))
        return ack

    async def release(self) -> None:
        """The broker is back: the client writes what it held."""
        for ack, event in self.held:
            if not ack.done():
                ack.set_result(await (await super().publish_pipelined(event)))
        self.held.clear()

    def fail_held(self, error: BaseException) -> None:
        for ack, *_ in self.held:
            if not ack.done():
                ack.set_exception(error)
        self.held.clear()


def event() -> Event:
    return RoundStarted(ts=1.0, source="scheduler", round=3, policy="hadare", started_at=1.0, ends_at=61.0)


@pytest.fixture
async def bus() -> HeldAcks:
    held = HeldAcks()
    await held.start()
    await held.ensure_topics()
    return held


async def logged(bus: MemoryBus) -> list[str]:
    return [d.event.id async for d in bus.read(PLACEMENTS)]


async def test_a_held_record_is_waited_for_not_sent_again_and_counts_once_acknowledged(bus: HeldAcks) -> None:
    checks = 0

    def give_up() -> bool:
        nonlocal checks
        checks += 1
        return False

    task = asyncio.create_task(publish_until(bus_send(bus), e := event(), give_up=give_up,
                                             policy=RetryPolicy(check_s=0.01)))
    while checks < 5:              # give_up is asked while the client holds the record
        await asyncio.sleep(0.01)
    assert not task.done() and len(bus.sent) == 1
    await bus.release()
    assert await task is Outcome.PUBLISHED
    assert await logged(bus) == [e.id]


async def test_give_up_is_honoured_while_the_record_is_held(bus: HeldAcks) -> None:
    given_up: list[Outcome] = []
    answers = iter([False, False, True])
    outcome = await publish_until(bus_send(bus), event(), give_up=lambda: next(answers),
                                  policy=RetryPolicy(check_s=0.01),
                                  on_give_up=lambda error, outcome: given_up.append(outcome))
    assert outcome is Outcome.ABANDONED and given_up == [Outcome.ABANDONED]
    bus.fail_held(BusError("broker away", retriable=True))   # the detached attempt ends quietly
    await asyncio.sleep(0)


async def test_a_held_record_that_fails_is_sent_again_with_the_same_id(bus: HeldAcks) -> None:
    waits: list[float] = []
    task = asyncio.create_task(publish_until(bus_send(bus), e := event(), give_up=lambda: False,
                                             policy=RetryPolicy(first_s=0.01, max_s=0.02, check_s=0.01),
                                             on_retry=lambda error, attempt, wait_s: waits.append(wait_s)))
    for _ in range(3):             # e.g. a batch whose partition had no leader past request_timeout_ms
        while not bus.held:
            await asyncio.sleep(0.005)
        bus.fail_held(BusError("publish: NotLeaderForPartitionError", retriable=True))
    while not bus.held:
        await asyncio.sleep(0.005)
    await bus.release()
    assert await task is Outcome.PUBLISHED
    assert waits == [0.01, 0.02, 0.02]
    assert [s.id for s in bus.sent] == [e.id] * 4 and await logged(bus) == [e.id]


async def test_a_refused_record_ends_at_once(bus: HeldAcks) -> None:
    task = asyncio.create_task(publish_until(bus_send(bus), event(), give_up=lambda: False,
                                             policy=RetryPolicy(check_s=0.01)))
    while not bus.held:
        await asyncio.sleep(0.005)
    bus.fail_held(BusError("publish: RecordTooLargeError", retriable=False))
    assert await task is Outcome.NOT_RETRIABLE and len(bus.sent) == 1


async def test_cancelling_stops_the_wait(bus: HeldAcks) -> None:
    task = asyncio.create_task(publish_until(bus_send(bus), event(), give_up=lambda: False,
                                             policy=RetryPolicy(check_s=0.01)))
    while not bus.held:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_policy_bounds() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(check_s=0)
    with pytest.raises(ValueError):
        RetryPolicy(first_s=2, max_s=1)
    assert [RetryPolicy(first_s=0.5, max_s=3).delay(i) for i in range(4)] == [0.5, 1.0, 2.0, 3.0]
