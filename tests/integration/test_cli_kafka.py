"""The scriptable CLI against the real broker (shared: fresh ids, never assume empty topics)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from services.cli.main import main
from shared.bus import KafkaBus
from shared.domain.layout import final_key
from shared.wire.events import (
    Event,
    JobCancelled,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    Progress,
)

pytestmark = pytest.mark.kafka


async def _groups(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {g[0] for g in await admin.list_consumer_groups()}
    finally:
        await admin.close()


def _publish(bootstrap: str, *events: Event) -> None:
    async def run() -> None:
        bus = KafkaBus(bootstrap, source="test")
        await bus.start()
        try:
            await bus.ensure_topics()
            for e in events:
                await bus.publish(e)
        finally:
            await bus.stop()
    asyncio.run(run())


def test_scripted_session_on_kafka(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HADAR_BOOTSTRAP", kafka_bootstrap)
    before = asyncio.run(_groups(kafka_bootstrap))
    job = f"cli-{uuid.uuid4().hex[:10]}"
    spec = JobSpec(job_id=job, user="ada", model="resnet", dataset="digits", batch_size=32, workers=1,
                   iterations=10)
    now = time.time()
    # (No junk is published here: hadar.jobs is shared. The unit tests cover a bad record.)
    _publish(kafka_bootstrap, JobSubmitted(ts=now, source="test", job=spec, submitted_at=now))

    assert main(["status", job, "--json"]) == 0
    out, _err = capsys.readouterr()
    assert json.loads(out)["state"] == "waiting" and "bus.read.skip" not in out

    assert main(["submit", "--id", job, "--model", "resnet", "--dataset", "digits", "--workers", "1",
                 "--iterations", "5"]) == 2
    assert "already exists" in capsys.readouterr().err

    assert main(["watch", f"nope-{uuid.uuid4().hex[:8]}", "--wait-s", "1"]) == 2
    capsys.readouterr()

    _publish(kafka_bootstrap, JobCompleted(ts=now + 1, source="test", job_id=job, final_key=final_key(job),
                                           total_steps=10, jct_s=1.0, completed_at=now + 1))
    assert main(["cancel", job, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"job": job, "result": "already_completed"}
    _publish(kafka_bootstrap, JobCancelled(ts=now + 2, source="test", job_id=job))   # a cancel that raced
    assert main(["watch", job, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "completed"

    _publish(kafka_bootstrap, Progress(ts=now + 3, source="test", job_id=job, round=0, copy=0, node_id="n1",
                                       gpu_type="V100", workers=1, steps_round=10, steps_total=10,
                                       samples_per_s=320.0, loss=0.25))
    assert main(["logs", job, "--follow", "--json", "--poll-s", "0.1"]) == 0   # completed: exits at once
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["event"]["loss"] == 0.25
    assert main(["logs", job, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latest"]["loss"] == {"round": 0, "value": 0.25}

    assert main(["jobs", "--all", "--json", "--user", "ada", "--since", "10m"]) == 0
    assert job in {d["job"] for d in json.loads(capsys.readouterr().out)}

    new = asyncio.run(_groups(kafka_bootstrap)) - before
    assert not [g for g in new if g.startswith("hadar-watch-")]
