"""Warm worker slots: which worker process runs a copy's rank on a GPU, decided purely.

A *slot* is one GPU (device index) of this node. Its worker process outlives the round:
between rounds it keeps the interpreter, torch, the CUDA context, the data set on the
device, the model built and -- for a rank of a DDP copy -- its process group, and takes
its next spec on its control channel (stdin). A copy whose job, GPUs and rank set stay
the same next round therefore costs a checkpoint, the tracker's consolidation and an
in-place reload on every rank -- not new processes and a new rendezvous.

The rules (:func:`on_assign_copy`, :func:`on_copy_done`, built on the one-slot
:func:`on_assign` and :func:`on_done`; no I/O, no clock):

* **Bound by a** :class:`WarmKey`: what the process has built and keeps -- job, model,
  data set, seed, optimizer and learning rate, device, threads, the environment it was
  started with (``CUDA_VISIBLE_DEVICES``) and its place in the copy's process group: rank,
  world size, this node's (GPU, rank) pairs and the node of every rank (``peers``). A spec
  with the same key reuses the process (``reuse``); any other key -- another job, model,
  rank set, peer set or GPU -- ends it and starts a fresh one (``respawn``, with the
  reason). An empty slot spawns (``spawn``, "first use").
* **The rendezvous address is not in the key.** It is used only to form a group; a kept
  group never rendezvouses again, so the agent may pick a new port every round. The
  peers are: every node of a spanning copy reads the same ``peers`` from the round's
  Assignments, so all of them keep their ranks' processes or all replace them -- unless
  one node lost its processes (a crash, an agent restart): then it spawns while the
  others reuse, the kept ranks fail their start check (bounded, see
  :mod:`services.agent.worker.session`), the round is lost for the copy, and next round every
  node spawns. A copy whose ranks' nodes are not known (a spanning copy whose Assignment
  names no ``peers``) has no key: its processes exit after the spec, as before.
* **A copy's ranks on this node move together** (:func:`on_assign_copy`): either every
  rank reuses its process or none does -- a rank whose process must be replaced takes its
  peers' processes with it (``respawn``, "a peer rank needs a new process"), because a
  fresh process cannot join a group that already exists.
* **A group is kept whole or not at all** (:func:`stale_peers`): when a DDP rank's process
  is replaced, the idle processes of its copy's other ranks here (bound to the same group)
  can never be used again and are retired too, not left holding memory.
* **A crash empties the slot** and is reported: a worker that exited, failed or was
  killed, or whose spec ended any other way than a clean ``finished`` report, is never
  reused (its state is unknown); the next assignment spawns. ``on_done`` says ``crashed``
  so the shell can log and count it. For a DDP copy (:func:`on_copy_done`) one rank that
  did not end cleanly empties every rank's slot of the copy on this node: the survivors'
  group has lost a member, so they are torn down (``torn_down``; the shell ends them) and
  respawn next time. A rank on another node that crashed or went away makes this node's
  ranks fail in their next collective (bounded by the worker's timeouts), which is a
  crash here too.
* **Never two specs at once:** assigning to a busy slot raises :class:`SlotBusy` (the
  agent's admission already guarantees one copy per GPU, and the daemon starts a copy
  only once the previous holders' runs ended).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from services.agent.protocol import WorkerSpec
from shared.errors import HadarError

__all__ = ["WarmKey", "Slot", "SlotBusy", "Decision", "Done", "warm_key", "on_assign", "on_done",
           "on_assign_copy", "on_copy_done", "stale_peers", "EMPTY"]

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
    rank: int = 0
    world_size: int = 1
    local: tuple[tuple[int, int], ...] = ()   # (GPU, rank) of each of the copy's ranks on this node
    peers: tuple[str, ...] = ()               # the node of each rank, in rank order (DDP only)
    code: tuple[str, ...] = ()                # user code: bundle, entrypoint, args, config, data it runs


def warm_key(spec: WorkerSpec) -> WarmKey | None:
    """The spec's key, or None if its process must not outlive it (a DDP rank whose
    copy's layout -- this node's GPUs and ranks, every rank's node -- is not known)."""
    base: dict[str, Any] = dict(job_id=spec.job_id, model=spec.model, dataset=spec.dataset, seed=spec.seed,
                optimizer=spec.optimizer, lr=spec.lr, device=spec.device, threads=spec.threads,
                env=tuple(sorted(spec.env.items())))
    if spec.code is not None:   # the trainer process runs exactly one script with one configuration
        c = spec.code
        base["code"] = (c.user, c.digest, c.entrypoint, json.dumps(list(c.args)), c.config, c.data_digest,
                        str(c.sandbox))
    if spec.rendezvous is None:
        return WarmKey(**base) if spec.world_size == 1 else None
    local = tuple(zip(spec.local_gpus, spec.local_ranks, strict=True))
    if (not local or spec.rank not in spec.local_ranks or len(spec.peers) != spec.world_size
            or any(spec.peers[r] != spec.node_id for r in spec.local_ranks)):
        return None
    return WarmKey(**base, rank=spec.rank, world_size=spec.world_size, local=local, peers=spec.peers)


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
        return "the copy's rank layout is not known (a spanning copy without peers): its worker does not stay warm"
    if current.job_id != wanted.job_id:
        return f"job changed ({current.job_id} -> {wanted.job_id})"
    if (current.model, current.dataset) != (wanted.model, wanted.dataset):
        return f"model changed ({current.model}/{current.dataset} -> {wanted.model}/{wanted.dataset})"
    if current.world_size != wanted.world_size:
        return f"world size changed ({current.world_size} -> {wanted.world_size})"
    if (current.rank, current.local) != (wanted.rank, wanted.local):
        return f"rank set changed (rank {current.rank} -> {wanted.rank}, (gpu, rank) here " \
               f"{list(current.local)} -> {list(wanted.local)})"
    if current.peers != wanted.peers:
        return f"peers changed ({list(current.peers)} -> {list(wanted.peers)})"
    return "job settings changed"


