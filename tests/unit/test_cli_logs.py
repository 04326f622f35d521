"""``hadar logs`` and the loss/metric in ``hadar status`` (issue 17 item 2), and ``hadar model
--round`` (item 3): read from a MemoryBus standing in for the broker (``user_bus`` patched)
and a LocalStore (``user_store`` patched); no Kafka needed."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

import services.cli.jobs as jobs_cli
import services.cli.logs as logs_cli
from services.cli.main import main
from shared.bus import MemoryBus
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.store import LocalStore
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    JobCancelled,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    Progress,
    Rejection,
    RoundAbandoned,
    RoundStarted,
)

JOB = JobSpec(job_id="lg-1", user="ada", model="resnet", dataset="digits", batch_size=32, workers=2, iterations=500)


@pytest.fixture
def bus(monkeypatch: pytest.MonkeyPatch) -> MemoryBus:
    shared = MemoryBus()
    monkeypatch.setattr(jobs_cli, "user_bus", lambda args, source: shared)
    monkeypatch.setattr(logs_cli, "user_bus", lambda args, source: shared)
    return shared


def history(t: float, job: JobSpec = JOB) -> list[object]:
    """Round 0: copy 0 ok, copy 1 fails and its replica is left out; a model with a metric.
    Round 1: one copy, preempted, its replica unreadable: the round is abandoned."""
    j = job.job_id

    def progress(round_: int, copy: int, steps: int, loss: float, rate: float, at: float) -> Progress:
        return Progress(ts=at, source="agent/n0", job_id=j, round=round_, copy=copy, node_id=f"n{copy}",
                        gpu_type="V100", workers=1, steps_round=steps, steps_total=steps, samples_per_s=rate,
                        loss=loss)

    def assign(round_: int, copy: int, at: float) -> Assignment:
        return Assignment(ts=at, source="scheduler", round=round_, job=job, copy=copy, node_id=f"n{copy}",
                          gpus=(0,), gpu_type="V100", world_size=1, ranks=(0,), step_budget=400, deadline=at + 360)

    return [
        JobSubmitted(ts=t, source="cli", job=job, submitted_at=t),
        RoundStarted(ts=t + 1, source="scheduler", round=0, policy="hadare", started_at=t + 1, ends_at=t + 361,
                     assignments=2),
        assign(0, 0, t + 1), assign(0, 1, t + 1),
        progress(0, 0, 100, 1.25, 3200.0, t + 10), progress(0, 1, 90, 1.5, 2900.0, t + 11),
        progress(0, 0, 300, 0.75, 3300.0, t + 20),
        CopyFinished(ts=t + 30, source="agent/n0", job_id=j, round=0, copy=0, node_id="n0", status="ok",
                     steps_round=300, checkpoint=checkpoint_key(j, 0, 0, node="n0")),
        CopyFinished(ts=t + 31, source="agent/n1", job_id=j, round=0, copy=1, node_id="n1", status="failed",
                     steps_round=90, reason="RuntimeError: CUDA out of memory"),
        ModelConsolidated(ts=t + 40, source="tracker", job_id=j, round=0, key=model_key(j, 0), total_steps=150,
                          copies=(CopyWeight(copy=0, steps=300, weight=1.0),),
                          rejected=(Rejection(copy=1, reason="copy failed: RuntimeError: CUDA out of memory"),),
                          metric_name="accuracy", metric_value=0.875),
        RoundStarted(ts=t + 400, source="scheduler", round=1, policy="hadare", started_at=t + 400,
                     ends_at=t + 760, assignments=1),
        assign(1, 0, t + 400),
        progress(1, 0, 50, 0.5, 3100.0, t + 410),
        CopyFinished(ts=t + 420, source="agent/n0", job_id=j, round=1, copy=0, node_id="n0", status="preempted",
                     steps_round=60, checkpoint=checkpoint_key(j, 1, 0, node="n0"), reason="preempted by round 2"),
        RoundAbandoned(ts=t + 430, source="tracker", job_id=j, round=1, reason="no usable replica",
                       rejected=(Rejection(copy=0, reason="not valid safetensors: truncated"),)),
    ]


def publish(bus: MemoryBus, events: list[object]) -> None:
    async def run() -> None:
        await bus.start()
        await bus.ensure_topics()
        for e in events:
            await bus.publish(e)   # type: ignore[arg-type]
    asyncio.run(run())


def test_logs_show_loss_rate_metric_and_every_failure_in_event_time(bus, capsys):
    publish(bus, history(time.time() - 1000))
    assert main(["logs", "lg-1"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 12 and err == ""
    assert "round 0    copy 0   progress   step 300 (job step 300)  loss 0.7500  3300.0 samples/s" in lines[4]
    assert lines[6].endswith("finished   failed, 90 steps: RuntimeError: CUDA out of memory")
    assert "model      150 job steps, accuracy 0.8750, copies [0]; rejected copy 1: copy failed" in lines[7]
    assert "finished   preempted, 60 steps: preempted by round 2" in lines[10]
    assert "abandoned  no model: no usable replica; rejected copy 0: not valid safetensors: truncated" in lines[11]
    assert main(["logs", "lg-1", "--round", "1"]) == 0
    assert all("round 1 " in line for line in capsys.readouterr().out.splitlines())


def test_logs_json_is_one_document_per_round_and_copy(bus, capsys):
    publish(bus, history(time.time() - 1000))
    assert main(["logs", "lg-1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    r0, r1 = doc["rounds"]
    assert [c["status"] for c in r0["copies"]] == ["ok", "failed"]
    first, second = r0["copies"]
    assert (first["steps"], first["loss"], first["samples_per_s"], first["nodes"]) == (300, 0.75, 3300.0, ["n0"])
    assert second["reason"] == "RuntimeError: CUDA out of memory" and second["rejected"].startswith("copy failed")
    assert r0["model"] == {"key": model_key("lg-1", 0), "total_steps": 150,
                           "metric": {"name": "accuracy", "value": 0.875, "by": "tracker"}, "abandoned": None}
    assert r1["model"]["abandoned"] == "no usable replica" and r1["copies"][0]["status"] == "preempted"
    assert doc["latest"] == {"loss": {"round": 1, "value": 0.5},
                             "metric": {"round": 0, "name": "accuracy", "value": 0.875}}
    assert main(["logs", "lg-1", "--json", "--round", "0"]) == 0
    assert [r["round"] for r in json.loads(capsys.readouterr().out)["rounds"]] == [0]


def test_status_shows_the_latest_loss_and_metric(bus, capsys):
    publish(bus, history(time.time() - 1000))
    assert main(["status", "lg-1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["loss"] == {"round": 1, "value": 0.5}
    assert doc["metric"] == {"round": 0, "name": "accuracy", "value": 0.875}
    publish(bus, [JobSubmitted(ts=time.time(), source="cli", job=JobSpec(**{**JOB.__dict__, "job_id": "lg-new"}),
                               submitted_at=time.time())])
    assert main(["status", "lg-new", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["loss"] is None and doc["metric"] is None


def test_logs_of_an_unknown_job_exit_2_and_leave_no_group(bus, capsys):
    publish(bus, history(time.time() - 1000))
    assert main(["logs", "nope"]) == 2
    assert "no job 'nope'" in capsys.readouterr().err
    assert main(["logs", "lg-1", "--round", "-1"]) == 2
    assert bus._groups == {}


@pytest.mark.parametrize("ending, code", [("completed", 0), ("cancelled", 1)])
def test_follow_prints_events_as_they_come_until_the_job_ends(bus, capsys, ending, code):
    now = time.time()
    events = history(now - 1000)
    publish(bus, events[:5])

    async def run() -> int:
        async def later() -> None:
            for event in events[5:]:
                await asyncio.sleep(0.02)
                await bus.publish(event)   # type: ignore[arg-type]
            await asyncio.sleep(0.1)
            last = (JobCompleted(ts=time.time(), source="tracker", job_id="lg-1", final_key=final_key("lg-1"),
                                 total_steps=500, jct_s=1.0, completed_at=time.time()) if ending == "completed"
                    else JobCancelled(ts=time.time(), source="cli", job_id="lg-1", reason="test"))
            await bus.publish(last)
        task = asyncio.create_task(later())
        result = await asyncio.wait_for(logs_cli.show_logs(bus, "lg-1", round_=None, follow=True, as_json=True,
                                                           wait_s=5, poll_s=0.05), 20)
        await task
        return result

    assert asyncio.run(run()) == code
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["type"] for d in docs] == [type(e).__name__ for e in events[1:] if not isinstance(e, RoundStarted)]
    assert docs[-1]["event"]["reason"] == "no usable replica" and bus._groups == {}


def test_model_round_downloads_that_rounds_model(bus, capsys, monkeypatch, tmp_path: Path):
    store = LocalStore(tmp_path / "store")
    monkeypatch.setattr(jobs_cli, "user_store", lambda args: store)

    async def put() -> None:
        await store.start()
        await store.put(model_key("lg-1", 3), b"round three")
        await store.stop()
    asyncio.run(put())
    out = tmp_path / "m.safetensors"
    assert main(["model", "lg-1", "--round", "3", "--out", str(out)]) == 0
    assert out.read_bytes() == b"round three"
    assert main(["model", "lg-1", "--round", "4", "--out", str(out)]) == 2
    assert "no model of round 4" in capsys.readouterr().err


def test_a_copy_that_reports_no_loss_shows_a_dash_and_keeps_the_last_loss_it_reported(bus, capsys):
    # A user's script need not report a loss (Progress.loss None): its steps and rate still show.
    t = time.time() - 1000
    quiet = Progress(ts=t + 30, source="agent/n0", job_id="lg-1", round=0, copy=0, node_id="n0", gpu_type="V100",
                     workers=1, steps_round=320, steps_total=320, samples_per_s=3000.0, loss=None)
    events = history(t)
    publish(bus, events[:7] + [quiet] + events[7:])
    assert main(["logs", "lg-1"]) == 0
    assert any("progress   step 320 (job step 320)  loss -  3000.0 samples/s" in line
               for line in capsys.readouterr().out.splitlines())
    assert main(["logs", "lg-1", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["rounds"][0]["copies"][0]
    assert (first["steps"], first["loss"], first["samples_per_s"]) == (320, 0.75, 3000.0)
