"""Model quality of a forked job (HadarE) vs. one copy, at the same total training steps.

Two jobs of the model zoo -- ``resnet`` on ``digits`` (classification, held-out accuracy)
and ``resnet`` on ``diabetes`` (regression, held-out MSE of the standardised target) --
each trained in up to three arms (``--arms``) with the same batch size, optimizer,
learning rate and job seed:

* single -- 1 copy, ``--steps / --rounds`` steps per round for ``--rounds`` rounds;
* forked -- ``--copies`` copies per round, each ``--steps / (copies * rounds)`` steps, so
  it trains the same samples as single (every copy is a whole W = 1 job), under the
  local-SGD recipe of ``shared.domain.local_sgd`` -- the same ``LocalSgd`` / ``install`` hook the
  agent's worker applies (``--scaling`` overrides its learning-rate scaling, to compare);
* single_wall -- 1 copy, ``--steps / copies`` steps: the wall-clock the forked arm takes
  (its copies run in parallel), so forked vs single_wall is the equal-wall-clock view.

Everything runs through the project's own code, in this process, on a LocalStore in a
temp directory: every copy of every round is one :class:`services.agent.worker.main.Worker`
run from a :class:`WorkerSpec` (the agent daemon's subprocess body, called directly to
spare a torch import per copy), starting from the previous round's consolidated model
(``start_from``), training its step budget and writing
``checkpoints/{job}/{round}/{node}/{copy}.safetensors`` (node :data:`NODE`). After each
round the copies are averaged as the tracker does it (:func:`weigh_replicas` with
``steps`` weights, streamed from the store by :class:`StoreRangeReader`,
:func:`write_model_files`), to
``models/{job}/{round}.safetensors`` (weights only) with the tracker's metadata
(:mod:`shared.domain.model_meta`; ``total_steps`` is the previous total plus the copies' steps)
and the averaged optimizer state beside it (``models/{job}/{round}.optim.safetensors``),
which the next round's workers merge back. The final round's model is
scored with :func:`shared.zoo.evaluate` on the dataset's held-out split.

Data order: the worker's batch of a step depends on (job seed, copy, rank, total step),
so the forked copies walk different permutations of the training set. The optimizer
state travels beside each round model and one replica consolidates to itself exactly, so the
single arm is the same as one uninterrupted run of ``--steps`` steps.

Repeated for job seeds 0..``--seeds``-1 (model initialisation and data order); mean and
sample standard deviation per arm are printed. Usage::

    python benchmarks/model_quality.py [--steps 1200] [--rounds 6] [--copies 4] [--seeds 3]
        [--arms single,forked,single_wall] [--scaling none|sqrt|linear]

Last output line: one JSON object ``{"classification": {"single_acc": a, "forked_acc": b,
...}, "regression": {"single_mse": c, "forked_mse": d, ...}, ...}`` (means over seeds;
``*_std`` keys and the run's settings ride along).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from services.agent.protocol import StoreTarget, WorkerSpec, parse_worker_line
from services.agent.worker.checkpoint import read_checkpoint, restore
from services.agent.worker.main import Worker
from services.tracker.averaging.consolidate import (
    DEFAULT_CHUNK_BYTES,
    Replica,
    weigh_replicas,
)
from services.tracker.model_files import ModelFiles, write_model_files
from services.tracker.store_reader import StoreRangeReader
from shared.domain.layout import checkpoint_key, model_key, optim_key
from shared.domain.local_sgd import DEFAULT_SCALING, SCALINGS, LocalSgd
from shared.store import LocalStore
from shared.zoo import build_model, evaluate, load_dataset

DEADLINE_S = 24 * 3600.0   # rounds end by step budget, never by the clock
NODE = "bench"   # the one node every copy runs on: it writes every checkpoint, under its own node segment
ARMS = ("single", "forked", "single_wall")


@dataclass(frozen=True, kw_only=True)
class Task:
    key: str        # "classification" / "regression": the JSON section
    metric: str     # "acc" / "mse": the JSON key suffix
    model: str
    dataset: str


TASKS = (
    Task(key="classification", metric="acc", model="resnet", dataset="digits"),
    Task(key="regression", metric="mse", model="resnet", dataset="diabetes"),
)


@dataclass(frozen=True, kw_only=True)
class Training:
    """What both arms share: hyperparameters and the step accounting."""

    batch_size: int
    optimizer: str
    lr: float
    steps: int        # total steps of every arm
    rounds: int
    threads: int
    scaling: str = DEFAULT_SCALING   # the recipe's (shared.domain.local_sgd); other values for experiments


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One way to train the job: ``copies`` copies per round, ``share`` of ``--steps`` job steps
    in all (every copy is one whole W = 1 job, so job steps = samples / batch), with or
    without the local-SGD recipe (``shared.domain.local_sgd``)."""

    name: str
    copies: int
    share: float = 1.0      # fraction of --steps this arm trains
    recipe: bool = False

    def job_steps(self, training: Training) -> int:
        return round(training.steps * self.share)

    def steps_per_copy_round(self, training: Training) -> int:
        return self.job_steps(training) // (self.copies * training.rounds)

    def local_sgd(self, training: Training) -> LocalSgd:
        if not self.recipe:
            return LocalSgd()
        return LocalSgd(fork_workers=self.copies, job_workers=1, job_steps=self.job_steps(training),
                        scaling=training.scaling)


