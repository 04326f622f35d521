"""What the replica screen (shared/domain/replica_screen.py) costs on honest rounds, and what it catches.

Three measurements:

* ``simulate`` -- random honest rounds with Gaussian updates: 1..8 copies from one starting
  model, step budgets spread up to ``--spread`` x (GPUs of different speeds), a fraction
  ``--preempt`` of copies stopped early at a uniform fraction of their budget, each update
  ``s x drift + sqrt(s) x noise`` with a drift/noise ratio drawn per round from
  1e-3..1e2 per step (noise-dominated to drift-dominated) in ``--dim`` dimensions
  (``--saturate``: the noise stops growing after 1..1e4 steps, drawn per round, as a model
  in its basin whose copies' distance hardly depends on their steps). Prints the
  false-rejection rate: replicas rejected, rounds with any rejection, and the share of the
  round's samples rejected; by the preempted/not split.
* ``attack`` -- the same rounds with one copy replaced by an unrelated model of the starting
  model's norm that claims the round's largest budget; detection rate by how far honest
  copies move the model in a round (``rho`` = largest honest update / ||w_0||).
* ``train`` -- real forked training through the agent's worker and the tracker's own
  weighing and screen (``benchmarks/model_quality.py``'s machinery): digits and diabetes,
  ``--copies`` copies with budgets spread 4x (SGD, lr 0.05, batch 32), every round screened
  against its starting model (the screened model is the one trained on); counts honest
  rejections and the largest honest u/r seen. Then, in every round of every seed but the
  last, plants the last seed's round model (another job's) in copy 0's checkpoint, claiming
  the largest budget, averaged with all copies and with only the copy of fewest steps (the
  issue's two-copy case, ~80% of the weight to the planted one), and reports whether it is
  rejected and the held-out metric honest / attacked / attacked but screened.

Usage::

    python benchmarks/robust_average.py simulate [--rounds 10000] [--seed 0]
    python benchmarks/robust_average.py attack [--rounds 10000]
    python benchmarks/robust_average.py train [--seeds 2] [--rounds 10] [--copies 4] [--steps 60]

Last output line: a JSON object of the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.numpy import load_file, save_file

from benchmarks.model_quality import NODE, TASKS, run_copy
from services.agent.protocol import StoreTarget, WorkerSpec
from services.tracker.averaging.consolidate import Replica, Weighing, weigh_replicas
from services.tracker.averaging.safetensors_format import FileRangeReader
from services.tracker.averaging.screening import Screening, screen_replicas
from services.tracker.model_files import ModelFiles, held_out_metric, write_model_files
from shared.domain.layout import checkpoint_key, model_key, optim_key
from shared.domain.model_meta import OPTIM_PREFIX
from shared.domain.replica_screen import OUT_OF_LINE, ReplicaUpdate, per_step, screen, step_floor
from shared.store import LocalStore
from shared.wire.records import JobSpec


def _round(rng: np.random.Generator, args: argparse.Namespace) -> tuple[list[int], list[bool], np.ndarray, float]:
    """One honest round: steps, preempted flags, updates (n x dim), the drift/noise ratio."""
    n = int(rng.integers(1, 9))
    top = int(rng.integers(20, 2001))
    budgets = np.maximum(1, np.round(top * args.spread ** -rng.random(n))).astype(int)
    preempted = [bool(p) for p in rng.random(n) < args.preempt]
    steps = [max(1, int(b * rng.random())) if p else int(b) for b, p in zip(budgets, preempted)]
    kappa = 10 ** rng.uniform(-3, 2)                      # drift per step / noise per step
    tau = 10 ** rng.uniform(0, 4) if args.saturate else math.inf   # steps after which the noise stops growing
    drift = rng.standard_normal(args.dim)
    drift /= np.linalg.norm(drift)
    noise = rng.standard_normal((n, args.dim)) / math.sqrt(args.dim)
    s = np.array(steps, dtype=np.float64)[:, None]
    return steps, list(preempted), s * kappa * drift + np.sqrt(np.minimum(s, tau)) * noise, kappa


def simulate(args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(args.seed)
    replicas = rejected = rounds_hit = rej_pre = n_pre = 0
    samples = rejected_samples = 0.0
    worst_share = 0.0
    for _ in range(args.rounds):
        steps, preempted, updates, _ = _round(rng, args)
        norms = np.linalg.norm(updates, axis=1)
        start_norm = float(norms.max() / 10 ** rng.uniform(-3, 0))   # rho in 1e-3..1
        verdicts = screen([ReplicaUpdate(copy=i, steps=s, update_norm=float(d))
                           for i, (s, d) in enumerate(zip(steps, norms))], start_norm=start_norm,
                          out_of_line=args.factor)
        out = {v.copy for v in verdicts}
        assert len(out) < len(steps) or len(steps) == 0, "an honest round lost every replica"
        replicas += len(steps)
        rejected += len(out)
        rounds_hit += bool(out)
        n_pre += sum(preempted)
        rej_pre += sum(preempted[i] for i in out)
        share = sum(steps[i] for i in out) / sum(steps)
        worst_share = max(worst_share, share)
        samples += sum(steps)
        rejected_samples += sum(steps[i] for i in out)
    result = {"rounds": args.rounds, "replicas": replicas, "rejected": rejected,
              "false_rejection_rate": rejected / replicas, "rounds_with_a_rejection": rounds_hit / args.rounds,
              "rejected_preempted": rej_pre, "rejected_not_preempted": rejected - rej_pre,
              "preempted": n_pre, "samples_rejected_share": rejected_samples / samples,
              "worst_round_samples_rejected_share": worst_share,
              "settings": {"spread": args.spread, "preempt": args.preempt, "dim": args.dim, "seed": args.seed,
                           "saturate": args.saturate, "factor": args.factor}}
    print(f"honest replicas rejected: {rejected}/{replicas} ({100 * rejected / replicas:.3f}%), "
          f"{rej_pre} of them preempted; rounds with a rejection {100 * rounds_hit / args.rounds:.2f}%; "
          f"samples rejected {100 * rejected_samples / samples:.4f}% (worst round {100 * worst_share:.1f}%)")
    return result


def attack(args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(args.seed)
    buckets: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        steps, _, updates, _ = _round(rng, args)
        if len(steps) < 2:
            continue
        rho = 10 ** rng.uniform(-3, 0.5)
        w0 = rng.standard_normal(args.dim)
        w0 *= float(np.linalg.norm(updates, axis=1).max()) / rho / float(np.linalg.norm(w0))
        planted = rng.standard_normal(args.dim)
        planted *= float(np.linalg.norm(w0)) / float(np.linalg.norm(planted))   # an unrelated model
        norms = [float(d) for d in np.linalg.norm(updates, axis=1)]
        norms[0] = float(np.linalg.norm(planted - w0))
        claimed = [max(steps), *steps[1:]]
        verdicts = screen([ReplicaUpdate(copy=i, steps=s, update_norm=d)
                           for i, (s, d) in enumerate(zip(claimed, norms))],
                          start_norm=float(np.linalg.norm(w0)), out_of_line=args.factor)
        key = f"rho<={10 ** (math.ceil(math.log10(rho) * 2) / 2):.3g}"
        buckets.setdefault(key, []).append(int(any(v.copy == 0 for v in verdicts)))
    rates = {k: sum(v) / len(v) for k, v in sorted(buckets.items(), key=lambda kv: float(kv[0][5:]))}
    for k, v in rates.items():
        print(f"planted replica rejected, {k:12s}: {100 * v:.1f}% of {len(buckets[k])} rounds")
    return {"detection_by_rho": rates, "settings": {"spread": args.spread, "dim": args.dim, "seed": args.seed,
                                                    "saturate": args.saturate, "factor": args.factor}}


class _Job:
    """One job trained round by round through the agent's worker, averaged as the tracker does."""

    def __init__(self, root: Path, scratch: Path, task: Any, seed: int, args: argparse.Namespace) -> None:
        self.root, self.scratch, self.task, self.seed, self.args = root, scratch, task, seed, args
        self.job = f"{task.key}-s{seed}"
        self.spec = JobSpec(job_id=self.job, user="bench", model=task.model, dataset=task.dataset, batch_size=32,
                            workers=1, iterations=10**6)
        self.total = 0

    def train_round(self, round_: int, budgets: list[int]) -> list[int]:
        start = model_key(self.job, round_ - 1) if round_ else None
        return [run_copy(WorkerSpec(
            job_id=self.job, round=round_, copy=c, node_id=NODE, gpu_type="cpu", model=self.task.model,
            dataset=self.task.dataset, batch_size=32, optimizer="sgd", lr=0.05, seed=self.seed, rank=0,
            world_size=1, rendezvous=None, device="cpu", step_budget=b, deadline=time.time() + 86400,
            start_from=start, checkpoint=checkpoint_key(self.job, round_, c, node=NODE),
            store=StoreTarget.local(self.root), threads=1)) for c, b in enumerate(budgets)]

    def weigh(self, round_: int, claims: dict[int, int]) -> Weighing:
        return weigh_replicas([Replica(copy=c, steps=s, reader=FileRangeReader(self.ckpt(round_, c)))
                               for c, s in claims.items()], prior_worker_steps=self.total)

    def ckpt(self, round_: int, copy: int) -> Path:
        return self.root / checkpoint_key(self.job, round_, copy, node=NODE)

    def screen(self, round_: int, weighing: Weighing) -> Screening:
        return screen_replicas(weighing, FileRangeReader(self.root / model_key(self.job, round_ - 1)),
                               chunk_bytes=1 << 20)

    def write(self, round_: int, weighing: Weighing, name: str) -> tuple[ModelFiles, float | None]:
        out = self.scratch / f"{self.job}-{round_}-{name}"
        out.mkdir(parents=True)
        files = write_model_files(weighing, out, job_id=self.job, round_=round_, missing=(), spec=self.spec,
                                  chunk_bytes=1 << 20)
        metric, _ = held_out_metric(files.model_path, self.spec)
        return files, metric[1] if metric else None

    def store(self, round_: int, files: ModelFiles) -> None:
        store = LocalStore(self.root)
        if files.optim_path is not None:
            asyncio.run(store.put_file(optim_key(self.job, round_), files.optim_path))
        asyncio.run(store.put_file(model_key(self.job, round_), files.model_path))
        self.total = files.meta.total_steps


