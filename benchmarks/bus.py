"""Bus throughput and latency for N Progress events, on MemoryBus and on KafkaBus.

Kafka is used when ``--bootstrap`` or ``HADAR_BOOTSTRAP`` is given (otherwise its entry
is ``null``). A consumer in a fresh group acks every event; a warm-up event is consumed
first so the group join is not counted. The publisher uses the pipelined ``send`` with
at most ``--window`` sends awaiting durability. Publisher and consumer share one process
and one event loop, so both ends' CPU cost adds up on one core; ``--publisher-process``
runs the Kafka publisher in a process of its own, as Hadar's services are (it helps only
with a spare core for it). Events are built before each phase, outside its timing and
its CPU count: building is the publisher's cost, not the bus's; and frozen out of the
garbage collector's scans (:func:`events`).

Two phases per bus, N events each:

* saturation (publisher unpaced): ``events_per_s`` = N / (last receipt - first publish
  call). The queue between publisher and consumer grows when the publisher is faster,
  so latency here would only measure that queue; it is not reported.
* paced at ``--rate`` events/s (default 20000, the project's goal), ``--repeat`` times:
  ``p50_ms``/``p99_ms`` from each publish call to the handler receiving the event, and
  ``paced_events_per_s`` actually achieved. A bus that cannot sustain the rate shows it
  as growing latency. Each run is listed under ``runs``; the summary is their median.
  On a shared machine, one busy moment of another process decides a run's p99, so
  compare medians of several runs, and ``load_1m`` beside them.

``cpu_s`` is the consumer process's CPU time in the saturation phase (the publisher's
too when it shares the process) and ``cpu_us_per_event`` the same per event; on a busy
machine that is the steadier measure of cost. Prints one line per bus and phase, then,
as its last line, one JSON object {"events": N, "rate": R, "memory": {...}, "kafka": {...}}.
``--authorship``: the publishing bus seals every event as node ``n1`` and the consuming bus
verifies each (:mod:`shared.security.authorship`), as a node and a trusted service do.
Run: ``.venv/bin/python benchmarks/bus.py [--events 100000] [--repeat 5] [--bootstrap host:port]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bus import Bus, KafkaBus, MemoryBus
from shared.security.authorship import Sealer, Verifier
from shared.security.identities import Credential, Registry, derive_key
from shared.wire.events import Progress

B = TypeVar("B", bound=Bus)

KEYS = 64  # distinct job ids, spread over the topic's partitions
YIELD_EVERY = 100  # sends between yields to the loop (lets an in-process consumer run)


@dataclass(frozen=True, kw_only=True)
class Phase:
    events: int
    window: int
    rate: float  # 0: unpaced


def progress(seq: int) -> Progress:
    job = f"job-{seq % KEYS}"
    return Progress(ts=time.time(), source="bench", job_id=job, round=0, copy=0, node_id="n1",
                    gpu_type="v100", workers=1, steps_round=seq, steps_total=seq,
                    samples_per_s=100.0, loss=0.5)


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def events(phase: Phase) -> list[Progress]:
    """The phase's events, built up front and frozen out of the garbage collector's view:
    otherwise every full collection of the process (~20 ms of CPU for 100k events, over
    100 ms of wall time on a busy machine) would scan an input no real publisher holds.
    :func:`thaw` after the phase."""
    batch = [progress(seq) for seq in range(phase.events)]
    gc.freeze()
    return batch


def thaw() -> None:
    gc.unfreeze()


async def produce(bus: Bus, topic: str, phase: Phase, batch: list[Progress]) -> list[float]:
    """Publish ``batch`` (events 0..N-1); return the wall time (time.time) of each publish call."""
    sent_at = [0.0] * phase.events
    in_flight: deque[Awaitable[tuple[int, int]]] = deque()
    start = time.time()
    for seq, event in enumerate(batch):
        if seq % YIELD_EVERY == 0:
            ahead = start + seq / phase.rate - time.time() if phase.rate else 0.0
            await asyncio.sleep(max(0.0, ahead))
        sent_at[seq] = time.time()
        in_flight.append(await bus.publish_pipelined(event, topic=topic, key=event.job_id))
        while len(in_flight) > phase.window:
            await in_flight.popleft()
    for pending in in_flight:
        await pending
    return sent_at


def attested(bus: B, authorship: bool) -> B:
    """``bus`` sealing as node n1 and verifying (with ``authorship``), else as it is."""
    if authorship:
        master, identity = bytes(32), "node/n1"
        registry = Registry(epochs={identity: 1})
        bus.sealer = Sealer(Credential(identity=identity, epoch=1, key=derive_key(master, identity, 1)))
        bus.verifier = Verifier(master, lambda: registry)
    return bus


def kafka_bus(bootstrap: str, source: str, linger_ms: int | None, authorship: bool = False) -> KafkaBus:
    """A KafkaBus with its own default linger unless ``linger_ms`` is given."""
    return attested(KafkaBus(bootstrap, source=source, **({} if linger_ms is None else {"linger_ms": linger_ms})),
                    authorship)


def _child_produce(bootstrap: str, topic: str, phase: Phase, linger_ms: int | None, authorship: bool,
                   conn: object) -> None:
    async def run() -> list[float]:
        batch = events(phase)
        bus = kafka_bus(bootstrap, "bench-producer", linger_ms, authorship)
        await bus.start()
        try:
            return await produce(bus, topic, phase, batch)
        finally:
            thaw()
            await bus.stop()
    conn.send(asyncio.run(run()))  # type: ignore[attr-defined]
    conn.close()  # type: ignore[attr-defined]


async def measure(bus: Bus, phase: Phase, *, publisher: Callable[[str], Awaitable[list[float]]] | None
                  ) -> dict[str, float]:
    """Run one phase on a fresh topic; ``publisher(topic)`` publishes from elsewhere."""
    topic, group = f"bench.bus.{uuid.uuid4().hex[:12]}", f"bench-{uuid.uuid4().hex[:12]}"
    await bus.ensure_topics([topic])
    received_at = [0.0] * phase.events
    count = 0
    warm, finished = asyncio.Event(), asyncio.Event()

    async def consume() -> None:
        nonlocal count
        async with bus.subscribe(topic, group) as sub:
            async for delivery in sub:
                now = time.time()
                seq = delivery.event.steps_round  # type: ignore[attr-defined]
                await delivery.ack()
                if seq == phase.events:
                    warm.set()
                    continue
                received_at[seq] = now
                count += 1
                if count == phase.events:
                    finished.set()
                    return

    consumer = asyncio.create_task(consume())
    try:
        await bus.publish(progress(phase.events), topic=topic, key="warm-up")
        await asyncio.wait_for(warm.wait(), 120)
        batch = events(phase) if publisher is None else []
        cpu_start = time.process_time()
        if publisher is None:
            sent_at = await produce(bus, topic, phase, batch)
        else:
            sent_at = await publisher(topic)
        await asyncio.wait_for(finished.wait(), 600)
        cpu = time.process_time() - cpu_start
        await consumer
    finally:
        thaw()
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    latency = sorted(r - s for r, s in zip(received_at, sent_at))
    return {
        "events_per_s": round(phase.events / (max(received_at) - sent_at[0]), 1),
        "p50_ms": round(percentile(latency, 0.50) * 1000, 2),
        "p99_ms": round(percentile(latency, 0.99) * 1000, 2),
        "cpu_s": round(cpu, 3),
        "cpu_us_per_event": round(cpu / phase.events * 1e6, 1),
        "load_1m": round(os.getloadavg()[0], 2),
    }


async def bench(bus: Bus, name: str, events: int, window: int, rate: float, repeat: int,
                publisher: Callable[[str, Phase], Awaitable[list[float]]] | None) -> dict[str, object]:
    await bus.start()
    try:
        phases = [("saturation", Phase(events=events, window=window, rate=0.0))]
        phases += [("paced", Phase(events=events, window=window, rate=rate))] * repeat
        results: dict[str, list[dict[str, float]]] = {"saturation": [], "paced": []}
        for label, phase in phases:
            remote = None if publisher is None else (lambda t, p=phase: publisher(t, p))
            results[label].append(await measure(bus, phase, publisher=remote))
            print(name, label, json.dumps(results[label][-1]), flush=True)
    finally:
        await bus.stop()
    saturated, runs = results["saturation"][0], results["paced"]

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 2)
    return {"events_per_s": saturated["events_per_s"], "p50_ms": median("p50_ms"),
            "p99_ms": median("p99_ms"), "paced_events_per_s": median("events_per_s"),
            "cpu_s": saturated["cpu_s"], "cpu_us_per_event": saturated["cpu_us_per_event"],
            "runs": [{k: r[k] for k in ("p50_ms", "p99_ms", "events_per_s", "load_1m")} for r in runs]}


def process_publisher(bootstrap: str, linger_ms: int | None, authorship: bool
                      ) -> Callable[[str, Phase], Awaitable[list[float]]]:
    async def publish(topic: str, phase: Phase) -> list[float]:
        ctx = multiprocessing.get_context("spawn")
        receiver, sender = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child_produce, args=(bootstrap, topic, phase, linger_ms, authorship, sender))
        child.start()
        sender.close()
        sent_at = await asyncio.to_thread(receiver.recv)
        await asyncio.to_thread(child.join)
        return sent_at
    return publish


async def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--bootstrap", default=os.environ.get("HADAR_BOOTSTRAP", ""))
    parser.add_argument("--window", type=int, default=5000, help="sends awaiting durability")
    parser.add_argument("--rate", type=float, default=20_000.0, help="events/s in the paced phase")
    parser.add_argument("--linger-ms", type=int, default=None, help="producer linger (default: KafkaBus's)")
    parser.add_argument("--repeat", type=int, default=1, help="paced runs; the summary is their median")
    parser.add_argument("--publisher-process", action="store_true",
                        help="run the Kafka publisher in its own process")
    parser.add_argument("--no-memory", action="store_true", help="skip MemoryBus (its entry is null)")
    parser.add_argument("--authorship", action="store_true", help="seal every event and verify it on receipt")
    args = parser.parse_args(argv)
    if args.events < 1 or args.rate <= 0 or args.repeat < 1:
        parser.error("--events, --rate and --repeat must be > 0")
    result: dict[str, object] = {"events": args.events, "rate": args.rate, "cpus": os.cpu_count(),
                                 "publisher_process": args.publisher_process, "authorship": args.authorship,
                                 "memory": None, "kafka": None}
    if not args.no_memory:
        result["memory"] = await bench(attested(MemoryBus(), args.authorship), "memory", args.events, args.window,
                                       args.rate, args.repeat, None)
    if args.bootstrap:
        kafka = kafka_bus(args.bootstrap, "bench", args.linger_ms, args.authorship)
        publisher = (process_publisher(args.bootstrap, args.linger_ms, args.authorship) if args.publisher_process
                     else None)
        result["kafka"] = await bench(kafka, "kafka", args.events, args.window, args.rate, args.repeat, publisher)
    return result


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