def run_copy(spec: WorkerSpec) -> int:
    """Train one copy for one round through the worker; return the steps it did."""
    out = io.StringIO()
    Worker(spec, out).run()
    lines = [parse_worker_line(line) for line in out.getvalue().splitlines()]
    final = next((m for m in reversed(lines) if m and m["event"] in ("finished", "failed")), None)
    if final is None or final["event"] != "finished" or final["status"] != "ok":
        raise RuntimeError(f"copy {spec.job_id}/{spec.round}/{spec.copy} did not finish: {final}")
    return int(final["steps_round"])


async def consolidate_round(store: LocalStore, job_id: str, round_: int, steps: list[int],
                            prior_steps: int, scratch: Path) -> int:
    """Average the round's checkpoints as the tracker does; return the model's total steps."""
    loop = asyncio.get_running_loop()
    replicas = []
    for copy, copy_steps in enumerate(steps):
        key = checkpoint_key(job_id, round_, copy, node=NODE)
        size = await store.size(key)
        replicas.append(Replica(copy=copy, steps=copy_steps, reader=StoreRangeReader(store, key, size, loop)))
    out_dir = scratch / f"{job_id}-{round_}"
    out_dir.mkdir()

    def plan_and_write() -> ModelFiles:   # off the loop: the readers wait on it
        # Every copy here is a whole W = 1 job: worker-steps are job steps.
        weighing = weigh_replicas(replicas, mode="steps", prior_worker_steps=prior_steps)
        if weighing.rejected:
            raise RuntimeError(f"consolidation of {job_id}/{round_} rejected {weighing.rejected}")
        return write_model_files(weighing, out_dir, job_id=job_id, round_=round_, missing=(), spec=None,
                                   chunk_bytes=DEFAULT_CHUNK_BYTES)

    outputs = await asyncio.to_thread(plan_and_write)
    if outputs.optim_path is not None:   # the tracker's order: optimizer state first, then the model
        await store.put_file(optim_key(job_id, round_), outputs.optim_path)
    await store.put_file(model_key(job_id, round_), outputs.model_path)
    shutil.rmtree(out_dir)
    return outputs.meta.total_steps


def train_job(root: Path, task: Task, arm: Arm, seed: int, training: Training, scratch: Path) -> str:
    """Train ``arm`` of ``task`` round by round; return the final model's store key."""
    job_id = f"{task.key}-{arm.name}-s{seed}"
    store = LocalStore(root)
    budget = arm.steps_per_copy_round(training)
    total = 0
    for round_ in range(training.rounds):
        start_from = model_key(job_id, round_ - 1) if round_ else None
        steps = []
        for copy in range(arm.copies):
            spec = WorkerSpec(
                job_id=job_id, round=round_, copy=copy, node_id=NODE, gpu_type="cpu", model=task.model,
                dataset=task.dataset, batch_size=training.batch_size, optimizer=training.optimizer,
                lr=training.lr, seed=seed, rank=0, world_size=1, rendezvous=None, device="cpu",
                step_budget=budget, deadline=time.time() + DEADLINE_S, start_from=start_from,
                checkpoint=checkpoint_key(job_id, round_, copy, node=NODE), store=StoreTarget.local(root),
                threads=training.threads, local_sgd=arm.local_sgd(training))
            steps.append(run_copy(spec))
        total = asyncio.run(consolidate_round(store, job_id, round_, steps, total, scratch))
    if total != budget * arm.copies * training.rounds:   # equal to arm.job_steps(training) by the checks in main
        raise RuntimeError(f"{job_id}: consolidated {total} steps, expected {budget * arm.copies * training.rounds}")
    return model_key(job_id, training.rounds - 1)


