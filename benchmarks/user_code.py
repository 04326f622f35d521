"""User code (issue 25): the SDK path's training rate, code/data bundles, and a new job's first placement.

Three measurements, each printed as a table line, all of them together as one JSON line last:

1. **throughput** -- samples/s of the zoo's ``resnet`` on ``digits`` (batch 32, SGD with
   momentum, one torch thread everywhere) trained three ways on the CPU, taking turns in a
   rotating order over ``--repeats`` repeats of ``--steps`` steps each:

   * *bare*: a plain torch loop in this process (``torch.randint`` batches);
   * *sdk*: a script using :mod:`hadar_sdk` (its ``rnd.steps()``, ``BatchSampler``,
     ``rnd.report`` each step) run by the real, sandboxed :class:`Trainer` harness, one warm
     process, each repeat one round started from the state the previous one handed back. The
     script gets the zoo's own ``ResNetImage`` source copied into its code folder (the sandbox
     lets it import nothing of this checkout), and the benchmark asserts that the copy builds
     the same initial weights from the same seed, has the same parameter count, and computes
     the same forward pass as the zoo model on the same weights. Its data are the zoo's digits
     arrays exported to ``.npy`` (the dataset folder it reads);
   * *zoo*: the worker's :class:`~services.agent.worker.training.TrainingLoop`, in this process.

   Rates are steady state: *bare* and *zoo* time their steps (``TrainingLoop``'s ``train_s``);
   *sdk* times its ``for step in rnd.steps()`` loop inside the script and sends it as a metric.
   Process start, imports and the first round (1 step) are the trainer's ``startup_s``
   (``Trainer.start()`` to that round's end), reported apart, and also the harness's view:
   each round's wall time (writing the start state, the script's restore and save, the checks)
   as ``sdk_round_samples_s``. Ratios: the median over repeats of sdk/bare and zoo/bare paired
   within the repeat. Goal (issue 25): ``sdk_ratio`` >= 0.95.

2. **bundles** and 3. **placement**: see :mod:`benchmarks.user_code_io`.

Usage::

    python benchmarks/user_code.py [--repeats 5] [--steps 600] [--only throughput,bundles,placement]

Keep ``--steps`` x ``--repeats`` so that one run stays within a few minutes on a loaded CPU.
Last output line: one JSON object ``{"throughput": {...}, "bundles": {...}, "placement":
{...}}`` (only the parts asked for), with ``load_avg`` (1-minute load before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch import nn

from shared.zoo import models as zoo_models

ROOT = Path(__file__).resolve().parents[1]
DIGITS_EXAMPLE = ROOT / "examples" / "user-code" / "digits"
WAYS = ("bare", "sdk", "zoo")
MODEL, DATASET, SEED = "resnet", "digits", 0
ROUND_SECONDS = 600.0   # an SDK round's deadline: far above what it needs
BENCH_USER = "bench"


# ---------------------------------------------------------------- pure helpers


def turn_order(repeat: int, ways: Sequence[str] = WAYS) -> list[str]:
    """The order the ways take turns in repeat ``repeat``: rotated by one each repeat, so none
    is always first (the one after a pause) or always next to the same neighbour."""
    k = repeat % len(ways)
    return list(ways[k:]) + list(ways[:k])


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-repeat ratios of two equally long series (a repeat with a zero denominator is skipped)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"series of {len(numerator)} and {len(denominator)} values cannot be paired")
    return [n / d for n, d in zip(numerator, denominator) if d > 0]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def model_source() -> str:
    """A self-contained module with the zoo's ``resnet`` for images (its classes' own source),
    and ``build(config)`` from ``channels``, ``classes``, ``width``, ``depth``."""
    classes = "\n\n".join(inspect.getsource(c) for c in (zoo_models._ConvBlock, zoo_models.ResNetImage))
    return (
        '"""The zoo\'s resnet for images (shared/zoo/models.py), copied by benchmarks/user_code.py."""\n\n'
        "from __future__ import annotations\n\nimport torch\nfrom torch import nn\n\n\n"
        f"{classes}\n\n"
        "def build(config: dict) -> nn.Module:\n"
        "    return ResNetImage(int(config['channels']), int(config['classes']), int(config['width']),\n"
        "                       int(config['depth']))\n")


