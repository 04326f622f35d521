"""The CLI's side of team queues: queue files, ``hadar queues [apply]``, the refusal at
``hadar submit`` and where a job stands in its queue (MemoryBus for the broker)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import services.cli.jobs as jobs_cli
import services.cli.queues as queues_cli
from services.cli.follow import ClusterView
from services.cli.jobview import job_doc, jobs_table, waiting_reason
from services.cli.main import main
from services.cli.queuefile import QueueFileError, load_queue_file, parse_queues
from services.cli.queues import check_fits
from services.cli.queueview import estimated_start, queues_doc, queues_table
from shared.bus import MemoryBus
from shared.errors import UsageError
from shared.wire.events import (
    Assignment,
    GpuInfo,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    QueueConfig,
    QueuesApplied,
    QueueSpec,
    QueueStanding,
    RoundStarted,
    ThroughputEstimate,
    topic_for,
)
from shared.wire.topics import QUEUES

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "queues" / "teams.yaml"
T0 = 1_000_000.0
CONFIG = QueueConfig(queues=(QueueSpec(name="vision", quota={"v100": 2}, borrowing_limit=2, user_max_gpus=3),
                             QueueSpec(name="audio")), default_queue="audio")


def spec(job_id: str, queue: str = "", workers: int = 1, cls: int = 0, iterations: int = 1000) -> JobSpec:
    return JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32, workers=workers,
                   iterations=iterations, queue=queue, priority_class=cls)


def test_the_example_queue_file_parses() -> None:
    config = load_queue_file(EXAMPLE)
    assert [q.name for q in config.queues] == ["vision", "language", "shared"] and config.default_queue == "shared"
    assert config.queue("vision") == QueueSpec(name="vision", weight=2.0, quota={"v100": 2, "t4": 1},
                                               borrowing_limit=4, user_max_gpus=4)


@pytest.mark.parametrize(("data", "message"), [
    ({"queues": {"a": {}}}, "default_queue: required"),
    ({"queues": {"a": {}}, "default_queue": "b"}, "default_queue: must name one of the queues"),
    ({"queues": {"a": {"quota": {"v100": 1.5}}}, "default_queue": "a"}, "queues.a.quota.v100: must be a whole"),
    ({"queues": {"a": {"wieght": 2}}, "default_queue": "a"}, "queues.a.wieght: unknown key"),
    ({"queues": {"a": {}}, "default_queue": "a", "fair_share_half_life": "soon"}, "fair_share_half_life: expected"),
    ({"queues": {}, "default_queue": "a"}, "queues: required"),
])
def test_a_bad_queue_file_names_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(QueueFileError, match=message):
        parse_queues(data, source="q.yaml")


def test_submission_refuses_a_job_its_queue_can_never_run() -> None:
    check_fits(spec("ok", "vision", workers=3), CONFIG)
    check_fits(spec("ok", workers=64), CONFIG)                       # audio: no quota, no limit
    for job, message in ((spec("x", "nope"), "queue: unknown 'nope'; queues: vision, audio"),
                         (spec("x", "vision", workers=5), "queue vision may hold at most 4 GPUs"),
                         (spec("x", "vision", workers=4), "lets one user ask 3 GPUs")):
        with pytest.raises(UsageError, match=message):
            check_fits(job, CONFIG)
    with pytest.raises(UsageError, match="no queues are applied"):
        check_fits(spec("x", "vision"), None)


@pytest.fixture
def bus(monkeypatch: pytest.MonkeyPatch) -> MemoryBus:
    shared = MemoryBus()
    for module in (jobs_cli, queues_cli):
        monkeypatch.setattr(module, "user_bus", lambda args, source: shared)
    monkeypatch.setenv("HADAR_BOOTSTRAP", "memory:0")
    return shared


def test_apply_then_list_and_refuse_at_submit(bus: MemoryBus, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["queues", "apply", str(EXAMPLE)]) == 0
    assert "applied 3 queues (vision, language, shared); default shared" in capsys.readouterr().out

    async def applied() -> list[object]:
        await bus.start()
        return [d.event async for d in bus.read(QUEUES)]
    (event,) = asyncio.run(applied())
    assert isinstance(event, QueuesApplied) and event.config == load_queue_file(EXAMPLE)
    assert main(["queues", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [q["name"] for q in doc["queues"]] == ["vision", "language", "shared"] and doc["default_queue"] == "shared"
    assert main(["submit", "--model", "resnet", "--dataset", "digits", "--workers", "8", "--iterations", "10",
                 "--queue", "vision"]) == 2
    assert "queue vision may hold at most 7 GPUs" in capsys.readouterr().err


def folded(*events: object) -> ClusterView:
    view = ClusterView()
    view.fold([(topic_for(e), e) for e in events])   # type: ignore[arg-type]
    return view


def _round(r: int, at: float, assignments: list[Assignment], standings: tuple[QueueStanding, ...]) -> list[object]:
    started = RoundStarted(ts=at, source="s", round=r, policy="yarn-cs", started_at=at, ends_at=at + 60,
                           assignments=len(assignments), queues=standings)
    return [started, *assignments]


def assignment(job: JobSpec, r: int, at: float, gpus: tuple[int, ...] = (0,)) -> Assignment:
    return Assignment(ts=at, source="s", round=r, job=job, copy=0, node_id="n1", gpus=gpus, gpu_type="v100",
                      world_size=len(gpus), ranks=tuple(range(len(gpus))), step_budget=10, deadline=at + 60)


def test_position_ahead_estimated_start_and_the_table() -> None:
    running, first, second = spec("run", "vision", workers=2), spec("w1", "vision", cls=1), spec("w2", "vision")
    events: list[object] = [
        QueuesApplied(ts=T0, source="cli/admin", config=CONFIG),
        NodeRegistered(ts=T0, source="agent", node_id="n1", gpus=(GpuInfo(index=0, type="v100"),
                                                                  GpuInfo(index=1, type="v100"))),
        *(JobSubmitted(ts=T0 + i, source="cli", job=j, submitted_at=T0 + i) for i, j in enumerate((running, first,
                                                                                                  second))),
        ThroughputEstimate(ts=T0, source="p", job_id="run", basis="measured", workers=2, rates={"v100": 2.0}),
    ]
    standing = QueueStanding(name="vision", entitled={"v100": 2}, used={"v100": 2}, running=1, pending=2)
    events += _round(0, T0 + 10, [assignment(running, 0, T0 + 10, gpus=(0, 1))],
                     (standing, QueueStanding(name="audio")))
    view = folded(*events)
    state = view.state
    now = T0 + 20
    # Queue order: class 1 first, then arrival: w1 (class 1), run, w2.
    doc = job_doc(state, "w2", now=now)["queue"]
    assert doc["name"] == "vision" and doc["position"] == 3 and doc["of"] == 3
    assert [(a["job"], a["state"]) for a in doc["ahead"]] == [("w1", "waiting"), ("run", "running")]
    # w2 needs its GPU and w1's: both come free when "run" ends, 1000 steps at 2/s from now.
    assert estimated_start(state, CONFIG, state.jobs["w2"], now) == pytest.approx(now + 500.0)
    assert estimated_start(state, CONFIG, state.jobs["run"], now) == now
    table = jobs_table(state, include_done=False, now=now)
    assert "QUEUE" in table and "vision" in table and "3/3" in table
    assert "vision" in queues_table(state) and queues_doc(state)["queues"][0]["entitled"] == {"v100": 2}


def test_a_job_submitted_between_rounds_waits_for_reclaim() -> None:
    borrower = spec("b", "audio")
    standings = (QueueStanding(name="vision", entitled={}, lent=2),
                 QueueStanding(name="audio", entitled={"v100": 2}, used={"v100": 1}, borrowed=2, running=1))
    events: list[object] = [QueuesApplied(ts=T0, source="cli/admin", config=CONFIG),
                            JobSubmitted(ts=T0, source="cli", job=borrower, submitted_at=T0)]
    events += _round(0, T0 + 10, [assignment(borrower, 0, T0 + 10)], standings)
    events += [JobSubmitted(ts=T0 + 30, source="cli", job=spec("owner", "vision"), submitted_at=T0 + 30),
               ThroughputEstimate(ts=T0 + 31, source="p", job_id="owner", basis="estimate", workers=1,
                                  rates={"v100": 1.0})]
    state = folded(*events).state
    reason = waiting_reason(state, state.jobs["owner"]) or ""
    assert reason.startswith("waiting for reclaim: audio borrow GPUs; vision's quota comes back at the next round")