def score(root: Path, key: str, task: Task, seed: int, scratch: Path) -> float:
    """Held-out metric of the stored model (weights only; its optimizer state is ignored)."""
    data = load_dataset(task.dataset)
    model = build_model(task.model, data.info, seed=seed)
    path = scratch / "final.safetensors"
    asyncio.run(LocalStore(root).get_file(key, path))
    tensors, _ = read_checkpoint(path)
    path.unlink()
    restore(model, None, tensors)
    return evaluate(model, data, torch.device("cpu")).value


def summary(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def arms_for(copies: int, names: tuple[str, ...]) -> tuple[Arm, ...]:
    every = {
        "single": Arm(name="single", copies=1),
        "forked": Arm(name="forked", copies=copies, recipe=True),
        "single_wall": Arm(name="single_wall", copies=1, share=1.0 / copies),
    }
    return tuple(every[n] for n in names)


def run(training: Training, copies: int, seeds: int, names: tuple[str, ...] = ARMS) -> dict[str, object]:
    arms = arms_for(copies, names)
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="hadar-quality-") as tmp:
        root, scratch = Path(tmp) / "store", Path(tmp) / "scratch"
        scratch.mkdir()
        for task in TASKS:
            section: dict[str, float] = {}
            for arm in arms:
                values = []
                for seed in range(seeds):
                    started = time.perf_counter()
                    key = train_job(root, task, arm, seed, training, scratch)
                    values.append(score(root, key, task, seed, scratch))
                    print(f"{task.key:14s} {arm.name:6s} seed {seed}: {task.metric} {values[-1]:.4f} "
                          f"({time.perf_counter() - started:.1f} s)", flush=True)
                mean, std = summary(values)
                section[f"{arm.name}_{task.metric}"] = round(mean, 4)
                section[f"{arm.name}_{task.metric}_std"] = round(std, 4)
                print(f"{task.key:14s} {arm.name:6s} mean {mean:.4f} std {std:.4f} over {seeds} seeds", flush=True)
            result[task.key] = section
    result["settings"] = {"arms": list(names), "steps": training.steps, "rounds": training.rounds,
                          "copies": copies, "seeds": seeds,
                          "batch_size": training.batch_size, "optimizer": training.optimizer, "lr": training.lr,
                          "scaling": training.scaling}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200, help="total steps of each arm")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--copies", type=int, default=4, help="copies of the forked arm")
    parser.add_argument("--seeds", type=int, default=3, help="job seeds 0..N-1, one run per seed and arm")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    parser.add_argument("--lr", type=float, default=0.05, help="default: the job spec's default lr")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per copy")
    parser.add_argument("--scaling", default=DEFAULT_SCALING, choices=tuple(SCALINGS),
                        help="the forked arm's learning-rate scaling (default: the recipe's, as the agent)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    args = parser.parse_args(argv)
    names = tuple(a for a in args.arms.split(",") if a)
    if not names or set(names) - set(ARMS):
        parser.error(f"--arms: choose from {','.join(ARMS)}")
    if args.copies < 1 or args.rounds < 1 or args.seeds < 1:
        parser.error("--copies, --rounds and --seeds must be >= 1")
    if args.steps % (args.copies * args.rounds) or (args.steps // args.copies) % args.rounds:
        parser.error("--steps must be a multiple of copies x rounds, and steps / copies of rounds")
    training = Training(batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr, steps=args.steps,
                        rounds=args.rounds, threads=args.threads, scaling=args.scaling)
    print(json.dumps(run(training, args.copies, args.seeds, names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