SCRIPT = '''\
"""The benchmark's SDK script: the zoo's resnet trained through hadar_sdk (benchmarks/user_code.py)."""

import time

import numpy as np
import torch
import torch.nn.functional as F
from model import build

import hadar_sdk


def main() -> None:
    with hadar_sdk.connect() as run:
        cfg = run.config
        x_all = torch.from_numpy(np.load(run.data_dir / "train-images.npy"))
        y_all = torch.from_numpy(np.load(run.data_dir / "train-labels.npy"))
        torch.manual_seed(run.seed)
        model = build(cfg)
        ready_at = time.time()
        for rnd in run.rounds():
            opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
            rnd.restore(model, opt)
            sampler = hadar_sdk.BatchSampler(len(y_all), run.batch_size, rnd.stream)
            model.train()
            began = time.perf_counter()
            for step in rnd.steps():
                index = sampler.indices(step)
                loss = F.cross_entropy(model(x_all[index]), y_all[index])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                rnd.report(samples=len(index), loss=loss.item())
            rnd.metric("train_s", time.perf_counter() - began)
            rnd.metric("ready_at", ready_at)
            rnd.save(model, opt)


if __name__ == "__main__":
    main()
'''


def write_code_folder(folder: Path) -> Path:
    """The SDK script's code bundle: ``train.py`` and ``model.py`` (the zoo's resnet)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(model_source(), encoding="utf-8")
    (folder / "train.py").write_text(SCRIPT, encoding="utf-8")
    return folder


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_same_model(copy: ModuleType, config: dict[str, Any], zoo_model: nn.Module, seed: int,
                     x: torch.Tensor) -> int:
    """Assert that ``copy.build(config)`` is the zoo model: the same initial weights from the
    same seed (as the script seeds: ``torch.manual_seed`` then build), the same parameter count,
    the same state names and shapes, and the same output on the same weights. Its parameter count."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = copy.build(config)
    theirs, ours = built.state_dict(), zoo_model.state_dict()
    assert parameter_count(built) == parameter_count(zoo_model), "parameter counts differ"
    assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}, "state differs"
    assert all(torch.equal(theirs[k], ours[k]) for k in ours), "the same seed built different weights"
    built.load_state_dict(ours, strict=True)
    built.eval()
    was_training = zoo_model.training
    zoo_model.eval()
    with torch.no_grad():
        same = torch.equal(built(x), zoo_model(x))
    zoo_model.train(was_training)
    assert same, "the copy's forward pass differs from the zoo model's on the same weights"
    return parameter_count(built)


def write_synthetic_dataset(folder: Path, megabytes: float, *, files: int = 5, seed: int = 0) -> int:
    """``files`` .npy files of random float32 (incompressible) adding up to about ``megabytes``
    MB; their bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = max(1, int(megabytes * 1e6 / 4 / files))
    total = 0
    for i in range(files):
        path = folder / f"part-{i:02d}.npy"
        np.save(path, rng.random(per_file, dtype=np.float32), allow_pickle=False)
        total += path.stat().st_size
    (folder / "README.txt").write_text("Synthetic data of benchmarks/user_code.py (random float32).\n")
    return total


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


# ---------------------------------------------------------------- 1. throughput


@dataclass
class Ways:
    """Per repeat: the samples/s of each way, and the SDK's rate over its whole round."""

    rates: dict[str, list[float]]
    sdk_round: list[float]
    sdk_round_overhead_s: list[float]


