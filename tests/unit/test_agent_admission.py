"""The agent's pure decisions (issue 12): which rounds it believes, which assignments it admits,
refuses or lets replace older copies, what it hands a worker, and how it delivers a result.

``Admission`` is driven here without a bus or processes; a Hypothesis state machine feeds it
valid and hostile events and plays the daemon's part (a copy's workers start only once the
copies it waits for have exited) to check that no GPU ever runs two copies."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.agent.daemon.admission import Admission, AdmissionLimits, CopyKey, Verdict
from services.agent.daemon.result_expiry import (
    Outcome,
    RetryPolicy,
    publish_until,
    result_abandoned,
)
from services.agent.daemon.validation import rendezvous_problem
from services.agent.protocol import StoreTarget, WorkerSpec
from shared.bus import BusError
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.wire.events import (
    Assignment,
    Event,
    Hyperparameters,
    InvalidEvent,
    JobCancelled,
    JobSpec,
    RoundStarted,
)

T0 = 1_700_000_000.0
NODE = "n1"
LIMITS = AdmissionLimits(max_round_leap=8, max_deadline_ahead_s=86_400.0)


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=8, workers=1,
                   iterations=100, hyper=Hyperparameters(optimizer="sgd", lr=0.1, seed=1))


def assignment(job_id: str, round_: int, *, gpus: tuple[int, ...] = (0,), copy: int = 0, node: str = NODE,
               deadline: float = T0 + 300, **fields: Any) -> Assignment:
    values: dict[str, Any] = {"world_size": len(gpus), "ranks": tuple(range(len(gpus))), **fields}
    return Assignment(ts=T0, source="scheduler", round=round_, job=spec(job_id), copy=copy, node_id=node,
                      gpus=gpus, gpu_type="cpu", step_budget=10, deadline=deadline, **values)


def started(round_: int) -> RoundStarted:
    return RoundStarted(ts=T0, source="scheduler", round=round_, policy="hadare", started_at=T0, ends_at=T0 + 300)


def admission(gpus: tuple[int, ...] = (0, 1), limits: AdmissionLimits = LIMITS) -> Admission:
    return Admission(node_id=NODE, gpus=gpus, limits=limits)


def admit(adm: Admission, a: Assignment, now: float = T0) -> Verdict:
    verdict = adm.assignment(a, now=now)
    assert verdict.action == "admit", verdict
    return verdict


# ---------------------------------------------------------------- rounds

def test_a_forged_far_round_is_not_believed_and_real_rounds_go_on() -> None:
    adm = admission()
    forged = started(2**62)
    refused = adm.round_started(forged)
    assert (refused.action, refused.code) == ("refuse", "round_far_ahead") and "ahead" in refused.detail
    assert adm.latest_round == -1
    admit(adm, assignment("real", 3))
    assert adm.latest_round == 3
    assert adm.round_started(forged).code == "round_far_ahead"   # a redelivery corroborates nothing
    assert adm.assignment(assignment("forged", 2**61, gpus=(1,)), now=T0).code == "round_far_ahead"
    assert adm.latest_round == 3 and set(adm.running) == {("real", 3, 0)}


def test_a_forged_stream_of_far_rounds_still_leaves_real_assignments_running() -> None:
    adm = admission()
    admit(adm, assignment("real", 3))
    assert adm.round_started(started(2**62)).code == "round_far_ahead"
    second = adm.round_started(started(2**62 + 1))              # two forged events agree: believed
    assert adm.latest_round == 2**62 + 1 and [p.key for p in second.preempt] == [("real", 3, 0)]
    adm.exited(("real", 3, 0))
    admit(adm, assignment("real", 4))          # live and far behind the belief: judged on its own
    admit(adm, assignment("other", 4, gpus=(1,)))
    assert adm.latest_round == 2**62 + 1
    late = adm.assignment(assignment("late", 2, gpus=(0,)), now=T0)
    assert (late.action, late.code) == ("skip", "stale") and "real/4/0" in late.detail


def test_rounds_within_the_leap_are_believed_and_a_far_one_needs_a_second_event() -> None:
    adm = admission()
    for round_ in (0, 8, 16):
        assert adm.round_started(started(round_)).action == "accept"
    assert adm.latest_round == 16
    assert adm.round_started(started(30)).code == "round_far_ahead"
    assert adm.latest_round == 16
    assert adm.round_started(started(33)).action == "accept"   # 30 and 33 agree: believed
    assert adm.latest_round == 33
    assert adm.round_started(started(20)).action == "accept" and adm.latest_round == 33


def test_a_far_assignment_is_admitted_once_another_event_corroborates_its_round() -> None:
    adm = admission()
    adm.round_started(started(2))
    assert adm.round_started(started(5000)).code == "round_far_ahead"
    verdict = admit(adm, assignment("j", 5000))
    assert adm.latest_round == 5000 and not verdict.preempt


def test_a_newer_round_preempts_older_copies_it_does_not_continue() -> None:
    adm = admission()
    admit(adm, assignment("a", 1, gpus=(0,)))
    admit(adm, assignment("b", 1, gpus=(1,)))
    verdict = admit(adm, assignment("a", 2, gpus=(1,)))     # a continues (on b's GPU); b does not
    assert {p.key for p in verdict.preempt} == {("b", 1, 0)}
    assert verdict.wait_for == (("b", 1, 0),)
    assert set(adm.running) == {("a", 1, 0), ("a", 2, 0)} and set(adm.draining) == {("b", 1, 0)}
    later = adm.round_started(started(3))
    assert {p.key for p in later.preempt} == {("a", 1, 0), ("a", 2, 0)}


# ---------------------------------------------------------------- GPUs

def test_one_copy_per_gpu_and_older_rounds_make_way() -> None:
    adm = admission()
    admit(adm, assignment("a", 0, gpus=(0,)))
    busy = adm.assignment(assignment("b", 0, gpus=(0,)), now=T0)
    assert (busy.action, busy.code) == ("refuse", "gpu_busy") and "GPU 0" in busy.detail and "a/0/0" in busy.detail
    admit(adm, assignment("b", 0, gpus=(1,)))
    assert adm.assignment(assignment("c", 0, gpus=(0, 1)), now=T0).code == "gpu_busy"
    newer = admit(adm, assignment("c", 1, gpus=(0,)))
    assert {p.key for p in newer.preempt} == {("a", 0, 0), ("b", 0, 0)}
    assert newer.wait_for == (("a", 0, 0),)     # b's GPU is not c's: c need not wait for it
    adm.exited(("a", 0, 0))
    assert set(adm.draining) == {("b", 0, 0)}
    assert admit(adm, assignment("d", 1, gpus=(1,))).wait_for == (("b", 0, 0),)


def test_the_flood_runs_one_copy_on_one_gpu() -> None:
    adm = admission(gpus=(0,))
    verdicts = [adm.assignment(assignment(f"f{i}", 0), now=T0) for i in range(300)]
    assert [v.action for v in verdicts].count("admit") == 1
    assert all(v.code == "gpu_busy" for v in verdicts[1:])
    assert len(adm.running) == 1


def cancel(job_id: str, reason: str = "", user: str = "") -> JobCancelled:
    return JobCancelled(ts=T0, source="cli", job_id=job_id, reason=reason, user=user)


def test_cancelling_a_job_preempts_its_copies_and_the_next_copy_waits_for_them() -> None:
    adm = admission()
    admit(adm, assignment("a", 0, gpus=(0, 1)))
    verdict = adm.cancelled(cancel("a", "by its owner", user="u"))
    assert [(p.key, p.reason) for p in verdict.preempt] == [(("a", 0, 0), "job cancelled: by its owner")]
    assert not adm.running and adm.draining == {("a", 0, 0): (0, 1)}
    assert admit(adm, assignment("b", 0, gpus=(1,))).wait_for == (("a", 0, 0),)


def test_a_cancellation_by_another_user_is_refused_and_the_copies_run_on() -> None:
    adm = admission()
    admit(adm, assignment("a", 0, gpus=(0, 1)))   # owned by user "u"
    verdict = adm.cancelled(cancel("a", user="mallory"))
    assert (verdict.action, verdict.code, verdict.preempt) == ("refuse", "not_owner", ())
    assert "'mallory' may not cancel job 'a' of user 'u'" in verdict.detail
    assert adm.running == {("a", 0, 0): (0, 1)}


def test_duplicates_and_stale_assignments_are_skipped_not_refused() -> None:
    adm = admission()
    admit(adm, assignment("a", 2))
    assert (adm.assignment(assignment("a", 2), now=T0).action, adm.assignment(assignment("a", 2), now=T0).code) == (
        "skip", "duplicate")
    assert adm.assignment(assignment("b", 1, gpus=(1,)), now=T0).code == "stale"             # older round
    assert adm.assignment(assignment("c", 2, gpus=(1,), deadline=T0 - 1), now=T0).code == "stale"  # deadline passed
    assert adm.assignment(assignment("c", 2, node="n2"), now=T0).action == "ignore"


# ---------------------------------------------------------------- what goes to a worker

@pytest.mark.parametrize(("code", "event"), [
    ("deadline", assignment("far", 0, deadline=1e12)),
    ("deadline", assignment("far", 0, deadline=T0 + 86_401)),
    ("gpus", assignment("ghost", 0, gpus=(2,))),
    ("gpus", assignment("twice", 0, gpus=(0, 0))),
    ("ranks", assignment("ranks", 0, gpus=(0, 1), ranks=(1, 1))),
    ("rendezvous", assignment("rdv", 0, world_size=2, rendezvous="tcp://evil:29500")),
    ("start_from", assignment("theft", 1, start_from=model_key("other", 0))),
    ("start_from", assignment("future", 1, start_from=model_key("future", 1))),
    ("start_from", assignment("ckpt", 1, start_from=checkpoint_key("ckpt", 1, 0, node=NODE))),
    ("start_from", assignment("ckpt", 1, start_from=checkpoint_key("other", 0, 0, node=NODE))),
    ("start_from", assignment("fin", 1, start_from=final_key("fin"))),
    ("start_from", assignment("dots", 1, start_from="models/dots/../other/0.safetensors")),
])
def test_implausible_assignments_are_refused_with_a_reason(code: str, event: Assignment) -> None:
    adm = admission()
    verdict = adm.assignment(event, now=T0)
    assert (verdict.action, verdict.code) == ("refuse", code), verdict
    assert verdict.detail and not adm.running


def test_plausible_assignments_are_admitted() -> None:
    adm = admission()
    admit(adm, assignment("a", 1, deadline=T0 + 86_400, start_from=model_key("a", 0)))
    admit(adm, assignment("b", 1, gpus=(1,), world_size=3, ranks=(2,), rendezvous="10.1.2.3:29501",
                          start_from=checkpoint_key("b", 0, 1, node="n0")))   # written by round 0's node


@pytest.mark.parametrize("good", ["10.0.0.1:29500", "node-b:1024", "n1.cluster.local:65535", "[::1]:29500",
                                  "gpu_box_7:30000", "[2001:db8::1]:31000", "localhost:29999"])
def test_good_rendezvous(good: str) -> None:
    assert rendezvous_problem(good) is None


@pytest.mark.parametrize("bad", ["", "tcp://h:29500", "h:29500/x", "h :29500", "u@h:29500", "h:80", "h:1023",
                                 "h:65536", "h", ":29500", "h:", "h:29500 ", " h:29500", "-h:29500", "h-:29500",
                                 "h:+29500", "h:029500", "h:2_9500", "999.1.1.1:29500", "1.2.3:29500",
                                 "[::1:29500", "[h]:29500", "::1:29500", "h..x:29500", "a" * 64 + ":29500",
                                 "h\n:29500", "h:29500\n", "h:２９５００", "ｈ:29500", "h?x:29500", "h#:29500"])
def test_bad_rendezvous(bad: str) -> None:
    assert rendezvous_problem(bad) is not None


def test_a_worker_spec_refuses_a_bad_rendezvous_too() -> None:
    fields: dict[str, Any] = {
        "job_id": "j", "round": 0, "copy": 0, "node_id": NODE, "gpu_type": "cpu", "model": "resnet",
        "dataset": "digits", "batch_size": 8, "optimizer": "sgd", "lr": 0.1, "seed": 1, "rank": 0, "world_size": 2,
        "device": "cpu", "step_budget": 5, "deadline": T0, "start_from": None, "checkpoint": "c",
        "store": StoreTarget.local("/nowhere")}
    assert WorkerSpec(rendezvous="127.0.0.1:29500", **fields).rendezvous == "127.0.0.1:29500"
    with pytest.raises(ValueError, match="rendezvous"):
        WorkerSpec(rendezvous="evil:29500/../x", **fields)


# ---------------------------------------------------------------- results

def _finished() -> Event:
    return started(0)   # any event: publish_until() does not look inside


async def test_delivery_retries_a_retriable_failure_until_it_goes_through() -> None:
    attempts: list[Event] = []
    slept: list[float] = []

    async def publish(event: Event) -> None:
        attempts.append(event)
        if len(attempts) < 8:
            raise BusError("broker away", retriable=True)

    async def send(event: Event) -> Any:
        return publish(event)   # fails once awaited, as a durable-ack awaitable does

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    outcome = await publish_until(send, _finished(), policy=RetryPolicy(first_s=0.5, max_s=5.0),
                                  give_up=lambda: False, sleep=sleep,
                                  on_retry=lambda error, attempt, wait_s: slept.append(wait_s))
    assert outcome is Outcome.PUBLISHED and len(attempts) == 8
    assert slept == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


async def test_delivery_gives_up_on_a_non_retriable_failure_or_an_abandoned_round() -> None:
    calls = 0

    async def refuse(event: Event) -> Any:
        nonlocal calls
        calls += 1
        raise BusError("record too large", retriable=False)

    async def away(event: Event) -> Any:
        raise BusError("broker away", retriable=True)   # not even accepted

    async def no_sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    policy = RetryPolicy(first_s=0.1, max_s=0.1)
    assert await publish_until(refuse, _finished(), policy=policy, give_up=lambda: False, sleep=no_sleep) \
        is Outcome.NOT_RETRIABLE
    assert calls == 1
    checks = iter([False, False, True])
    assert await publish_until(away, _finished(), policy=policy, give_up=lambda: next(checks), sleep=no_sleep) \
        is Outcome.ABANDONED


def test_a_result_is_abandoned_only_long_after_its_deadline_and_once_a_newer_round_exists() -> None:
    base = {"deadline": T0, "grace_s": 30.0, "ttl_s": 3600.0, "round_": 4}
    assert not result_abandoned(now=T0 + 4000, latest_round=4, **base)   # no newer round yet
    assert not result_abandoned(now=T0 + 3000, latest_round=5, **base)   # not long enough
    assert result_abandoned(now=T0 + 3631, latest_round=5, **base)


# ---------------------------------------------------------------- the state machine

GPUS = (0, 1)
FAR = 2**40
ROUNDS = st.one_of(st.integers(0, 14), st.sampled_from([FAR, 2**62, 2**62 + 1]))


class AgentMachine(RuleBasedStateMachine):
    """Admission under valid and hostile events, with the daemon's sequencing played by the model:
    an admitted copy's workers start once every copy in its ``wait_for`` has exited."""

    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.adm = Admission(node_id=NODE, gpus=GPUS, limits=AdmissionLimits(max_round_leap=4,
                                                                              max_deadline_ahead_s=3600.0))
        self.waiting: dict[CopyKey, tuple[tuple[int, ...], frozenset[CopyKey]]] = {}
        self.alive: dict[CopyKey, tuple[int, ...]] = {}
        self.far_events = 0

    def _apply(self, verdict: Verdict, key: CopyKey | None = None, gpus: tuple[int, ...] = ()) -> None:
        assert verdict.action in ("ignore", "accept", "skip", "refuse", "admit")
        assert (verdict.action in ("skip", "refuse")) == bool(verdict.code)
        running = set(self.waiting) | set(self.alive)
        assert all(p.key in running for p in verdict.preempt)
        if verdict.action == "admit":
            assert key is not None and key not in running
            self.waiting[key] = (gpus, frozenset(verdict.wait_for))
        else:
            assert not verdict.wait_for
        self._start_ready()

    def _start_ready(self) -> None:
        progress = True
        while progress:
            progress = False
            for key, (gpus, wait_for) in list(self.waiting.items()):
                if not wait_for & (set(self.alive) | set(self.waiting)):
                    del self.waiting[key]
                    self.alive[key] = gpus
                    progress = True

    @rule(job=st.sampled_from(["a", "b", "c"]), round_=ROUNDS, copy=st.integers(0, 1),
          gpus=st.lists(st.integers(0, 3), min_size=1, max_size=3), peers=st.integers(0, 2),
          deadline_in=st.sampled_from([-5.0, 30.0, 600.0, 1e12]), node=st.sampled_from([NODE, NODE, "n2"]),
          rendezvous=st.sampled_from([None, "node-b:29500", "tcp://x:29500", "x:80"]),
          start_from=st.sampled_from([None, "own", "other"]), ranks_shift=st.integers(0, 1))
    def assignment(self, job: str, round_: int, copy: int, gpus: list[int], peers: int, deadline_in: float,
                   node: str, rendezvous: str | None, start_from: str | None, ranks_shift: int) -> None:
        from_key = {None: None, "own": model_key(job, max(0, round_ - 1)), "other": model_key("zz", 0)}[start_from]
        try:
            a = Assignment(ts=self.now, source="x", round=round_, job=spec(job), copy=copy, node_id=node,
                           gpus=tuple(gpus), gpu_type="cpu", world_size=len(gpus) + peers,
                           ranks=tuple(min(i + ranks_shift, len(gpus) + peers - 1) for i in range(len(gpus))),
                           step_budget=5, deadline=self.now + deadline_in, start_from=from_key,
                           rendezvous=rendezvous)
        except InvalidEvent:
            assume(False)
            return
        if round_ >= FAR:
            self.far_events += 1
        self._apply(self.adm.assignment(a, now=self.now), (job, round_, copy), tuple(gpus))

    @rule(round_=ROUNDS)
    def round_started(self, round_: int) -> None:
        if round_ >= FAR:
            self.far_events += 1
        self._apply(self.adm.round_started(started(round_)))

    @rule(job=st.sampled_from(["a", "b", "c"]))
    def cancel(self, job: str) -> None:
        verdict = self.adm.cancelled(cancel(job))
        assert all(p.key[0] == job for p in verdict.preempt)
        self._apply(verdict)

    @precondition(lambda self: bool(self.alive))
    @rule(data=st.data())
    def exit(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.alive)))
        del self.alive[key]
        self.adm.exited(key)
        self._start_ready()

    @rule(seconds=st.floats(0, 400))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def no_gpu_runs_two_copies(self) -> None:
        used = [g for gpus in self.alive.values() for g in gpus]
        assert len(used) == len(set(used)) and set(used) <= set(GPUS)

    @invariant()
    def never_more_admitted_copies_than_gpus(self) -> None:
        held = [g for gpus in self.adm.running.values() for g in gpus]
        assert len(held) == len(set(held)) and set(held) <= set(GPUS)
        assert len(self.adm.running) <= len(GPUS)

    @invariant()
    def admission_knows_exactly_the_copies_the_daemon_has(self) -> None:
        assert set(self.adm.running) | set(self.adm.draining) == set(self.waiting) | set(self.alive)
        assert not set(self.adm.running) & set(self.adm.draining)

    @invariant()
    def one_far_event_never_moves_the_round(self) -> None:
        if self.far_events < 2:
            assert self.adm.latest_round < FAR


AgentMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.filter_too_much])
TestAgentMachine = AgentMachine.TestCase
