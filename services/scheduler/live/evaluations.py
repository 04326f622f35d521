"""Evaluation copies: a user-code job's final model measured by its own script, on an agent.

The tracker evaluates zoo models itself, but it never runs user code (it holds write access
to every model), so a user-code job's held-out metric comes from its own script on an agent:
each round's copies report the metric of the model they started from, which covers every
round model but the last. The last -- the job's final model, a byte copy of it -- is
measured by one *evaluation copy* after the job completes: an Assignment with
``evaluation`` set, step budget 0 and ``start_from`` the final key. The agent runs the
script for that round as for any other (restore, no step, metrics); it uploads nothing and
reports ``CopyFinished(evaluation=True, start_metric=...)``, which ``hadar logs`` and
``hadar status`` show as the final model's metric.

Rules (pure: a function of the folded state and the round's plan, so replay re-derives them):

* only GPUs the plan leaves free: an evaluation never displaces training, and waits while
  the cluster is full;
* one GPU each, the first free one in node order then GPU position, oldest completion first;
* a job is tried again, at most ``MAX_EVALUATIONS`` times in all, when its try reported no
  metric (a failure, a script that reports none) or did not report within
  ``EVALUATION_REPORT_S`` of its deadline: :meth:`SchedulerState.awaiting_evaluation`, at the
  round's start time.

The scheduler plans rounds while any job awaits evaluation, so a cluster that went idle
when its last job completed still evaluates that job's final model.
"""

from __future__ import annotations

from services.scheduler.core.policy import Plan, PlanRequest
from services.scheduler.live.state import SchedulerState
from shared.domain.layout import final_key
from shared.wire.events import Assignment

__all__ = ["evaluation_assignments"]


def _free_gpus(request: PlanRequest, plan: Plan) -> list[tuple[str, int]]:
    """(node, GPU position) of every GPU of the round's cluster that no placement uses."""
    used = {(p.node_id, g) for p in plan.placements for g in p.gpus}
    return [(n.node_id, position) for n in request.cluster.nodes for position in range(len(n.gpus))
            if (n.node_id, position) not in used]


def evaluation_assignments(plan: Plan, request: PlanRequest, state: SchedulerState, *, round_: int,
                           ts: float, deadline: float, source: str) -> list[Assignment]:
    """The round's evaluation copies (module docstring), after the plan's own."""
    free = _free_gpus(request, plan)
    out: list[Assignment] = []
    for job, (node_id, position) in zip(state.awaiting_evaluation(ts), free, strict=False):
        registered = state.nodes[node_id].registered
        gpu = sorted(registered.gpus, key=lambda g: g.index)[position]
        out.append(Assignment(
            ts=ts, source=source, round=round_, job=job.spec, copy=0, node_id=node_id, gpus=(gpu.index,),
            gpu_type=gpu.type, world_size=1, ranks=(0,), step_budget=0, deadline=deadline,
            start_from=final_key(job.spec.job_id), evaluation=True))
    return out