def bare_loop(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              batch_size: int, steps: int, gen: torch.Generator) -> float:
    """``steps`` plain steps; samples/s."""
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    began = time.perf_counter()
    for _ in range(steps):
        index = torch.randint(len(x), (batch_size,), generator=gen)
        loss = loss_fn(model(x[index]), y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps * batch_size / (time.perf_counter() - began)


def measure_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from services.agent.usercode.sandbox import landlock_abi
    from services.agent.usercode.trainer import RoundRequest, Trainer, TrainerLaunch, TrainerLimits
    from services.agent.worker.training import BatchSampler, TrainingLoop
    from shared.zoo import build_model, load_dataset, make_optimizer
    from shared.zoo.optim import SGD_MOMENTUM

    if landlock_abi() == 0:
        raise SystemExit("throughput: Landlock is unavailable in this kernel; the harness starts no trainer")
    torch.set_num_threads(1)
    data = load_dataset(DATASET)
    name = zoo_models.parse_model_name(MODEL)
    config = {"channels": data.info.input_shape[0], "classes": data.info.n_outputs, "width": name.width,
              "depth": name.depth, "lr": args.lr, "momentum": SGD_MOMENTUM}
    batch = args.batch_size
    with tempfile.TemporaryDirectory(prefix="hadar-bench-uc-") as tmp:
        root = Path(tmp)
        code = write_code_folder(root / "code")
        params = check_same_model(load_module(code / "model.py", "bench_user_code_model"), config,
                                  build_model(MODEL, data.info, seed=SEED), SEED, data.test_x[:64])
        data_dir = root / "data"
        data_dir.mkdir()
        np.save(data_dir / "train-images.npy", data.train_x.numpy(), allow_pickle=False)
        np.save(data_dir / "train-labels.npy", data.train_y.numpy(), allow_pickle=False)

        bare_model = build_model(MODEL, data.info, seed=SEED)
        bare_opt = make_optimizer("sgd", bare_model.parameters(), args.lr)
        gen = torch.Generator().manual_seed(SEED)
        zoo_model = build_model(MODEL, data.info, seed=SEED)
        zoo_opt = make_optimizer("sgd", zoo_model.parameters(), args.lr)
        assert isinstance(zoo_opt, torch.optim.SGD) and zoo_opt.defaults["momentum"] == SGD_MOMENTUM
        zoo_loop = TrainingLoop(model=zoo_model, optimizer=zoo_opt, data=data, device=torch.device("cpu"),
                                sampler=BatchSampler(len(data.train_x), batch, (SEED, 0, 0), "cpu"),
                                progress_s=2.0)
        zoo_total = 0

        def zoo(steps: int) -> float:
            nonlocal zoo_total
            result = zoo_loop.run(start_round_steps=0, start_total=zoo_total, budget=steps,
                                  deadline=time.time() + ROUND_SECONDS, on_progress=lambda *_: None)
            assert result.steps_round == steps, result
            zoo_total = result.steps_total
            return result.samples_per_s

        launch = TrainerLaunch(code_dir=code, entrypoint="train.py", scratch=root / "scratch", seed=SEED,
                               batch_size=batch, config=json.dumps(config), data_dir=data_dir, threads=1)
        harness = Trainer(launch, TrainerLimits(hello_s=120, stop_grace_s=30))
        sdk_state: dict[str, torch.Tensor] | None = None
        sdk_total, sdk_round = 0, 0

        def sdk(steps: int) -> tuple[float, float, float]:
            """One round: (in-script samples/s, whole-round samples/s, round overhead seconds)."""
            nonlocal sdk_state, sdk_total, sdk_round
            began = time.perf_counter()
            result = harness.run_round(RoundRequest(round=sdk_round, copy=0, start_steps=sdk_total, max_steps=steps,
                                                    seconds=ROUND_SECONDS, max_samples_per_step=batch,
                                                    start=sdk_state))
            wall = time.perf_counter() - began
            assert result.ok, f"round {sdk_round}: {result.reason}\n{harness.log_tail[-2000:]}"
            assert (result.steps, result.samples) == (steps, steps * batch), result
            train_s = next(v for n, _, v in result.metrics if n == "train_s")
            sdk_state, sdk_total, sdk_round = result.tensors, sdk_total + steps, sdk_round + 1
            return steps * batch / train_s, steps * batch / wall, wall - train_s

        started_at = time.time()
        began = time.perf_counter()
        harness.start()
        try:
            first = harness.run_round(RoundRequest(round=0, copy=0, start_steps=0, max_steps=1, seconds=ROUND_SECONDS,
                                                   max_samples_per_step=batch))
            startup_s = time.perf_counter() - began
            assert first.ok, f"first round: {first.reason}\n{harness.log_tail[-2000:]}"
            ready_s = next(v for n, _, v in first.metrics if n == "ready_at") - started_at
            sdk_state, sdk_total, sdk_round = first.tensors, 1, 1
            # Warm-up: each way's first steps (allocator, autograd graph caches) are not counted.
            bare_loop(bare_model, bare_opt, data.train_x, data.train_y, batch, args.warmup_steps, gen)
            sdk(args.warmup_steps)
            zoo(args.warmup_steps)
            ways = Ways(rates={w: [] for w in WAYS}, sdk_round=[], sdk_round_overhead_s=[])
            for repeat in range(args.repeats):
                line = []
                for way in turn_order(repeat):
                    if way == "bare":
                        rate = bare_loop(bare_model, bare_opt, data.train_x, data.train_y, batch, args.steps, gen)
                    elif way == "zoo":
                        rate = zoo(args.steps)
                    else:
                        rate, whole, overhead = sdk(args.steps)
                        ways.sdk_round.append(whole)
                        ways.sdk_round_overhead_s.append(overhead)
                    ways.rates[way].append(rate)
                    line.append(f"{way} {rate:.0f}")
                print(f"throughput repeat {repeat}: {', '.join(line)} samples/s (load {load_avg()})", file=sys.stderr)
        finally:
            exit_code = harness.close()
    sdk_paired = paired_ratios(ways.rates["sdk"], ways.rates["bare"])
    zoo_paired = paired_ratios(ways.rates["zoo"], ways.rates["bare"])
    round_paired = paired_ratios(ways.sdk_round, ways.rates["bare"])
    medians = {w: median(ways.rates[w]) for w in WAYS}
    return {
        "model": MODEL, "dataset": DATASET, "params": params, "batch_size": batch, "threads": 1,
        "steps": args.steps, "repeats": args.repeats,
        **{f"{w}_samples_s": rounded(medians[w], 1) for w in WAYS},
        "sdk_ratio": rounded(median(sdk_paired)), "zoo_ratio": rounded(median(zoo_paired)),
        "sdk_round_samples_s": rounded(median(ways.sdk_round), 1),
        "sdk_round_ratio": rounded(median(round_paired)),
        "sdk_round_overhead_s": rounded(median(ways.sdk_round_overhead_s), 3),
        "sdk_startup_s": round(startup_s, 3), "sdk_ready_s": round(ready_s, 3), "trainer_exit": exit_code,
        "goal_sdk_ratio": 0.95,
        "goal_met": bool(sdk_paired) and (median(sdk_paired) or 0.0) >= 0.95,
        "per_repeat": {w: [round(v, 1) for v in ways.rates[w]] for w in WAYS},
    }


# ---------------------------------------------------------------- main


PARTS = ("throughput", "bundles", "placement")


def parse_only(text: str) -> tuple[str, ...]:
    """``--only``: a comma-separated subset of :data:`PARTS` (in that order)."""
    asked = {p.strip() for p in text.split(",") if p.strip()}
    unknown = asked - set(PARTS)
    if unknown or not asked:
        raise argparse.ArgumentTypeError(f"--only: choose from {', '.join(PARTS)}, got {text!r}")
    return tuple(p for p in PARTS if p in asked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="throughput repeats (bundles, placement: at most 3)")
    parser.add_argument("--steps", type=int, default=600, help="steps of each way in each throughput repeat")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--data-mb", type=float, default=50.0, help="size of the synthetic dataset bundle")
    parser.add_argument("--round-s", type=float, default=2.0, help="the scheduler's round length")
    parser.add_argument("--only", type=parse_only, default=PARTS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    out: dict[str, Any] = {"load_avg_before": load_avg()}
    if "throughput" in args.only:
        t = out["throughput"] = measure_throughput(args)
        print(f"throughput: bare {t['bare_samples_s']} sdk {t['sdk_samples_s']} zoo {t['zoo_samples_s']} samples/s; "
              f"sdk/bare {t['sdk_ratio']} zoo/bare {t['zoo_ratio']} (goal sdk >= 0.95: "
              f"{'met' if t['goal_met'] else 'NOT met'}); sdk whole rounds {t['sdk_round_samples_s']} "
              f"({t['sdk_round_ratio']}, {t['sdk_round_overhead_s']} s a round); trainer start-up "
              f"{t['sdk_startup_s']} s (load {load_avg()})", file=sys.stderr)
    from benchmarks.user_code_io import measure_bundles, measure_placement

    if "bundles" in args.only:
        out["bundles"] = asyncio.run(measure_bundles(args))
    if "placement" in args.only:
        out["placement"] = asyncio.run(measure_placement(args))
    out["load_avg_after"] = load_avg()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
