"""The CLI can be scripted (issue 17): one JSON document on stdout, diagnostics on stderr,
exit codes that mean something, no consumer groups left behind. Backed by a MemoryBus
standing in for the broker (``user_bus`` patched), so no Kafka is needed."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import pytest

import services.cli.jobs as jobs_cli
from services.cli.jobfile import new_job_id
from services.cli.main import build_parser, main
from shared.bus import MemoryBus
from shared.domain.layout import final_key
from shared.wire.events import (
    JobCancelled,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    Progress,
)
from shared.wire.topics import JOBS


def spec(job_id: str, *, user: str = "ada", iterations: int = 100) -> JobSpec:
    return JobSpec(job_id=job_id, user=user, model="resnet", dataset="digits", batch_size=32,
                   workers=1, iterations=iterations)


@pytest.fixture
def bus(monkeypatch: pytest.MonkeyPatch) -> MemoryBus:
    """One in-process 'broker' every command of the test talks to."""
    shared = MemoryBus()
    monkeypatch.setattr(jobs_cli, "user_bus", lambda args, source: shared)
    monkeypatch.setenv("HADAR_BOOTSTRAP", "memory:0")
    return shared


def publish(bus: MemoryBus, *events: object) -> None:
    async def run() -> None:
        await bus.start()
        await bus.ensure_topics()
        for e in events:
            await bus.publish(e)   # type: ignore[arg-type]
    asyncio.run(run())


def events_on(bus: MemoryBus, topic: str) -> list[object]:
    async def run() -> list[object]:
        await bus.start()
        return [d.event async for d in bus.read(topic)]
    return asyncio.run(run())


def submitted(job: JobSpec, at: float) -> JobSubmitted:
    return JobSubmitted(ts=at, source="test", job=job, submitted_at=at)


def completed(job_id: str, at: float, steps: int = 100) -> JobCompleted:
    return JobCompleted(ts=at, source="test", job_id=job_id, final_key=final_key(job_id), total_steps=steps,
                        jct_s=1.0, completed_at=at)


def cancelled(job_id: str, at: float) -> JobCancelled:
    return JobCancelled(ts=at, source="test", job_id=job_id, reason="test")


# ---------------------------------------------------------------- --json and stdout hygiene


def test_status_json_is_one_document_even_with_a_bad_record_in_the_log(bus, capsys):
    now = time.time()
    publish(bus, submitted(spec("good-1"), now))
    asyncio.run(bus.write_raw(JOBS, "junk", b"\x93not-an-event"))
    assert main(["status", "good-1", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["job"] == "good-1" and doc["state"] == "waiting" and doc["user"] == "ada"
    assert "bus.read.skip" in err and "bus.read.skip" not in out


def test_jobs_json_is_one_array_with_user_submitted_and_elapsed(bus, capsys):
    now = time.time()
    publish(bus, submitted(spec("j-a", user="ada"), now - 100), submitted(spec("j-b", user="bob"), now - 50),
            completed("j-b", now - 10))
    assert main(["jobs", "--all", "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    by_id = {d["job"]: d for d in docs}
    assert set(by_id) == {"j-a", "j-b"}
    assert by_id["j-b"]["state"] == "completed" and by_id["j-b"]["elapsed_s"] == pytest.approx(40, abs=0.5)
    assert by_id["j-a"]["user"] == "ada" and by_id["j-a"]["elapsed_s"] >= 99
    assert by_id["j-a"]["submitted_at"] == pytest.approx(now - 100)


def test_jobs_filters_by_state_user_and_since(bus, capsys):
    now = time.time()
    publish(bus, submitted(spec("f-old", user="ada"), now - 7200), submitted(spec("f-new", user="ada"), now - 60),
            submitted(spec("f-bob", user="bob"), now - 30), submitted(spec("f-done", user="ada"), now - 20),
            completed("f-done", now - 5))

    def ids(*argv: str) -> set[str]:
        assert main(["jobs", "--json", *argv]) == 0
        return {d["job"] for d in json.loads(capsys.readouterr().out)}

    assert ids("--user", "ada") == {"f-old", "f-new"}
    assert ids("--state", "completed") == {"f-done"}
    assert ids("--state", "waiting", "--user", "bob") == {"f-bob"}
    assert ids("--since", "1h") == {"f-new", "f-bob"}
    assert ids("--all", "--since", "1h", "--user", "ada") == {"f-new", "f-done"}


def test_jobs_table_has_user_submitted_and_elapsed_columns(bus, capsys):
    publish(bus, submitted(spec("t-1", user="grace"), time.time() - 65))
    assert main(["jobs"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["JOB", "USER"] and "SUBMITTED" in header and "ELAPSED" in header
    row = next(r for r in rows if r.startswith("t-1 "))
    assert "grace" in row and "1m0" in row


# ---------------------------------------------------------------- cancel


def test_cancel_of_a_completed_job_says_so_and_publishes_nothing(bus, capsys):
    now = time.time()
    publish(bus, submitted(spec("c-done"), now - 10), completed("c-done", now - 1))
    assert main(["cancel", "c-done"]) == 0
    assert "already completed" in capsys.readouterr().out
    assert [e for e in events_on(bus, JOBS) if isinstance(e, JobCancelled)] == []


def test_cancel_of_an_unknown_job_exits_2(bus, capsys):
    publish(bus)
    assert main(["cancel", "c-nope"]) == 2
    assert "c-nope" in capsys.readouterr().err


# ---------------------------------------------------------------- watch exit codes


def test_watch_of_a_job_completed_then_cancelled_says_completed_exit_0(bus, capsys):
    now = time.time()
    publish(bus, submitted(spec("w-done"), now - 10),
            Progress(ts=now - 5, source="test", job_id="w-done", round=0, copy=0, node_id="n1", gpu_type="v100",
                     workers=1, steps_round=100, steps_total=100, samples_per_s=1.0, loss=0.1),
            completed("w-done", now - 2), cancelled("w-done", now - 1))
    assert main(["watch", "w-done", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "completed" and doc["steps"] == 100


def test_watch_of_a_cancelled_job_exits_1(bus, capsys):
    now = time.time()
    publish(bus, submitted(spec("w-can"), now - 10), cancelled("w-can", now - 1))
    assert main(["watch", "w-can"]) == 1
    assert "cancelled" in capsys.readouterr().out


def test_watch_of_an_unknown_job_exits_2_after_wait(bus, capsys):
    publish(bus)
    started = time.monotonic()
    assert main(["watch", "w-nope", "--wait-s", "0.3", "--poll-s", "0.1"]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "w-nope" in err and len(err.strip().splitlines()) == 1


def test_read_commands_leave_no_consumer_group(bus, capsys):
    now = time.time()
    publish(bus, submitted(spec("g-1"), now - 10), completed("g-1", now - 1))
    assert main(["watch", "g-1"]) == 0
    assert main(["status", "g-1"]) == 0
    assert main(["jobs"]) == 0
    assert bus._groups == {}   # the broker's view: no group was ever joined


# ---------------------------------------------------------------- submit


def test_submitting_an_existing_id_is_refused_with_exit_2(bus, capsys):
    publish(bus, submitted(spec("s-taken"), time.time()))
    argv = ["submit", "--id", "s-taken", "--model", "resnet", "--dataset", "digits", "--workers", "1",
            "--iterations", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "s-taken" in err and "already exists" in err
    assert len([e for e in events_on(bus, JOBS) if isinstance(e, JobSubmitted)]) == 1


def test_a_generated_id_already_in_the_log_is_drawn_again(bus, capsys, monkeypatch):
    import services.cli.jobfile
    publish(bus, submitted(spec("resnet-000000000000"), time.time()))
    monkeypatch.setattr(services.cli.jobfile, "new_job_id", lambda model: "resnet-000000000000")
    monkeypatch.setattr(jobs_cli, "new_job_id", lambda model: "resnet-000000000001")
    assert main(["submit", "--model", "resnet", "--dataset", "digits", "--workers", "1", "--iterations", "5"]) == 0
    assert capsys.readouterr().out.strip() == "resnet-000000000001"
    assert sorted(e.job_id for e in events_on(bus, JOBS) if isinstance(e, JobSubmitted)) == [
        "resnet-000000000000", "resnet-000000000001"]


def test_generated_job_ids_are_unique():
    ids = [new_job_id("resnet") for _ in range(50_000)]
    assert len(set(ids)) == len(ids)


# ---------------------------------------------------------------- version, help, completion


def test_version_comes_from_package_metadata(capsys):
    from importlib.metadata import version
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"hadar {version('hadar')}"


USER_COMMANDS = ("submit", "jobs", "status", "watch", "cancel", "model", "logs", "completion")


def _subparsers(parser):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


@pytest.mark.parametrize("command", USER_COMMANDS)
def test_every_flag_of_the_user_commands_has_help(command):
    sub = _subparsers(build_parser())[command]
    missing = [a.dest for a in sub._actions if not a.help]
    assert missing == []


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_comes_from_the_parser(shell, capsys):
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    for word in ("submit", "watch", "--wait-s", "--json", "--iterations", "--state", "completion"):
        assert word in script
    exe = shutil.which(shell)
    if exe is not None:   # the script at least parses in that shell
        subprocess.run([exe, "-n"], input=script, text=True, check=True)


# ---------------------------------------------------------------- following live, group-less


async def test_watch_follows_a_live_job_to_completion_without_a_group(capsys):
    from services.cli.watch import watch_job
    live = MemoryBus()
    await live.start()
    await live.ensure_topics()
    now = time.time()
    await live.publish(submitted(spec("live-1"), now))

    async def finish_later() -> None:
        await asyncio.sleep(0.3)
        await live.publish(Progress(ts=time.time(), source="test", job_id="live-1", round=0, copy=0, node_id="n1",
                                 gpu_type="v100", workers=1, steps_round=40, steps_total=40, samples_per_s=1.0,
                                 loss=0.1))
        await asyncio.sleep(0.3)
        await live.publish(completed("live-1", time.time()))

    task = asyncio.create_task(finish_later())
    code = await asyncio.wait_for(watch_job(live, "live-1", wait_s=5, poll_s=0.05, as_json=True), 10)
    await task
    assert code == 0
    assert json.loads(capsys.readouterr().out)["state"] == "completed"
    assert live._groups == {}


async def test_a_follower_reads_records_stamped_a_little_in_the_past():
    from services.cli.follow import LogFollower
    from shared.clock import FakeClock
    clock = FakeClock(start=time.time())
    live = MemoryBus(clock=clock)   # record timestamps come from this clock
    await live.start()
    await live.ensure_topics()
    now = clock.time()
    await live.publish(submitted(spec("skew-1"), now))
    clock.advance(100)
    await live.publish(submitted(spec("skew-2"), now + 100))
    follower = LogFollower(live, slack_s=30, clock=clock)
    assert {"skew-1", "skew-2"} <= set((await follower.poll()).state.jobs)
    clock.advance(-10)   # the next producer's clock is 10 s behind the newest record seen
    await live.publish(cancelled("skew-1", clock.time()))
    view = await follower.poll()
    assert view.state.jobs["skew-1"].state == "cancelled"


async def test_a_record_stamped_in_the_future_does_not_stall_a_follow():
    from services.cli.follow import LogFollower
    from shared.clock import FakeClock
    producer = FakeClock(start=time.time() + 3600)   # an hour ahead
    live = MemoryBus(clock=producer)
    await live.start()
    await live.ensure_topics()
    await live.publish(submitted(spec("ahead-1"), producer.time()))
    follower = LogFollower(live)
    await follower.poll()
    producer.advance(-3600)   # a producer with the right time
    await live.publish(submitted(spec("ahead-2"), producer.time()))
    assert "ahead-2" in (await follower.poll()).state.jobs