def on_assign(slot: Slot, key: WarmKey | None) -> Decision:
    """The slot takes a spec with ``key`` (None: not to be kept warm)."""
    if slot.state == "busy":
        raise SlotBusy("the slot's worker is still running a spec")
    if slot.state == "idle" and slot.key is not None and key == slot.key:
        return Decision(action="reuse", reason="same job, model and rank set",
                        slot=replace(slot, state="busy", specs=slot.specs + 1))
    fresh = Slot(state="busy", key=key, generation=slot.generation + 1, specs=1)
    if slot.state == "empty":
        return Decision(action="spawn", reason="first use" if slot.generation == 0 else "slot was empty",
                        slot=fresh)
    assert slot.key is not None
    return Decision(action="respawn", reason=_why_not(slot.key, key), slot=fresh)


def on_assign_copy(slots: Sequence[Slot], keys: Sequence[WarmKey | None]) -> list[Decision]:
    """The slots of one copy's ranks on this node take their specs: :func:`on_assign` for
    each, except that if any rank needs a new process, every rank gets one (module rules)."""
    if len(slots) != len(keys):
        raise ValueError(f"{len(slots)} slots for {len(keys)} ranks")
    decisions = [on_assign(slot, key) for slot, key in zip(slots, keys, strict=True)]
    if len(decisions) < 2 or all(d.action == "reuse" for d in decisions) \
            or all(d.action != "reuse" for d in decisions):
        return decisions
    fresh = [Decision(action="respawn", reason="a peer rank needs a new process (a group cannot be rejoined)",
                      slot=Slot(state="busy", key=key, generation=slot.generation + 1, specs=1))
             for slot, key in zip(slots, keys, strict=True)]
    return [d if d.action != "reuse" else f for d, f in zip(decisions, fresh, strict=True)]


@dataclass(frozen=True, kw_only=True)
class Done:
    slot: Slot
    crashed: bool            # the spec did not end in a clean report
    torn_down: bool = False  # ended cleanly, but a peer rank of its copy did not: the process must go


def on_done(slot: Slot, *, reported: bool, alive: bool) -> Done:
    """The slot's spec ended. ``reported``: the worker sent a clean ``finished``;
    ``alive``: its process still runs. Idle again only if both, and it is a warm one;
    ``crashed`` whenever the spec did not end in a clean report (the slot is emptied)."""
    if slot.state != "busy":
        return Done(slot=slot, crashed=False)
    if reported and alive and slot.key is not None:
        return Done(slot=replace(slot, state="idle"), crashed=False)
    return Done(slot=Slot(generation=slot.generation), crashed=not reported)


def on_copy_done(slots: Sequence[Slot], *, reported: Sequence[bool], alive: Sequence[bool]) -> list[Done]:
    """The spec of each of one copy's ranks on this node ended: :func:`on_done` for each,
    except that a DDP copy keeps its processes only if every rank stays idle (module rules)."""
    done = [on_done(s, reported=r, alive=a) for s, r, a in zip(slots, reported, alive, strict=True)]
    if all(d.slot.state == "idle" for d in done) or all(d.slot.state != "idle" for d in done):
        return done
    return [d if d.slot.state != "idle" else Done(slot=Slot(generation=d.slot.generation), crashed=False,
                                                   torn_down=True) for d in done]


def stale_peers(slots: Mapping[int, Slot], replaced: Sequence[int]) -> list[int]:
    """The idle slots whose process is in the same process group as one of the processes
    being replaced in ``replaced`` (module rules): those must be retired with them."""
    stale = []
    for index in replaced:
        key = slots[index].key if index in slots else None
        if key is None or key.world_size == 1:
            continue
        for gpu, _ in key.local:
            other = slots.get(gpu)
            if (gpu not in replaced and gpu not in stale and other is not None and other.state == "idle"
                    and other.key is not None and _same_group(other.key, key)):
                stale.append(gpu)
    return sorted(stale)


def _same_group(a: WarmKey, b: WarmKey) -> bool:
    return (a.job_id, a.world_size, a.local, a.peers) == (b.job_id, b.world_size, b.local, b.peers)
