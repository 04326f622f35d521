"""A user's training script, as the runtime drives it: one iteration per round.

::

    with hadar_sdk.connect() as run:
        torch.manual_seed(run.seed)              # every copy builds the same initial model
        model = build().to(run.device)
        for rnd in run.rounds():                 # one per round this process is given
            opt = make_optimizer(model)          # fresh each round: never state a warm process kept
            if rnd.restore(model, opt):          # strict: the consolidated weights + averaged state
                rnd.metric("accuracy", evaluate(model), of="start")   # (falsy in the first round)
            sampler = BatchSampler(n, run.batch_size, rnd.stream, run.device)
            for step in rnd.steps():             # total step indices, bounded by the round
                loss = train_step(sampler.indices(step), lr=schedule(step))
                rnd.report(loss=loss, samples=run.batch_size)
            rnd.save(model, opt)                 # tensors only; the harness checks and uploads

Guarantees to the script: :meth:`Round.steps` ends after the round's step budget, at its
deadline, or at a stop (preemption), whichever comes first, and never mid-step; with
several ranks (``torch.distributed`` initialised) every rank ends after the same step.
What the runtime takes from the script is only what goes through this module: progress,
metrics and the saved tensors -- never a claim of which job, round or copy it is.

The runtime also sets the process's share of the machine: :func:`connect` calls
``torch.set_num_threads`` with ``HADAR_THREADS`` (the worker's cores), and on an emulated GPU
(``HADAR_SLOWDOWN`` > 1) :meth:`Round.steps` sleeps ``slowdown - 1`` times each step's own
duration after it, so the script trains at the emulated device's rate.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hadar_sdk._version import __version__
from hadar_sdk.protocol import MAX_LINE, TO_TRAINER, Message, ProtocolError, decode, encode
from hadar_sdk.state import OPTIM_PREFIX, restore_state, state_tensors

__all__ = ["SdkError", "Run", "Round", "Restored", "connect", "START_FILE", "STATE_FILE", "FD_VARIABLE"]

FD_VARIABLE = "HADAR_SDK_FD"
START_FILE = "start.safetensors"   # in Round.inbox: the round's starting state, when it has one
STATE_FILE = "state.safetensors"   # in Round.outbox: what save() writes
REPORT_EVERY_S = 1.0


class SdkError(RuntimeError):
    """The script used the SDK outside its contract, or the harness is gone."""


class _Channel:
    """The socket to the harness; a reader thread turns ``stop`` into a flag at once."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._orders: list[Message] = []
        self._ready = threading.Condition()
        self.stop_requested = threading.Event()
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="hadar-sdk-channel", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                chunk = self._sock.recv(65536)
                if not chunk:
                    break
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = decode(line, allowed=TO_TRAINER)
                    if message.op == "round":   # in the channel's order: a stop is never lost
                        if message.fields.get("stop") is True:   # stopped before it started
                            self.stop_requested.set()
                        else:
                            self.stop_requested.clear()
                    elif message.op == "stop":
                        self.stop_requested.set()
                    with self._ready:
                        self._orders.append(message)
                        self._ready.notify_all()
                if len(buffer) > MAX_LINE:
                    break
        except (OSError, ProtocolError):
            pass
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def next_order(self) -> Message | None:
        """The next ``round`` or ``exit`` (None once the harness closed the channel)."""
        with self._ready:
            while True:
                while self._orders:
                    message = self._orders.pop(0)
                    if message.op != "stop":
                        return message
                if self.closed:
                    return None
                self._ready.wait()

    def send(self, op: str, **fields: object) -> None:
        with self._send_lock:
            try:
                line = encode(op, **fields)
            except ProtocolError as exc:
                raise SdkError(f"cannot send {op}: {exc}") from None
            try:
                self._sock.sendall(line)
            except OSError as exc:
                raise SdkError(f"the harness is gone: {exc}") from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


@dataclass(frozen=True, kw_only=True)
class RoundOrder:
    """What the harness asked for (decoded and bounded by :func:`_order`)."""

    round: int
    copy: int
    rank: int
    world_size: int
    seed: int
    start_steps: int
    max_steps: int
    seconds: float
    has_start: bool
    inbox: Path
    outbox: Path
    data: Path | None


