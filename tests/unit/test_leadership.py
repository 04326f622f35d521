"""The leadership rule (pure) and :class:`~shared.runtime.leadership.Leadership` on MemoryBus."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.runtime.leadership import (
    Leadership,
    LeadershipLost,
    LeaseView,
    due_to_take_over,
    observe,
    stagger,
)
from shared.wire.events import LeaderRenewed
from shared.wire.topics import LEADERSHIP

TTL = 10.0


def renewal(term: int, holder: str = "a") -> LeaderRenewed:
    return LeaderRenewed(ts=1.0, source="s", role="scheduler", holder=holder, term=term, ttl_s=TTL)


def test_the_stagger_is_fixed_per_name_and_below_half_a_ttl() -> None:
    values = {stagger(f"replica-{i}", TTL) for i in range(50)}
    assert all(0 <= v < TTL / 2 for v in values) and len(values) > 40
    assert stagger("a", TTL) == stagger("a", TTL)
    view = LeaseView(seen_at=0.0)
    assert not due_to_take_over(view, now=TTL, ttl_s=TTL, stagger_s=1.0)
    assert due_to_take_over(view, now=TTL + 1.0, ttl_s=TTL, stagger_s=1.0)


def test_a_renewal_restarts_the_wait_and_an_older_term_does_not() -> None:
    view = observe(LeaseView(seen_at=0.0), renewal(2), now=5.0)
    assert (view.term, view.holder, view.seen_at) == (2, "a", 5.0)
    assert not due_to_take_over(view, now=14.9, ttl_s=TTL) and due_to_take_over(view, now=15.0, ttl_s=TTL)
    stale = observe(view, renewal(1, "zombie"), now=14.0)
    assert stale == view   # a frozen holder's late renewal of an older term keeps nobody waiting


@given(st.lists(st.tuples(st.integers(1, 50), st.floats(0, 100)), max_size=30))
def test_the_term_read_never_goes_down(renewals: list[tuple[int, float]]) -> None:
    view, highest = LeaseView(), 0
    for term, at in renewals:
        view = observe(view, renewal(term), now=at)
        highest = max(highest, term)
        assert view.term == highest


async def started_bus(clock: FakeClock) -> MemoryBus:
    bus = MemoryBus(clock=clock)
    await bus.start()
    return bus


async def terms(bus: MemoryBus) -> list[tuple[str, int]]:
    return [(d.event.holder, d.event.term) async for d in bus.read(LEADERSHIP)]


async def test_a_first_candidate_waits_one_ttl_then_takes_term_one() -> None:
    clock = FakeClock()
    bus = await started_bus(clock)
    a = Leadership(bus, role="scheduler", fencing_id="f", holder="a", ttl_s=TTL, clock=clock)
    t0 = clock.time()
    assert await a.acquire() == 1
    assert clock.time() - t0 >= TTL   # a live holder it had not heard of yet would have had a ttl to show
    assert await terms(bus) == [("a", 1)]


async def test_a_standby_does_not_take_over_while_the_holder_renews() -> None:
    clock = FakeClock()
    bus = await started_bus(clock)
    a = Leadership(bus, role="scheduler", fencing_id="f", holder="a", ttl_s=TTL, clock=clock)
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    b = Leadership(bus, role="scheduler", fencing_id="f", holder="b", ttl_s=TTL, clock=clock)
    waiting = asyncio.create_task(b.acquire())
    for _ in range(200):   # 200 fake polls, ~40 ttl: renewals keep coming
        await asyncio.sleep(0)
    assert not waiting.done() and not holding.done()
    holding.cancel()   # a crash: renewals stop
    assert await asyncio.wait_for(waiting, 5) == 2
    assert {h for h, t in await terms(bus) if t == 2} == {"b"}


async def test_the_holder_taken_over_is_fenced_and_loses_the_role() -> None:
    clock = FakeClock()
    bus = await started_bus(clock)
    a = Leadership(bus, role="scheduler", fencing_id="f", holder="a", ttl_s=TTL, clock=clock)
    await a.acquire()
    b = Leadership(bus, role="scheduler", fencing_id="f", holder="b", ttl_s=TTL, clock=clock)
    assert await b.acquire() == 2   # a froze: no renewal for a ttl
    with pytest.raises(LeadershipLost, match="taken over"):
        await a.hold()   # a resumes: its first renewal is refused
    assert await terms(bus) == [("a", 1), ("b", 2)]


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        Leadership(MemoryBus(), role="r", fencing_id="f", ttl_s=0)


class RivalStartsRightAfter(MemoryBus):
    """A MemoryBus where, the first time candidate ``loser`` starts its fenced publisher, a
    rival starts one of the same id and publishes its term before ``loser`` can renew: the
    race of two standbys that found the role free at the same moment."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.raced = False

    def fenced_publisher(self, fencing_id: str):   # type: ignore[no-untyped-def]
        publisher = super().fenced_publisher(fencing_id)
        if self.raced:
            return publisher
        self.raced = True
        bus, start = self, publisher.start

        async def start_then_lose() -> None:
            await start()
            rival = MemoryBus.fenced_publisher(bus, fencing_id)
            await rival.start()
            await rival.publish_all([renewal(1, "rival")])
        publisher.start = start_then_lose   # type: ignore[method-assign]
        return publisher


async def test_a_candidate_that_loses_the_race_to_claim_goes_back_to_standby() -> None:
    clock = FakeClock()
    bus = RivalStartsRightAfter(clock)
    await bus.start()
    a = Leadership(bus, role="scheduler", fencing_id="f", holder="a", ttl_s=TTL, clock=clock)
    t0 = clock.time()
    # the rival holds term 1 but never renews: a waits a full ttl more, then outbids its term
    assert await asyncio.wait_for(a.acquire(), 5) == 2
    assert clock.time() - t0 >= 2 * TTL
    assert await terms(bus) == [("rival", 1), ("a", 2)]
