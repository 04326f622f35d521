"""The agent's, tracker's and profiler's Configs validate themselves, whatever builds them.

Built directly (the embedded demo), or by ``hadar serve`` from flags, the environment or a
``--config`` file: an invalid value raises ConfigError naming the field or its source.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from services.agent.cli import agent_config
from services.agent.daemon.service import AgentConfig
from services.cli.main import build_parser
from services.profiler.cli import profiler_config
from services.profiler.service import ProfilerConfig
from services.tracker.cli import tracker_config
from services.tracker.service import TrackerConfig
from shared.bus import MemoryBus
from shared.errors import ConfigError, UsageError
from shared.runtime.config import flag_name, load_config

NODE = {"node_id": "n1"}

# (Config, env prefix, fields every instance needs, field, invalid value)
INVALID: list[tuple[type, str, dict[str, Any], str, Any]] = [
    (TrackerConfig, "HADAR_TRACKER_", {}, "finish_timeout_s", -1.0),
    (TrackerConfig, "HADAR_TRACKER_", {}, "tick_s", 0.0),
    (TrackerConfig, "HADAR_TRACKER_", {}, "chunk_bytes", 4),
    (TrackerConfig, "HADAR_TRACKER_", {}, "consolidation_threads", 0),
    (TrackerConfig, "HADAR_TRACKER_", {}, "consolidation_threads", 257),
    (TrackerConfig, "HADAR_TRACKER_", {}, "mode", "mean"),
    (TrackerConfig, "HADAR_TRACKER_", {}, "max_attempts", 0),
    (TrackerConfig, "HADAR_TRACKER_", {}, "keep_round_models", 0),
    (TrackerConfig, "HADAR_TRACKER_", {}, "straggler_sweep_s", -1.0),
    (TrackerConfig, "HADAR_TRACKER_", {}, "snapshot_every", -1),
    (TrackerConfig, "HADAR_TRACKER_", {}, "snapshots_kept", 0),
    (ProfilerConfig, "HADAR_PROFILER_", {}, "alpha", 0.0),
    (ProfilerConfig, "HADAR_PROFILER_", {}, "alpha", 1.5),
    (ProfilerConfig, "HADAR_PROFILER_", {}, "threshold", -0.1),
    (ProfilerConfig, "HADAR_PROFILER_", {}, "snapshot_interval_s", -1.0),
    (ProfilerConfig, "HADAR_PROFILER_", {}, "snapshots_kept", 0),
    (AgentConfig, "HADAR_AGENT_", {}, "node_id", "no/slash"),
    (AgentConfig, "HADAR_AGENT_", NODE, "heartbeat_s", 0.0),
    (AgentConfig, "HADAR_AGENT_", NODE, "progress_s", -1.0),
    (AgentConfig, "HADAR_AGENT_", NODE, "stop_timeout_s", 0.0),
    (AgentConfig, "HADAR_AGENT_", NODE, "deadline_grace_s", -1.0),
    (AgentConfig, "HADAR_AGENT_", NODE, "threads", 0),
    (AgentConfig, "HADAR_AGENT_", NODE, "spare_workers", -1),
    (AgentConfig, "HADAR_AGENT_", NODE, "cpu_devices", 0),
    (AgentConfig, "HADAR_AGENT_", NODE, "emulate", "v100:0"),
    (AgentConfig, "HADAR_AGENT_", NODE, "emulate", "gtx480:1"),
    (AgentConfig, "HADAR_AGENT_", NODE, "emulate_reference", "gtx480"),
]
IDS = [f"{cls.__name__}.{name}={value}" for cls, _, _, name, value in INVALID]


def _variable(prefix: str, name: str) -> str:
    return "HADAR_NODE_ID" if name == "node_id" else prefix + name.upper()   # the agent's id predates the prefix


@pytest.mark.parametrize("cls, prefix, needs, name, value", INVALID, ids=IDS)
def test_an_invalid_value_is_refused_whatever_its_source(cls: type, prefix: str, needs: dict[str, Any], name: str,
                                                          value: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^{name}: "):
        cls(**needs, **{name: value})
    with pytest.raises(ConfigError, match=f"^{flag_name(name)}: "):
        load_config(cls, flags={**needs, name: value}, env={}, env_prefix=prefix)
    variable = _variable(prefix, name)
    with pytest.raises(ConfigError, match=f"^{variable}: "):
        load_config(cls, flags=needs, env={variable: str(value)}, env_prefix=prefix)
    file = tmp_path / "service.toml"
    file.write_text(f"{name} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(file))}: {name}: "):
        load_config(cls, flags=needs, env={}, env_prefix=prefix, file=file)


def test_the_defaults_are_valid() -> None:
    assert TrackerConfig() and ProfilerConfig() and AgentConfig(node_id="n1").emulation == ()
    assert TrackerConfig().consolidation_threads == 1   # no measured gain from more here (config docstring)
    assert AgentConfig(node_id="n1", emulate="v100:2, k80:1").emulation == (("v100", 2), ("k80", 1))


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_serve_builds_each_config_from_flags_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "tracker.toml"
    file.write_text('group = "from-file"\ntick_s = 3.0\nfinish_timeout_s = 9.0\nmode = "uniform"\n')
    monkeypatch.setenv("HADAR_TRACKER_TICK_S", "2.0")
    config = tracker_config(_args("tracker", "--config", str(file), "--finish-timeout-s", "7"))
    assert (config.group, config.tick_s, config.finish_timeout_s, config.mode) == ("from-file", 2.0, 7.0, "uniform")
    assert tracker_config(_args("tracker")) == TrackerConfig(tick_s=2.0)
    assert tracker_config(_args("tracker", "--uniform")).mode == "uniform"
    lifecycle = tracker_config(_args("tracker", "--keep-round-models", "3", "--keep-checkpoints",
                                     "--keep-round-models-after-completion", "--straggler-sweep-s", "5"))
    assert (lifecycle.keep_round_models, lifecycle.delete_checkpoints, lifecycle.delete_completed_models,
            lifecycle.straggler_sweep_s) == (3, False, False, 5.0)
    monkeypatch.setenv("HADAR_TRACKER_DELETE_CHECKPOINTS", "false")
    assert tracker_config(_args("tracker")).delete_checkpoints is False
    assert tracker_config(_args("tracker", "--consolidation-threads", "3")).consolidation_threads == 3
    monkeypatch.setenv("HADAR_TRACKER_CONSOLIDATION_THREADS", "1")
    assert tracker_config(_args("tracker")).consolidation_threads == 1

    monkeypatch.setenv("HADAR_PROFILER_ALPHA", "0.5")
    assert profiler_config(_args("profiler", "--threshold", "0.1")) == ProfilerConfig(alpha=0.5, threshold=0.1)

    monkeypatch.setenv("HADAR_NODE_ID", "env-node")
    monkeypatch.setenv("HADAR_AGENT_THREADS", "2")
    agent = agent_config(_args("agent", "--emulate", "t4:2", "--emulate-reference", "v100"))
    assert (agent.node_id, agent.threads, agent.emulation, agent.emulate_reference) == (
        "env-node", 2, (("t4", 2),), "v100")
    assert agent_config(_args("agent", "--node-id", "flag-node")).node_id == "flag-node"


def test_serve_reports_a_bad_config_file_as_usage(tmp_path: Path) -> None:
    file = tmp_path / "profiler.toml"
    file.write_text("alpah = 0.5\n")
    with pytest.raises(UsageError, match="unknown key 'alpah'"):
        profiler_config(_args("profiler", "--config", str(file)))


def test_the_embedded_system_validates_its_services_configs(tmp_path: Path) -> None:
    from services.agent.protocol import StoreTarget
    from services.embedded import EmbeddedConfig, EmbeddedSystem
    from shared.store import LocalStore

    def build(**overrides: Any) -> EmbeddedSystem:
        config = EmbeddedConfig(nodes=(("n1", "v100"), ("n2", "k80")), **overrides)
        return EmbeddedSystem(config=config, bus=MemoryBus(source="t"), store=LocalStore(tmp_path),
                              store_target=StoreTarget.local(tmp_path))

    system = build()
    assert [a.devices.gpus[0].type for a in system.agents] == ["v100", "k80"]
    assert system.profiler.config == ProfilerConfig()
    with pytest.raises(ConfigError, match=r"^finish_timeout_s: must be >= 0"):
        build(copy_finish_timeout_s=-1.0)
    with pytest.raises(ConfigError, match=r"^progress_s: must be > 0"):
        build(progress_s=0.0)


def test_consumer_groups_are_named_hadar_service_node() -> None:
    """docs/events.md "Consumer groups": every default group is ``hadar-<service>[-<node>]``."""
    from services.scheduler.config import SchedulerConfig

    assert SchedulerConfig().group == "hadar-scheduler"
    assert TrackerConfig().group == "hadar-tracker"
    assert ProfilerConfig().group == "hadar-profiler"
    assert AgentConfig(node_id="node-a").group == "hadar-agent-node-a"