def _order(message: Message) -> RoundOrder:
    data = message.text("data", max_len=4096, optional=True)
    return RoundOrder(round=message.integer("round"), copy=message.integer("copy"), rank=message.integer("rank"),
                      world_size=message.integer("world_size", low=1, high=4096), seed=message.integer("seed"),
                      start_steps=message.integer("start_steps"), max_steps=message.integer("max_steps"),
                      seconds=max(0.0, message.number("seconds") or 0.0),
                      has_start=bool(message.fields.get("has_start")),
                      inbox=Path(message.text("inbox", max_len=4096) or ""),
                      outbox=Path(message.text("outbox", max_len=4096) or ""),
                      data=Path(data) if data else None)


@dataclass(frozen=True)
class Restored:
    """What :meth:`Round.restore` found; true when the round had a start state."""

    start: bool = False        # the round had a start state: it is loaded into the model
    optimizer: bool = False    # ... holding optimizer state (loaded into the optimizer, when one was given)

    def __bool__(self) -> bool:
        return self.start


class Round:
    """One round of this process's copy: read its start, train its steps, save."""

    def __init__(self, channel: _Channel, order: RoundOrder, *, slowdown: float = 1.0) -> None:
        self._channel = channel
        self.order = order
        self.slowdown = slowdown
        self._deadline = time.monotonic() + order.seconds
        self.steps_done = 0
        self.samples = 0
        self.loss: float | None = None
        self._last_report = 0.0
        self._saved = False

    @property
    def stream(self) -> tuple[int, int, int]:
        """The (seed, copy, rank) of this process's batch stream (:class:`~hadar_sdk.BatchSampler`)."""
        return (self.order.seed, self.order.copy, self.order.rank)

    @property
    def start_step(self) -> int:
        """Total steps trained before this round: the first step this round is numbered so."""
        return self.order.start_steps

    @property
    def data_dir(self) -> Path | None:
        """The job's dataset, a read-only local folder (None if the job names none)."""
        return self.order.data

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Restored:
        """Load the round's starting state strictly into ``model`` (and its optimizer state
        into ``optimizer``). The result is false when the round has none (the job's first
        round: keep the seeded initial model); its ``optimizer`` says whether the state held
        optimizer state. Build the optimizer afresh each round, before this: a warm process
        must not carry an earlier round's optimizer state into a start state that has none."""
        if not self.order.has_start:
            return Restored()
        device = next(iter(model.parameters()), torch.empty(0)).device
        with safe_open(str(self.order.inbox / START_FILE), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        restore_state(model, optimizer, tensors)
        model.to(device)
        return Restored(start=True, optimizer=any(name.startswith(OPTIM_PREFIX) for name in tensors))

    def _agree(self, code: int) -> int:
        if self.order.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            backend = torch.distributed.get_backend()
            flag = torch.tensor([code], device="cuda" if backend == "nccl" else "cpu")
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            return int(flag.item())
        return code

    def steps(self) -> Iterator[int]:
        """Total step indices of this round, until its budget, deadline or a stop (throttled
        on an emulated GPU: see the module docstring; a stop cuts the sleep short)."""
        debt = 0.0
        while True:
            code = 0
            if self.steps_done >= self.order.max_steps:
                code = 1
            elif time.monotonic() >= self._deadline:
                code = 2
            elif self._channel.stop_requested.is_set():
                code = 3
            if self._agree(code):
                return
            began = time.monotonic()
            yield self.order.start_steps + self.steps_done
            self.steps_done += 1
            if self.slowdown > 1.0:
                debt += (time.monotonic() - began) * (self.slowdown - 1.0)
                if debt >= 0.001:
                    self._channel.stop_requested.wait(debt)
                    debt = 0.0

    def report(self, *, samples: int, loss: float | None = None) -> None:
        """Count one step's ``samples`` (and its loss); sent to the harness about once a second."""
        self.samples += int(samples)
        if loss is not None:
            self.loss = float(loss)
        now = time.monotonic()
        if now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            self._send_progress()

    def _send_progress(self) -> None:
        loss = self.loss if self.loss is not None and math.isfinite(self.loss) else None
        self._channel.send("progress", steps=self.steps_done, samples=self.samples, loss=loss)

    def metric(self, name: str, value: float, *, of: str = "final") -> None:
        """A held-out figure (``of``: ``"start"`` for the round's starting weights, ``"final"``)."""
        self._channel.send("metric", name=name, value=float(value), of=of)

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Write the round's state (rank 0; tensors only, no metadata) and end the round."""
        if self._saved:
            raise SdkError("save() was already called this round")
        self._saved = True
        if self.order.rank == 0:
            path = self.order.outbox / STATE_FILE
            save_file(state_tensors(model, optimizer), str(path))
        self._send_progress()
        self._channel.send("saved", steps=self.steps_done, samples=self.samples)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    return int(text) if text.isdigit() else default


def _env_slowdown() -> float:
    try:
        value = float(os.environ.get("HADAR_SLOWDOWN", "") or 1.0)
    except ValueError:
        return 1.0
    return value if math.isfinite(value) and value >= 1.0 else 1.0


class Run:
    """The connection of this process to the runtime (:func:`connect`), and the job's
    constants: ``seed`` (build the initial model from it: every copy must start equal),
    ``batch_size`` (samples per step of this rank: report at most that many), ``rank`` /
    ``world_size`` / ``local_rank`` (the torchrun variables, also set in the environment with
    ``MASTER_ADDR`` / ``MASTER_PORT``), ``device`` (``"cuda"`` or ``"cpu"``; with CUDA the
    process sees exactly its own GPU as ``cuda:0``), ``config`` (the job's ``config``
    mapping), ``data_dir`` (the job's dataset, a read-only folder, or None), ``threads`` (the
    CPU threads this process is given; torch already uses that many) and ``slowdown`` (1.0, or
    an emulated GPU's: :meth:`Round.steps` throttles to it)."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self.seed = _env_int("HADAR_SEED", 0)
        self.batch_size = _env_int("HADAR_BATCH_SIZE", 1)
        self.rank = _env_int("RANK", 0)
        self.world_size = max(1, _env_int("WORLD_SIZE", 1))
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.device = "cuda" if os.environ.get("HADAR_DEVICE") == "cuda" else "cpu"
        data = os.environ.get("HADAR_DATA_DIR", "")
        self.data_dir = Path(data) if data else None
        try:
            config = json.loads(os.environ.get("HADAR_CONFIG", "") or "{}")
        except ValueError:
            config = {}
        self.config: dict[str, Any] = config if isinstance(config, dict) else {}
        self.threads = max(1, _env_int("HADAR_THREADS", torch.get_num_threads()))
        self.slowdown = _env_slowdown()

    def rounds(self) -> Iterator[Round]:
        """The rounds this process is given, one at a time, until the runtime says exit."""
        while True:
            message = self._channel.next_order()
            if message is None or message.op == "exit":
                return
            current = Round(self._channel, _order(message), slowdown=self.slowdown)
            yield current
            if not current._saved:
                raise SdkError("a round ended without save(): call Round.save(model, optimizer)")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if error is not None and not isinstance(error, GeneratorExit):
            with contextlib.suppress(SdkError):
                self._channel.send("failed", reason=f"{type(error).__name__}: {error}"[:500])
        self._channel.close()


def connect() -> Run:
    """Connect to the harness that started this process (``HADAR_SDK_FD``), and use the
    ``HADAR_THREADS`` CPU threads it gives (``torch.set_num_threads``)."""
    text = os.environ.get(FD_VARIABLE)
    if not text or not text.isdigit():
        raise SdkError(f"not started by a Hadar agent: {FD_VARIABLE} is not set")
    threads = _env_int("HADAR_THREADS", 0)
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    sock = socket.socket(fileno=int(text))
    channel = _Channel(sock)
    channel.send("hello", sdk=__version__, pid=os.getpid())
    return Run(channel)
