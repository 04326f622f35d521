"""What a user's trainer is started with: its settings, environment, folders and sandbox.

* **Environment** (:func:`trainer_environment`): rebuilt from nothing -- ``PATH``, ``HOME``
  and ``TMPDIR`` in the trainer's own scratch folder, ``PYTHONPATH`` holding only
  ``hadar_sdk``, the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``), ``HADAR_SDK_FD``, the job's constants (``HADAR_SEED``,
  ``HADAR_BATCH_SIZE``, ``HADAR_DEVICE``, ``HADAR_CONFIG``, ``HADAR_DATA_DIR``), the worker's
  share of the machine (``HADAR_THREADS`` and ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS``: :attr:`TrainerLaunch.threads`; ``HADAR_SLOWDOWN``: an emulated
  GPU's), and only the names in :attr:`TrainerLaunch.passthrough` (device selection). No Kafka
  or S3 setting, no ``*_FILE`` secret path reaches it.
* **Scratch** (:class:`Scratch`): the trainer writes ``home``, ``tmp`` and ``outbox``; it
  reads ``inbox`` (the round's start state) and ``sdk`` (a link to ``hadar_sdk``); the
  harness's ``received`` (states taken out of the outbox) it cannot reach.
* **Sandbox policy** (:func:`sandbox_policy`): read the interpreter, the system libraries,
  ``hadar_sdk``, the code bundle, the dataset and the inbox; write ``home``, ``tmp`` and the
  outbox; TCP only for several ranks.
* **Command** (:func:`launcher_command`): the launcher (:mod:`services.agent.usercode.launch`)
  with the limits and the policy, then the interpreter and the code bundle's entrypoint.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import hadar_sdk
from hadar_sdk.run import FD_VARIABLE
from services.agent.usercode import launch
from services.agent.usercode.checks import TrainerRefused
from services.agent.usercode.sandbox import SandboxPolicy, trainer_policy

__all__ = ["SDK_DIR", "THREAD_VARIABLES", "TrainerLimits", "TrainerLaunch", "Scratch", "trainer_environment",
           "sandbox_policy", "prepare_scratch", "launcher_command"]

SDK_DIR = Path(hadar_sdk.__file__).resolve().parent   # the one folder of the checkout a trainer may read
THREAD_VARIABLES = ("HADAR_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True, kw_only=True)
class TrainerLimits:
    open_files: int = 1024
    file_bytes: int = 8 << 30
    address_space_bytes: int = 0        # 0: unlimited (CUDA reserves large virtual ranges)
    state_bytes: int = 4 << 30          # the largest state file accepted
    hello_s: float = 120.0              # to import torch and the script, and connect
    stop_grace_s: float = 10.0          # after the stop: finish the step and save
    term_grace_s: float = 5.0           # after SIGTERM, before SIGKILL
    log_bytes: int = 64 << 10


@dataclass(frozen=True, kw_only=True)
class TrainerLaunch:
    code_dir: Path
    entrypoint: str                     # a path relative to code_dir
    scratch: Path                       # the harness's; the trainer writes only home, tmp, outbox in it
    seed: int
    args: tuple[str, ...] = ()
    rank: int = 0
    world_size: int = 1                 # > 1: TCP is allowed (gloo/NCCL rendezvous and ephemeral ports)
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    batch_size: int = 1
    device: str = "cpu"
    config: str = ""                    # the job's config, JSON text
    data_dir: Path | None = None        # read-only to the trainer; RoundRequest.data_dir must lie within
    sandbox: bool = True                # False: no Landlock, seccomp or capability drop (insecure, development only)
    run_as: tuple[int, int] | None = None
    passthrough: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)
    python: str = sys.executable
    threads: int = 1                    # the worker's cores: OpenMP/MKL/OpenBLAS threads, torch.set_num_threads
    slowdown: float = 1.0               # an emulated GPU's: the SDK trains each step this many times slower

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, not {self.threads}")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ValueError(f"slowdown must be a finite number of at least 1, not {self.slowdown}")


@dataclass(frozen=True)
class Scratch:
    """The folders of a trainer's scratch (see the module docstring)."""

    root: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def outbox(self) -> Path:
        return self.root / "outbox"

    @property
    def sdk(self) -> Path:
        return self.root / "sdk"

    @property
    def received(self) -> Path:
        return self.root / "received"


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return upper.startswith(("HADAR_", "AWS_", "MINIO_", "KAFKA_")) or any(
        word in upper for word in ("SECRET", "PASSWORD", "TOKEN", "KEY", "CREDENTIAL"))


