"""What a user's trainer hands back, checked before anything of it reaches the store.

:func:`checked_state` accepts a state file only if it is a regular file (not a link, and
linked nowhere else) directly inside ``folder`` -- the harness first moves it out of the
trainer's outbox into a folder of its own, so the trainer cannot swap the name while it is
checked -- at most ``max_bytes``, a safetensors file whose header is at most
``MAX_HEADER_BYTES`` (checked on the raw bytes before any parser sees it), and -- when the
round had a starting state -- holds exactly the same tensor names, dtypes and shapes (a start
without optimizer state lets the script add its own, ``optim.*``; the weights still match). A
pickle, an extra or reshaped tensor, a link to another job's file: each raises
:class:`TrainerRefused` with a one-line reason. Metadata in the file is dropped: the
harness writes its own (job, round, copy are never the trainer's claim).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hadar_sdk.state import OPTIM_PREFIX
from shared.errors import HadarError

__all__ = ["TrainerRefused", "TensorSpec", "MAX_HEADER_BYTES", "specs_of", "empty_folder", "take_state",
           "checked_state", "checked_counts"]

MAX_HEADER_BYTES = 8 << 20


class TrainerRefused(HadarError):
    """The trainer handed back something the harness will not pass on."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]


def specs_of(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
            for name, t in tensors.items()}


def empty_folder(folder: Path) -> None:
    """Remove what is in ``folder`` without following links (best effort: the trainer may be writing)."""
    for entry in os.scandir(folder):
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def take_state(path: Path, *, folder: Path) -> Path:
    """Move the trainer's ``path`` (the name itself: a link stays a link) into the harness's
    ``folder``, emptied first, where the trainer cannot swap it while it is checked."""
    empty_folder(folder)
    target = folder / path.name
    try:
        os.rename(path, target)
    except FileNotFoundError:
        raise TrainerRefused("the trainer saved no state file") from None
    except OSError as exc:
        raise TrainerRefused(f"the state file cannot be taken: {exc.strerror}") from None
    return target


def _regular_file_in(path: Path, folder: Path, max_bytes: int) -> int:
    if path.parent.resolve() != folder.resolve():
        raise TrainerRefused(f"state file {path.name!r} is not in the folder of received states")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise TrainerRefused("the trainer saved no state file") from None
    if not stat.S_ISREG(info.st_mode):
        raise TrainerRefused("the state file is not a regular file (a link or a special file)")
    if info.st_nlink != 1:
        raise TrainerRefused(f"the state file has {info.st_nlink} hard links (another file's name)")
    if info.st_size > max_bytes:
        raise TrainerRefused(f"the state file is {info.st_size} bytes, over the limit of {max_bytes}")
    return info.st_size


def _header_length(path: Path, size: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        head = os.read(fd, 8)
    finally:
        os.close(fd)
    if len(head) < 8:
        raise TrainerRefused("the state file is not safetensors: shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or length + 8 > size:
        raise TrainerRefused(f"the state file is not safetensors: a header of {length} bytes")


def checked_state(path: Path, *, folder: Path, max_bytes: int,
                  reference: dict[str, TensorSpec] | None) -> dict[str, torch.Tensor]:
    """The tensors of the trainer's state file under the module's rules (or TrainerRefused)."""
    size = _regular_file_in(path, folder, max_bytes)
    _header_length(path, size)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:   # safetensors' own errors, a pickle, garbage: all "not safetensors"
        raise TrainerRefused(f"the state file is not safetensors: {type(exc).__name__}: {exc}"[:300]) from None
    if not tensors:
        raise TrainerRefused("the state file holds no tensor")
    if reference is not None:
        got = specs_of(tensors)
        if not any(name.startswith(OPTIM_PREFIX) for name in reference):
            # A start without optimizer state (the first round after a weights-only model): the
            # optimizer's state is the script's to create. The weights still match exactly.
            got = {name: spec for name, spec in got.items() if not name.startswith(OPTIM_PREFIX)}
        missing, extra = sorted(set(reference) - set(got)), sorted(set(got) - set(reference))
        if missing or extra:
            raise TrainerRefused(f"the state's tensors differ from the start state's: missing {missing[:3]}, "
                                 f"extra {extra[:3]}")
        for name, spec in reference.items():
            if got[name] != spec:
                raise TrainerRefused(f"tensor {name!r} is {got[name].dtype}{list(got[name].shape)}, the start "
                                     f"state's is {spec.dtype}{list(spec.shape)}")
    return tensors


def checked_counts(*, steps: int, samples: int, max_steps: int, max_samples_per_step: int,
                   in_step: bool = False) -> None:
    """A round's claimed steps and samples, within what the copy was given (``in_step``: a
    progress report sent during a step, whose samples are counted before the step is)."""
    if steps > max_steps:
        raise TrainerRefused(f"the trainer claims {steps} steps, over the round's budget of {max_steps}")
    if samples > (steps + in_step) * max_samples_per_step:
        raise TrainerRefused(f"the trainer claims {samples} samples in {steps} steps, over "
                             f"{max_samples_per_step} a step")
