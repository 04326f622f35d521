"""The dev broker's config: operator overrides from kafka-extra.properties are added last and win."""

from __future__ import annotations

from pathlib import Path

import pytest

from devinfra import InfraError
from devinfra.kafka import EXTRA_PROPERTIES, extra_properties, kafka_properties


def _settings(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_extra_properties_are_added_and_win(tmp_path: Path) -> None:
    assert extra_properties(tmp_path) == {}
    (tmp_path / EXTRA_PROPERTIES).write_text(
        "# tuned for a retention test\n\nlog.retention.check.interval.ms = 500\nnum.partitions=3\n")
    extra = extra_properties(tmp_path)
    assert extra == {"log.retention.check.interval.ms": "500", "num.partitions": "3"}
    settings = _settings(kafka_properties(port=1, controller_port=2, data_dir=tmp_path, extra=extra))
    assert settings["log.retention.check.interval.ms"] == "500" and settings["num.partitions"] == "3"
    assert _settings(kafka_properties(port=1, controller_port=2, data_dir=tmp_path))["num.partitions"] == "1"


def test_a_malformed_line_is_refused_with_its_place(tmp_path: Path) -> None:
    (tmp_path / EXTRA_PROPERTIES).write_text("ok=1\nnot a setting\n")
    with pytest.raises(InfraError, match=r"kafka-extra.properties:2"):
        extra_properties(tmp_path)