def trainer_environment(launch_: TrainerLaunch, child_fd: int) -> dict[str, str]:
    """The trainer's whole environment (see the module docstring)."""
    scratch = Scratch(launch_.scratch)
    env = {"PATH": os.defpath, "HOME": str(scratch.home), "TMPDIR": str(scratch.tmp),
           "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(scratch.sdk), FD_VARIABLE: str(child_fd), "HADAR_SEED": str(launch_.seed),
           "RANK": str(launch_.rank), "WORLD_SIZE": str(launch_.world_size),
           "LOCAL_RANK": str(launch_.local_rank), "MASTER_ADDR": launch_.master_addr,
           "MASTER_PORT": str(launch_.master_port), "HADAR_BATCH_SIZE": str(launch_.batch_size),
           "HADAR_DEVICE": launch_.device, "HADAR_CONFIG": launch_.config,
           "HADAR_DATA_DIR": str(launch_.data_dir) if launch_.data_dir is not None else "",
           "HADAR_SLOWDOWN": repr(float(launch_.slowdown))}
    for name in launch_.passthrough:
        if name in os.environ and not looks_secret(name):
            env[name] = os.environ[name]
    for name in THREAD_VARIABLES:   # the harness's count, whatever passthrough brought
        env[name] = str(launch_.threads)
    return env


def sandbox_policy(launch_: TrainerLaunch) -> SandboxPolicy:
    """What the trainer may touch (:func:`~services.agent.usercode.sandbox.trainer_policy`)."""
    scratch = Scratch(launch_.scratch)
    data = (launch_.data_dir,) if launch_.data_dir is not None else ()
    return trainer_policy(read_only=(launch_.code_dir, SDK_DIR, scratch.sdk, scratch.inbox, *data),
                          read_write=(scratch.home, scratch.tmp, scratch.outbox),
                          allow_network=launch_.world_size > 1, python=launch_.python)


def prepare_scratch(launch_: TrainerLaunch) -> None:
    """Create the scratch's folders with their owners and modes, and the link to ``hadar_sdk``."""
    scratch, run_as = Scratch(launch_.scratch), launch_.run_as
    scratch.root.mkdir(parents=True, exist_ok=True)
    os.chmod(scratch.root, 0o711)
    for folder in (scratch.home, scratch.tmp, scratch.outbox):   # the trainer's
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o700)
        if run_as is not None:
            os.chown(folder, *run_as)
    for folder, mode in ((scratch.inbox, 0o750), (scratch.sdk, 0o755), (scratch.received, 0o700)):   # ours
        folder.mkdir(exist_ok=True)
        os.chmod(folder, mode if run_as is not None else 0o700)
        if run_as is not None and folder == scratch.inbox:
            os.chown(folder, -1, run_as[1])
    link = scratch.sdk / "hadar_sdk"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(SDK_DIR, target_is_directory=True)


def launcher_command(launch_: TrainerLaunch, limits: TrainerLimits, policy: SandboxPolicy | None) -> list[str]:
    """The command that starts the trainer (TrainerRefused for an entrypoint outside the bundle)."""
    entry = (launch_.code_dir / launch_.entrypoint).resolve()
    if not entry.is_relative_to(launch_.code_dir.resolve()) or not entry.is_file():
        raise TrainerRefused(f"entrypoint {launch_.entrypoint!r} is not a file of the code bundle")
    sandbox = ["--sandbox-json", policy.to_json()] if policy is not None else ["--no-sandbox"]
    return [launch_.python, "-s", launch.__file__, "--nofile", str(limits.open_files),
            "--fsize", str(limits.file_bytes), "--as-bytes", str(limits.address_space_bytes), *sandbox,
            "--", launch_.python, "-s", str(entry), *launch_.args]
