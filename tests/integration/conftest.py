"""Fixtures several integration test modules share."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinfra import InfraError, InfraPaths, ensure_kafka, stop_server
from devinfra.kafka import EXTRA_PROPERTIES
from tests.required import unavailable

FAKE_WORKER = Path(__file__).with_name("fake_worker.py")


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    """An executable the agent daemon runs as its ``python``: it runs the fake worker
    (``fake_worker.py``), whatever the arguments."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_WORKER}\n")
    script.chmod(0o755)
    return str(script)


@pytest.fixture(scope="module")
def private_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Kafka broker for tests whose topics lose old segments to retention: its own
    run directory (a shared broker may hold topics created before the retention policy
    existed), checking retention every 500 ms (the broker's default is every 5 minutes)."""
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=Path(tmp_path_factory.mktemp("retention")) / "run")
    paths.run.mkdir(parents=True, exist_ok=True)
    (paths.run / EXTRA_PROPERTIES).write_text("# retention acts within a second\nlog.retention.check.interval.ms=500\n")
    try:
        server, _ = ensure_kafka(paths)
    except InfraError as exc:
        unavailable(f"kafka could not start: {exc}")
    try:
        yield server.bootstrap
    finally:
        stop_server(paths, "kafka")
