"""SchedulerConfig validates itself; PolicyChoice records and rebuilds a policy exactly."""

from __future__ import annotations

import msgpack
import pytest

from services.scheduler.config import DecisionSettings, SchedulerConfig
from services.scheduler.policies import PolicyChoice, UnknownPolicy, parse_policy_option
from shared.errors import ConfigError
from shared.wire.events import RoundStarted, decode, encode


@pytest.mark.parametrize("bad", [
    {"round_s": 0}, {"round_s": float("nan")}, {"heartbeat_s": -1}, {"consolidation_wait_s": float("inf")},
    {"seed": -1}, {"policy": "fifo"}, {"policy": "hadar", "policy_options": {"horizon": 0}},
    {"policy": "gavel", "policy_options": {"no_such_option": 1}}, {"group": ""},
    {"snapshot_every": -1}, {"snapshots_kept": 0},
])
def test_config_rejects_bad_values_naming_the_setting(bad):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**bad)
    assert str(err.value).split(":")[0] in {*bad, "policy", "group and source"}


def test_policy_choice_is_canonical_and_rebuilds_the_same_policy():
    a = PolicyChoice(name="tiresias", options={"promote_knob": 4.0, "thresholds_gpu_s": (100.0, 900.0)})
    b = PolicyChoice.recorded("tiresias", a.options_json)
    assert a.key == b.key and a.options_json == '{"promote_knob":4.0,"thresholds_gpu_s":[100.0,900.0]}'
    assert b.build().plan  # a policy instance
    assert PolicyChoice(name="hadar").describe() == "hadar"


@pytest.mark.parametrize("options", [{"x": object()}, {"x": float("nan")}])
def test_policy_choice_refuses_options_that_cannot_be_recorded(options):
    with pytest.raises(UnknownPolicy):
        PolicyChoice(name="hadar", options=options)


def test_command_line_options_parse_as_json_or_string():
    assert parse_policy_option("horizon=32") == ("horizon", 32)
    assert parse_policy_option("order=arrival") == ("order", "arrival")
    assert parse_policy_option("backfill=false") == ("backfill", False)
    with pytest.raises(UnknownPolicy):
        parse_policy_option("horizon")


def test_a_round_recorded_before_settings_were_recorded_still_decodes():
    new = RoundStarted(ts=5.0, source="s", round=3, policy="gavel", started_at=5.0, ends_at=20.0)
    wire = msgpack.unpackb(encode(new))
    for key in ("policy_options", "seed", "round_s", "heartbeat_s"):
        del wire["body"][key]
    old = decode(msgpack.packb(wire))
    settings = DecisionSettings.of_round(old)
    assert settings.choice.key == ("gavel", "{}") and settings.seed == 0 and settings.round_s == 15.0


def test_serve_scheduler_builds_its_config_from_flags_env_and_file(tmp_path, monkeypatch):
    from services.cli.main import build_parser
    from services.scheduler.cli import scheduler_config

    config_file = tmp_path / "scheduler.toml"
    config_file.write_text('policy = "hadar"\nround_s = 30\n[policy_options]\nhorizon = 16\n')
    monkeypatch.setenv("HADAR_SCHEDULER_SEED", "9")
    monkeypatch.setenv("HADAR_SCHEDULER_ROUND_S", "45")
    args = build_parser().parse_args(["serve", "scheduler", "--config", str(config_file),
                                      "--policy-option", "order=arrival"])
    config = scheduler_config(args)
    assert (config.policy, config.round_s, config.seed) == ("hadar", 45.0, 9)
    assert dict(config.policy_options) == {"order": "arrival"}   # flags replace the file's table whole


@pytest.mark.parametrize("argv, source", [
    (["--round-s", "0"], "--round-s"), (["--policy", "fifo"], "--policy"),
    (["--policy", "hadar", "--policy-option", "horizon=0"], "--policy-options"),
    (["--policy-option", "nonsense"], "--policy-option"),
])
def test_serve_scheduler_misuse_exits_2_naming_the_source(argv, source, capsys, monkeypatch):
    from services.cli.main import main

    monkeypatch.delenv("HADAR_BOOTSTRAP", raising=False)
    assert main(["serve", "scheduler", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and source in err, err
