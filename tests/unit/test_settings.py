"""shared.runtime.config.load_config: precedence, conversion by annotation, errors naming their source."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from shared.errors import ConfigError
from shared.runtime.config import FieldError, load_config

P = "HADAR_TEST_"


@dataclass(frozen=True, kw_only=True)
class Sample:
    name: str = "x"
    count: int = 1
    ratio: float = 0.5
    on: bool = False
    mode: Literal["steps", "uniform"] = "steps"
    temp_dir: str | None = None
    limit: int | None = None
    where: Path = Path(".")
    tags: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    node: str = field(default="n0", metadata={"env": "HADAR_NODE_ID"})

    def __post_init__(self) -> None:
        if self.count < 0:
            raise FieldError("count", f"must be >= 0, got {self.count}")


@dataclass(frozen=True, kw_only=True)
class Needs:
    node_id: str
    period_s: float = 1.0


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "svc.toml"
    path.write_text(text)
    return path


def test_defaults_when_no_source_gives_anything() -> None:
    assert load_config(Sample, env={}, env_prefix=P) == Sample()


def test_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    file = toml(tmp_path, 'name = "file"\ncount = 2\nratio = 0.25\n')
    env = {"HADAR_TEST_COUNT": "3", "HADAR_TEST_RATIO": "0.75"}
    config = load_config(Sample, flags={"ratio": 0.9, "on": None}, env=env, env_prefix=P, file=file)
    assert (config.name, config.count, config.ratio, config.on) == ("file", 3, 0.9, False)


def test_a_flag_of_none_is_not_given_and_an_empty_variable_is_unset() -> None:
    config = load_config(Sample, flags={"count": None}, env={"HADAR_TEST_COUNT": "4", "HADAR_TEST_NAME": ""},
                         env_prefix=P)
    assert (config.count, config.name) == (4, "x")


def test_env_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HADAR_TEST_COUNT", "7")
    assert load_config(Sample, env_prefix=P).count == 7


def test_a_field_may_name_its_own_variable() -> None:
    assert load_config(Sample, env={"HADAR_NODE_ID": "n9", "HADAR_TEST_NODE": "no"}, env_prefix=P).node == "n9"


def test_text_converts_by_annotation() -> None:
    env = {"HADAR_TEST_COUNT": " 12 ", "HADAR_TEST_RATIO": "1e-3", "HADAR_TEST_ON": "Yes",
           "HADAR_TEST_MODE": "uniform", "HADAR_TEST_TEMP_DIR": "/tmp/t", "HADAR_TEST_LIMIT": "5",
           "HADAR_TEST_WHERE": "/data", "HADAR_TEST_TAGS": "a, b,,c", "HADAR_TEST_OPTIONS": '{"k": [1, 2]}'}
    config = load_config(Sample, env=env, env_prefix=P)
    assert config == Sample(count=12, ratio=1e-3, on=True, mode="uniform", temp_dir="/tmp/t", limit=5,
                            where=Path("/data"), tags=("a", "b", "c"), options={"k": [1, 2]})
    for text, value in (("true", True), ("1", True), ("no", False), ("FALSE", False), ("0", False)):
        assert load_config(Sample, env={"HADAR_TEST_ON": text}, env_prefix=P).on is value


def test_typed_values_from_toml_and_flags(tmp_path: Path) -> None:
    file = toml(tmp_path, 'count = 3\nratio = 2\non = true\ntags = ["x", "y"]\n'
                          '[options]\nalpha = 0.5\nnested = { deep = "yes" }\n')
    config = load_config(Sample, env={}, env_prefix=P, file=file)
    assert (config.count, config.ratio, config.on, config.tags) == (3, 2.0, True, ("x", "y"))
    assert config.options == {"alpha": 0.5, "nested": {"deep": "yes"}}
    assert isinstance(config.ratio, float)
    flagged = load_config(Sample, flags={"count": "8", "options": '{"a": 1}', "tags": ["p"], "mode": "uniform"},
                          env={}, env_prefix=P)
    assert (flagged.count, flagged.options, flagged.tags, flagged.mode) == (8, {"a": 1}, ("p",), "uniform")


@pytest.mark.parametrize("variable, value, expected", [
    ("COUNT", "1.5", "HADAR_TEST_COUNT: expected an integer, got '1.5'"),
    ("RATIO", "fast", "HADAR_TEST_RATIO: expected a finite number, got 'fast'"),
    ("RATIO", "nan", "HADAR_TEST_RATIO: expected a finite number"),
    ("ON", "maybe", "HADAR_TEST_ON: expected true/false/1/0/yes/no, got 'maybe'"),
    ("MODE", "mean", "HADAR_TEST_MODE: expected one of 'steps', 'uniform', got 'mean'"),
    ("LIMIT", "none", "HADAR_TEST_LIMIT: expected an integer"),
    ("OPTIONS", "[1]", "HADAR_TEST_OPTIONS: expected a JSON object"),
    ("OPTIONS", "{bad", "HADAR_TEST_OPTIONS: not a JSON object"),
])
def test_an_unconvertible_variable_is_named(variable: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Sample, env={P + variable: value}, env_prefix=P)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_an_unconvertible_flag_is_named_as_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--temp-dir: expected a string, got 3$"):
        load_config(Sample, flags={"temp_dir": 3}, env={}, env_prefix=P)
    with pytest.raises(ConfigError, match=r"^--count: expected an integer, got True$"):
        load_config(Sample, flags={"count": True}, env={}, env_prefix=P)


def test_file_errors_name_the_file_and_key(tmp_path: Path) -> None:
    file = toml(tmp_path, 'count = "many"\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: count: expected an integer, got 'many'$"):
        load_config(Sample, env={}, env_prefix=P, file=file)
    file = toml(tmp_path, 'tags = ["a", 2]\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: tags\[1\]: expected a string, got 2$"):
        load_config(Sample, env={}, env_prefix=P, file=file)
    file = toml(tmp_path, 'cuont = 2\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: unknown key 'cuont' \(known: name, count, "):
        load_config(Sample, env={}, env_prefix=P, file=file)
    file = toml(tmp_path, 'count = \n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: not valid TOML: "):
        load_config(Sample, env={}, env_prefix=P, file=file)
    with pytest.raises(ConfigError, match=r"nope.toml: cannot be read: No such file or directory"):
        load_config(Sample, env={}, env_prefix=P, file=tmp_path / "nope.toml")


def test_every_given_value_is_converted_even_when_overridden() -> None:
    with pytest.raises(ConfigError, match=r"^HADAR_TEST_COUNT: "):
        load_config(Sample, flags={"count": 2}, env={"HADAR_TEST_COUNT": "two"}, env_prefix=P)


def test_validation_names_the_source_of_the_bad_value(tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], dict[str, str], Path | None, str]] = [
        ({"count": -1}, {}, None, "--count"),
        ({}, {"HADAR_TEST_COUNT": "-1"}, None, "HADAR_TEST_COUNT"),
        ({}, {}, toml(tmp_path, "count = -1\n"), f"{tmp_path / 'svc.toml'}: count"),
    ]
    for flags, env, file, source in cases:
        with pytest.raises(FieldError) as info:
            load_config(Sample, flags=flags, env=env, env_prefix=P, file=file)
        assert str(info.value) == f"{source}: must be >= 0, got -1"
        assert info.value.field == "count" and isinstance(info.value, ConfigError)
    with pytest.raises(FieldError, match=r"^count: must be >= 0"):   # built directly: named by field
        Sample(count=-1)


def test_a_required_field_no_source_gives_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^node_id: required: pass --node-id, set HADAR_TEST_NODE_ID "
                                          "or put node_id in the config file$"):
        load_config(Needs, env={}, env_prefix=P)
    assert load_config(Needs, env={"HADAR_TEST_NODE_ID": "a"}, env_prefix=P) == Needs(node_id="a")


def test_programming_errors_are_type_errors() -> None:
    with pytest.raises(TypeError, match="no field 'colour'"):
        load_config(Sample, flags={"colour": "red"}, env={}, env_prefix=P)
    with pytest.raises(TypeError, match="needs a dataclass"):
        load_config(dict, env={}, env_prefix=P)

    @dataclass(frozen=True)
    class Odd:
        pair: tuple[int, str] = (1, "a")

    with pytest.raises(TypeError, match="unsupported annotation"):
        load_config(Odd, flags={"pair": "1,a"}, env={}, env_prefix=P)


def test_result_is_the_frozen_dataclass() -> None:
    config = load_config(Sample, flags={"name": "y"}, env={}, env_prefix=P)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.name = "z"  # type: ignore[misc]
