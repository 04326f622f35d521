"""Authorship on the bus (shared.security.authorship), on MemoryBus and on KafkaBus: a sealing
bus's records open on a verifying bus; forged ones are dead-lettered with the reason and
skipped by read(); a bus without a verifier reads sealed records as plain ones."""

from __future__ import annotations

import asyncio
import dataclasses

from shared.security.authorship import Sealer, Verifier
from shared.security.identities import Credential, Registry, derive_key
from shared.wire.events import DeadLetter, ThroughputEstimate, encode
from shared.wire.sealed import seal
from shared.wire.topics import DEADLETTER
from tests.contract.test_bus import WAIT_S, open_bus, progress, read_all, take, unique

MASTER = bytes(range(32))


def credential(node: str, epoch: int = 1, master: bytes = MASTER) -> Credential:
    identity = f"node/{node}"
    return Credential(identity=identity, epoch=epoch, key=derive_key(master, identity, epoch))


def on_node(node: str, step: int):
    return dataclasses.replace(progress("job-a", step), node_id=node)


async def letters_of(bus, topic: str, n: int) -> dict[int, DeadLetter]:
    async with asyncio.timeout(WAIT_S):
        while True:
            letters = [d.event for d in await read_all(bus, DEADLETTER)
                       if isinstance(d.event, DeadLetter) and d.event.topic == topic]
            if len(letters) >= n:
                return {dl.offset: dl for dl in letters}
            await asyncio.sleep(0.05)


async def test_only_records_sealed_by_the_claimed_node_are_delivered(bus_kind, clock) -> None:
    registry = Registry(epochs={"node/n1": 2, "node/n2": 1}, retired={"node/n3": 1})
    async with open_bus(bus_kind, clock) as bus:
        bus.sealer = Sealer(credential("n1", epoch=2))
        bus.verifier = Verifier(MASTER, lambda: registry)
        topic, group = unique("authorship"), unique("group")
        await bus.ensure_topics([topic])
        genuine_n1, genuine_n2 = on_node("n1", 7), on_node("n2", 3)
        inner = encode(genuine_n2)
        forged = [
            await bus.write_raw(topic, "job-a", inner),                                        # 0 unsealed
            await bus.write_raw(topic, "job-a", Sealer(credential("n1", epoch=2)).seal(inner)),  # 1 n1 as n2
            await bus.write_raw(topic, "job-a", Sealer(credential("n2", master=bytes(32))).seal(inner)),  # 2 key
            await bus.write_raw(topic, "job-a", Sealer(credential("n1", epoch=1)).seal(encode(on_node("n1", 4)))),
            await bus.write_raw(topic, "job-a", Sealer(credential("n3")).seal(encode(on_node("n3", 5)))),  # 4
            await bus.write_raw(topic, "job-a", seal(encode(on_node("n2", 6)), by="node/n2", epoch=1,
                                                     mac=Sealer(credential("n2")).seal(inner)[-32:])),  # 5 mac
        ]
        await bus.publish(genuine_n1, topic=topic, key="job-a")                                # 6 genuine
        await bus.write_raw(topic, "job-a", Sealer(credential("n2")).seal(inner))              # 7 genuine n2
        estimate = ThroughputEstimate(ts=1.0, source="profiler", job_id="job-a", basis="estimate", workers=1,
                                      rates={"t4": 1.0})
        await bus.write_raw(topic, "job-a", encode(estimate))                                  # 8 ACL's job
        async with bus.subscribe(topic, group) as sub:
            got = await take(sub, 3)
        assert [(d.offset, d.event) for d in got] == [(6, genuine_n1), (7, genuine_n2), (8, estimate)]
        assert [d.offset for d in await read_all(bus, topic)] == [6, 7, 8]

        letters = await letters_of(bus, topic, len(forged))
        assert sorted(letters) == [offset for _, offset in forged]
        reasons = [letters[o].reason for o in sorted(letters)]
        assert all(r.startswith("authorship: ") for r in reasons)
        assert "Progress for node/n2 is not sealed" in reasons[0]
        assert "Progress for node/n2 sealed by node/n1" in reasons[1]
        assert "bad seal" in reasons[2] and "bad seal" in reasons[5]
        assert "key epoch 1, the current one is 2" in reasons[3]
        assert "'node/n3' is not enrolled" in reasons[4]


async def test_a_bus_without_a_verifier_reads_sealed_records(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        bus.sealer = Sealer(credential("n1"))
        topic = unique("sealed-plain")
        await bus.ensure_topics([topic])
        event = on_node("n1", 2)
        where = await bus.publish(event, topic=topic, key="job-a")
        async with bus.subscribe(topic, unique("group")) as sub:
            (got,) = await take(sub, 1)
        assert (got.partition, got.offset, got.event) == (*where, event)
        assert [d.event for d in await read_all(bus, topic)] == [event]


async def test_a_revocation_takes_effect_on_the_next_record(bus_kind, clock) -> None:
    registry = {"now": Registry(epochs={"node/n1": 1})}
    async with open_bus(bus_kind, clock) as bus:
        bus.sealer = Sealer(credential("n1"))
        bus.verifier = Verifier(MASTER, lambda: registry["now"])
        topic, group = unique("revoked"), unique("group")
        await bus.ensure_topics([topic])
        await bus.publish(on_node("n1", 1), topic=topic, key="job-a")
        async with bus.subscribe(topic, group) as sub:
            (first,) = await take(sub, 1)
            registry["now"] = registry["now"].revoke("node/n1")
            await bus.publish(on_node("n1", 2), topic=topic, key="job-a")
            bus.sealer = None
            await bus.publish(ThroughputEstimate(ts=1.0, source="profiler", job_id="job-a", basis="estimate",
                                                 workers=1, rates={"t4": 1.0}), topic=topic, key="job-a")
            (after,) = await take(sub, 1)
        assert first.event.steps_round == 1 and isinstance(after.event, ThroughputEstimate)
        letters = await letters_of(bus, topic, 1)
        assert [(o, dl.reason) for o, dl in letters.items()] == [
            (1, "authorship: 'node/n1' is not enrolled (or was revoked)")]
