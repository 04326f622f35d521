"""How many iterations a rigid Sia job needs: its epochs, its dataset, its batch's efficiency.

Source: the Sia (SOSP'23) artifact's ``validation-<batch>.csv`` files (columns in
``shared/domain/data/sia/README.md``) and its ``applications.py`` epoch limits, restated:

* The application trains for ``EPOCH_LIMITS[app]`` epochs (Sia's ``max_epochs``; its target
  metric is unset, so a job is done when it has run them all).
* Progress is *statistical*: ``progress`` in the validation files counts iterations at the
  application's smallest validated batch ``b0``, so one epoch is (dataset size / b0) of it:
  391 for CIFAR-10 at 128 (50,000 training images), 6,406 for ImageNet at 200 (1,281,167),
  7,387 for BERT on SQuAD v1.1 at 12 (~88.6k examples), 2,069 for YOLOv3 at 8 (16,552: PASCAL
  VOC 2007+2012 trainval), 357 for DeepSpeech2 at 20 (~7.1k utterances, as the profile implies).
  Epoch boundary ``e`` sits at ``P(e) = min over validated batches of progress[e - 1]``.
* During epoch ``e`` an iteration of global batch ``B`` earns
  ``gain = (var + sqr) / (var / s + sqr)`` progress, ``s = B / b0``, with ``sqr`` and ``var``
  the gradient statistics of epoch ``e`` interpolated linearly in ``B`` between the two
  validated batches around it (Pollux's statistical efficiency: a large batch earns less than
  ``s`` times a small one's progress per iteration).
* So a job needs ``sum over e < E of (P(e + 1) - P(e)) / gain(B, e)`` iterations, at any
  placement: Sia's simulator advances the same progress at ``gain / iteration time``.
  The naive rule ``E x dataset / B`` (perfect scaling, gain = s) is ``naive_iterations``;
  it undercounts large batches (CIFAR-10 at 4096: about half as many iterations).
* Sia calibrates its simulator to its real runs by slowing every application by
  ``CALIBRATION_SLOWDOWN`` (``simulator_config.SLOWDOWNS``, fitted by Sia's authors); we
  charge it as that many times the iterations, so the throughput table stays the measured
  one and every policy sees the same work.

Pure functions of the packaged data; results are memoised per (application, batch).
"""

from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass
from importlib import resources

from services.scheduler.sim.sia_profiles import APPLICATIONS

# Seconds a job loses to checkpoint-restore when (re)placed: Sia's per-application
# ``rescale_time`` (applications.py), charged by its simulator on every change of allocation.
RESTART_S = {"bert": 120.0, "cifar10": 50.0, "deepspeech2": 25.0, "imagenet": 250.0, "yolov3": 80.0}
EPOCH_LIMITS = {"bert": 2, "cifar10": 100, "deepspeech2": 80, "imagenet": 90, "yolov3": 50}
CALIBRATION_SLOWDOWN = {"bert": 1.2, "cifar10": 1.8, "deepspeech2": 1.2, "imagenet": 1.2, "yolov3": 1.2}
_VALIDATION_RE = re.compile(r"^validation-(?P<batch>\d+)\.csv$")


@dataclass(frozen=True, kw_only=True)
class ValidationCurve:
    """Per epoch of training at one global batch: cumulative progress and gradient statistics."""

    batch: int
    progress: tuple[float, ...]
    grad_sqr: tuple[float, ...]
    grad_var: tuple[float, ...]


@functools.cache
def validation_curves(application: str) -> tuple[ValidationCurve, ...]:
    """The application's validation files, smallest batch first; ``ValueError`` if unknown."""
    if application not in APPLICATIONS:
        raise ValueError(f"no Sia validation data for {application!r}; known: {', '.join(APPLICATIONS)}")
    folder = resources.files("shared.domain").joinpath("data/sia/profiles", application)
    curves = []
    for entry in folder.iterdir():
        m = _VALIDATION_RE.match(entry.name)
        if m is None:
            continue
        rows = list(csv.DictReader(entry.read_text(encoding="utf-8").splitlines()))
        curves.append(ValidationCurve(batch=int(m["batch"]), progress=tuple(float(r["progress"]) for r in rows),
                                      grad_sqr=tuple(float(r["grad_sqr"]) for r in rows),
                                      grad_var=tuple(float(r["grad_var"]) for r in rows)))
    return tuple(sorted(curves, key=lambda c: c.batch))


def validated_batches(application: str) -> tuple[int, ...]:
    return tuple(c.batch for c in validation_curves(application))


def _grad_stats(curves: tuple[ValidationCurve, ...], batch: int, epoch: int) -> tuple[float, float]:
    lower = max((c for c in curves if c.batch <= batch), key=lambda c: c.batch)
    upper = min((c for c in curves if c.batch >= batch), key=lambda c: c.batch)
    if lower.batch == upper.batch:
        return lower.grad_sqr[epoch], lower.grad_var[epoch]
    w = (batch - lower.batch) / (upper.batch - lower.batch)
    sqr = (1 - w) * lower.grad_sqr[epoch] + w * upper.grad_sqr[epoch]
    var = (1 - w) * lower.grad_var[epoch] + w * upper.grad_var[epoch]
    return sqr, var


@functools.cache
def iterations_to_finish(application: str, batch: int) -> float:
    """Iterations of global ``batch`` to the epoch limit, with statistical efficiency (module docstring).

    ``ValueError`` for an unknown application or a batch outside the validated range.
    """
    curves = validation_curves(application)
    if not curves[0].batch <= batch <= curves[-1].batch:
        raise ValueError(f"{application}: batch {batch} outside the validated {curves[0].batch}..{curves[-1].batch}")
    epochs = EPOCH_LIMITS[application]
    base = curves[0].batch
    scale = batch / base
    total, previous = 0.0, 0.0
    for epoch in range(epochs):
        boundary = min(c.progress[epoch] for c in curves)
        sqr, var = _grad_stats(curves, batch, epoch)
        gain = (var + sqr) / (var / scale + sqr)
        total += (boundary - previous) / gain
        previous = boundary
    return total


def naive_iterations(application: str, batch: int) -> float:
    """``E x dataset / B`` with the dataset size the progress column implies (for comparison)."""
    curves = validation_curves(application)
    epoch_progress = min(c.progress[0] for c in curves)
    return EPOCH_LIMITS[application] * epoch_progress * curves[0].batch / batch


def total_steps(application: str, batch: int, *, calibrated: bool = True) -> int:
    """A trace job's ``total_steps``: iterations to finish, times Sia's calibration if asked, >= 1."""
    factor = CALIBRATION_SLOWDOWN[application] if calibrated else 1.0
    return max(1, round(iterations_to_finish(application, batch) * factor))
