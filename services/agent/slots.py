"""Warm worker slots: which worker process runs a copy's rank on a GPU, decided purely.

A *slot* is one GPU (device index) of this node. Its worker process outlives the round:
between rounds it keeps the interpreter, torch, the CUDA context, the data set on the
device and the model built, and takes its next spec on its control channel (stdin). A
copy whose job and GPU stay the same next round therefore costs a checkpoint, the
tracker's consolidation and an in-place reload -- not a new process.

The rules (:func:`on_assign`, :func:`on_done`; no I/O, no clock):

* **Bound by a** :class:`WarmKey`: what the process has built and keeps -- job, model,
  data set, seed, optimizer and learning rate, device, threads, the environment it was
  started with (``CUDA_VISIBLE_DEVICES``). A spec with the same key reuses the process
  (``reuse``); any other key -- another job, another model shape -- ends it and starts a
  fresh one (``respawn``, with the reason). An empty slot spawns (``spawn``, "first use").
* **Only single-rank copies stay warm.** A copy with a rendezvous (DDP, also across
  nodes) runs in a process that exits after its spec, as before: its slot is empty again.
* **A crash empties the slot** and is reported: a worker that exited, failed or was
  killed, or whose spec ended any other way than a clean ``finished`` report, is never
  reused (its state is unknown); the next assignment spawns. ``on_done`` says ``crashed``
  so the shell can log and count it.
* **Never two specs at once:** assigning to a busy slot raises :class:`SlotBusy` (the
  agent's admission already guarantees one copy per GPU, and the daemon starts a copy
  only once the previous holders' runs ended).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from services.agent.spec import WorkerSpec
from shared.errors import HadarError

__all__ = ["WarmKey", "Slot", "SlotBusy", "Decision", "warm_key", "on_assign", "on_done", "EMPTY"]

State = Literal["empty", "idle", "busy"]
Action = Literal["spawn", "reuse", "respawn"]


class SlotBusy(HadarError):
    """A spec was assigned to a slot whose worker still runs one (a bug in the caller: not retriable)."""


@dataclass(frozen=True, kw_only=True)
class WarmKey:
    """What a warm worker keeps built; a spec fits the process iff its key is equal."""

    job_id: str
    model: str
    dataset: str
    seed: int
    optimizer: str
    lr: float
    device: str
    threads: int
    env: tuple[tuple[str, str], ...]


def warm_key(spec: WorkerSpec) -> WarmKey | None:
    """The spec's key, or None if its process must not outlive it (a copy with a rendezvous)."""
    if spec.rendezvous is not None or spec.world_size != 1:
        return None
    return WarmKey(job_id=spec.job_id, model=spec.model, dataset=spec.dataset, seed=spec.seed,
                   optimizer=spec.optimizer, lr=spec.lr, device=spec.device, threads=spec.threads,
                   env=tuple(sorted(spec.env.items())))


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One GPU's worker: ``empty`` (no process), ``idle`` (a live process bound to ``key``,
    waiting for a spec) or ``busy`` (running a spec; ``key`` None: it exits after it)."""

    state: State = "empty"
    key: WarmKey | None = None
    generation: int = 0      # processes started in this slot so far
    specs: int = 0           # specs the current process has taken


EMPTY = Slot()


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    reason: str
    slot: Slot


def _why_not(current: WarmKey, wanted: WarmKey | None) -> str:
    if wanted is None:
        return "the copy has a rendezvous (DDP): its worker does not stay warm"
    if current.job_id != wanted.job_id:
        return f"job changed ({current.job_id} -> {wanted.job_id})"
    if (current.model, current.dataset) != (wanted.model, wanted.dataset):
        return f"model changed ({current.model}/{current.dataset} -> {wanted.model}/{wanted.dataset})"
    return "job settings changed"


def on_assign(slot: Slot, key: WarmKey | None) -> Decision:
    """The slot takes a spec with ``key`` (None: not to be kept warm)."""
    if slot.state == "busy":
        raise SlotBusy("the slot's worker is still running a spec")
    if slot.state == "idle" and slot.key is not None and key == slot.key:
        return Decision(action="reuse", reason="same job and model",
                        slot=replace(slot, state="busy", specs=slot.specs + 1))
    fresh = Slot(state="busy", key=key, generation=slot.generation + 1, specs=1)
    if slot.state == "empty":
        return Decision(action="spawn", reason="first use" if slot.generation == 0 else "slot was empty",
                        slot=fresh)
    assert slot.key is not None
    return Decision(action="respawn", reason=_why_not(slot.key, key), slot=fresh)


@dataclass(frozen=True, kw_only=True)
class Done:
    slot: Slot
    crashed: bool


def on_done(slot: Slot, *, reported: bool, alive: bool) -> Done:
    """The slot's spec ended. ``reported``: the worker sent a clean ``finished``;
    ``alive``: its process still runs. Idle again only if both, and it is a warm one;
    ``crashed`` whenever the spec did not end in a clean report (the slot is emptied)."""
    if slot.state != "busy":
        return Done(slot=slot, crashed=False)
    if reported and alive and slot.key is not None:
        return Done(slot=replace(slot, state="idle"), crashed=False)
    return Done(slot=Slot(generation=slot.generation), crashed=not reported)