def plant(job: _Job, round_: int, steps: list[int], planted_key: str, copies: list[int]) -> dict[str, object]:
    """Copy ``copies[0]``'s checkpoint replaced by the model at ``planted_key`` (its optimizer
    state kept), claiming the round's largest budget, averaged with the other ``copies``:
    is it rejected, and the held-out metric with and without the screen."""
    path = job.ckpt(round_, copies[0])
    honest = load_file(str(path))
    planted = load_file(str(job.root / planted_key))
    save_file({**{k: v for k, v in honest.items() if k.startswith(OPTIM_PREFIX)}, **planted}, str(path))
    try:
        weighing = job.weigh(round_, {c: max(steps) if c == copies[0] else steps[c] for c in copies})
        screening = job.screen(round_, weighing)
        name = f"{len(copies)}-{planted_key.replace('/', '_')}"
        _, unscreened = job.write(round_, weighing, f"{name}-unscreened")
        _, screened = job.write(round_, weighing.without(screening.rejections()), f"{name}-screened")
    finally:
        save_file(honest, str(path))
    return {"round": round_, "copies": len(copies), "rejected": [v.copy for v in screening.verdicts],
            "planted_ratio": round(_ratios(screening)[copies[0]], 2),
            "planted_weight": round(max(steps) / (max(steps) + sum(steps[c] for c in copies[1:])), 2),
            "metric_unscreened": unscreened, "metric_screened": screened}


