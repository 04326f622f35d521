"""Every Hadar service in one process: the embedded system ``hadar demo`` runs.

The services are the same classes ``hadar serve`` runs, wired to one bus and one store:
MemoryBus + LocalStore by default (runs anywhere), or KafkaBus + MinioStore when given.
Agents emulate GPUs of the named types on this machine's CPU. The agents, tracker and
profiler get the same self-validating Configs their ``hadar serve`` commands build, so a
bad value fails here as it does there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from services.agent.daemon.discovery import emulated_devices
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from services.profiler.service import ProfilerConfig, ProfilerService
from services.scheduler.config import SchedulerConfig
from services.scheduler.live.service import SchedulerService
from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import Bus
from shared.runtime.service import Service
from shared.store import ObjectStore
from shared.wire.topics import ALL_TOPICS


@dataclass(frozen=True, kw_only=True)
class EmbeddedConfig:
    nodes: tuple[tuple[str, str], ...]          # (node_id, emulated GPU type), one GPU each
    policy: str = "hadare"
    policy_options: dict[str, Any] = field(default_factory=dict)
    round_s: float = 15.0
    heartbeat_s: float = 1.0
    progress_s: float = 1.0
    consolidation_wait_s: float = 20.0
    copy_finish_timeout_s: float = 15.0
    seed: int = 0
    threads_per_worker: int = 1
    spare_workers: int = 1
    scheduler_group: str = "hadar-scheduler"


@dataclass
class EmbeddedSystem:
    """Owns the services; ``start`` brings them up in dependency order, ``stop`` drains them."""

    config: EmbeddedConfig
    bus: Bus
    store: ObjectStore
    store_target: StoreTarget
    scheduler: SchedulerService = field(init=False)
    tracker: TrackerService = field(init=False)
    profiler: ProfilerService = field(init=False)
    agents: list[AgentDaemon] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        # The tracker's config first: a bad copy_finish_timeout_s is named as the tracker's field.
        tracker_config = TrackerConfig(finish_timeout_s=c.copy_finish_timeout_s, tick_s=0.2)
        self.scheduler = SchedulerService(bus=self.bus, config=SchedulerConfig(
            policy=c.policy, policy_options=c.policy_options, round_s=c.round_s, heartbeat_s=c.heartbeat_s,
            late_copy_s=c.copy_finish_timeout_s, consolidation_wait_s=c.consolidation_wait_s, seed=c.seed,
            group=c.scheduler_group), store=self.store)
        self.tracker = TrackerService(bus=self.bus, store=self.store, config=tracker_config)
        self.profiler = ProfilerService(bus=self.bus, config=ProfilerConfig(), store=self.store)
        agents = [AgentConfig(node_id=node_id, heartbeat_s=c.heartbeat_s, progress_s=c.progress_s,
                              threads=c.threads_per_worker, spare_workers=c.spare_workers, stop_timeout_s=10.0,
                              emulate=f"{gpu_type}:1")
                  for node_id, gpu_type in c.nodes]
        self.agents = [AgentDaemon(a, bus=self.bus, store=self.store_target,
                                   devices=emulated_devices(a.emulation, a.emulate_reference))
                       for a in agents]

    @property
    def services(self) -> list[Service]:
        return [self.profiler, self.tracker, *self.agents, self.scheduler]

    async def start(self) -> None:
        await self.bus.ensure_topics(ALL_TOPICS)
        await self.store.start()
        for service in self.services:
            await service.start()

    async def stop(self, timeout_s: float = 30.0) -> None:
        for service in reversed(self.services):
            try:
                await asyncio.wait_for(service.stop(), timeout_s)
            except TimeoutError:
                pass
        await self.store.stop()