def _ratios(screening: Screening) -> dict[int, float]:
    """Each replica's per-step update over the round's reference (the rule's ``u_i / r``)."""
    floor = step_floor(screening.updates)
    ref = sorted(per_step(u, floor) for u in screening.updates)[(len(screening.updates) - 1) // 2]
    return {u.copy: per_step(u, floor) / max(ref, 1e-300) for u in screening.updates}


def train(args: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(1)
    fractions = [1.0, 0.7, 0.45, 0.25, 0.85, 0.55, 0.35, 0.3][:args.copies]
    budgets = [max(1, round(args.steps * f)) for f in fractions]
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="hadar-robust-") as tmp:
        root, scratch = Path(tmp) / "store", Path(tmp) / "scratch"
        for task in TASKS:
            honest = rejected = 0
            worst = 1.0
            attacks, metrics = [], []
            for seed in reversed(range(args.seeds)):   # the last seed first: its models are planted in the others
                job = _Job(root, scratch, task, seed, args)
                for round_ in range(args.rounds):
                    steps = job.train_round(round_, budgets)
                    weighing = job.weigh(round_, dict(enumerate(steps)))
                    if round_:
                        screening = job.screen(round_, weighing)
                        honest += len(screening.updates)
                        rejected += len(screening.verdicts)
                        worst = max(worst, *_ratios(screening).values())
                        weighing = weighing.without(screening.rejections()) if screening.verdicts else weighing
                    files, metric = job.write(round_, weighing, "honest")
                    if round_ and seed < args.seeds - 1:
                        other = model_key(f"{task.key}-s{args.seeds - 1}", round_)
                        # every copy, and the first and last alone: the same two with --copies 2
                        for copies in dict.fromkeys((tuple(range(len(steps))), (0, len(steps) - 1))):
                            attacks.append({**plant(job, round_, steps, other, list(copies)),
                                            "metric_honest": metric})
                    job.store(round_, files)
                metrics.append(metric)
            caught = sum(bool(a["rejected"]) for a in attacks)
            result[task.key] = {"honest_replicas": honest, "honest_rejected": rejected,
                                "largest_honest_per_step_ratio": round(worst, 3), "final_metrics": metrics,
                                "attacks_caught": f"{caught}/{len(attacks)}", "attacks": attacks}
            print(f"{task.key}: honest rejected {rejected}/{honest}, largest honest u/r {worst:.2f}, "
                  f"planted models caught {caught}/{len(attacks)}", flush=True)
            for a in attacks:
                print(f"  round {a['round']} {a['copies']} copies (planted weight {a['planted_weight']}): "
                      f"ratio {a['planted_ratio']}, rejected {a['rejected']}, metric honest {a['metric_honest']:.4f} "
                      f"attacked {a['metric_unscreened']:.4f} screened {a['metric_screened']:.4f}", flush=True)
    result["settings"] = {"seeds": args.seeds, "rounds": args.rounds, "budgets": budgets}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("simulate", "attack", "train"))
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: 10000 simulated, 6 trained)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spread", type=float, default=10.0, help="largest / smallest budget in a round")
    parser.add_argument("--preempt", type=float, default=0.1, help="share of copies stopped early")
    parser.add_argument("--dim", type=int, default=2000)
    parser.add_argument("--saturate", action="store_true",
                        help="noise stops growing after a random number of steps (a model in its basin)")
    parser.add_argument("--factor", type=float, default=OUT_OF_LINE, help="the rule's OUT_OF_LINE factor")
    parser.add_argument("--seeds", type=int, default=2, help="train: job seeds (the last one's models are planted)")
    parser.add_argument("--copies", type=int, default=4, help="train: copies per round (2..8)")
    parser.add_argument("--steps", type=int, default=60, help="train: the largest copy budget per round")
    args = parser.parse_args(argv)
    if args.what == "train":
        args.rounds = args.rounds or 10
        if args.seeds < 2 or not 2 <= args.copies <= 8:
            parser.error("train needs --seeds >= 2 and --copies in 2..8")
        out = train(args)
    else:
        args.rounds = args.rounds or 10_000
        out = simulate(args) if args.what == "simulate" else attack(args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
