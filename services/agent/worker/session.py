"""What a warm worker process keeps between specs: store client, device, data, model and,
for a DDP rank, its process group.

:class:`Session` is built by a worker's first spec and reused by the next ones of the same
warm key (:mod:`services.agent.slots`). For a rank of a DDP copy it holds a
:class:`RankGroup` -- the ``torch.distributed`` default group, the ``DistributedDataParallel``
wrapper of the session's model and, on CUDA, a gloo group for the loop's per-step stop
code -- formed once by :func:`open_group` at the spec's rendezvous and kept while the
copy's rank set stays the same: a kept group never rendezvouses again.

Every spec of a DDP rank starts with :func:`agree_start`, one collective in which all
ranks compare what they are about to run -- job, round, copy, world size, step budget,
start model -- and a digest of the weights each loaded (:func:`state_digest`). It fails
(and with it the spec, which is reported ``failed``; the process then exits) when the
ranks disagree, or when a peer does not arrive within the round's deadline plus
``AGREE_GRACE_S`` (a peer on another node whose process went away, or that was not kept):
a warm group that no longer matches is torn down, never trained in.

Collectives after that use the group's own timeout, set when it was formed: the first
round's deadline plus ``GROUP_GRACE_S``, at least ``GROUP_MIN_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from services.agent.protocol import StoreTarget, WorkerSpec
from services.agent.slots import WarmKey
from shared.store import ObjectStore
from shared.zoo import Dataset

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["StoreClient", "Session", "RankGroup", "on_device", "open_group", "agree_start", "state_digest",
           "close_group", "AGREE_GRACE_S", "GROUP_GRACE_S", "GROUP_MIN_TIMEOUT_S"]

AGREE_GRACE_S = 30.0        # a peer may arrive this long after the round's deadline, no later
GROUP_GRACE_S = 60.0
GROUP_MIN_TIMEOUT_S = 60.0


class StoreClient:
    """Blocking façade over the async store, for this synchronous process."""

    def __init__(self, target: StoreTarget) -> None:
        self._loop = asyncio.new_event_loop()
        self._store: ObjectStore = target.open()
        self._loop.run_until_complete(self._store.start())

    def exists(self, key: str) -> bool:
        return self._loop.run_until_complete(self._store.exists(key))

    def get_file(self, key: str, path: Path) -> None:
        self._loop.run_until_complete(self._store.get_file(key, path))

    def put_file(self, key: str, path: Path) -> None:
        self._loop.run_until_complete(self._store.put_file(key, path))

    def close(self) -> None:
        try:
            self._loop.run_until_complete(self._store.stop())
        finally:
            self._loop.close()


@dataclass(kw_only=True)
class RankGroup:
    """A DDP rank's process group, kept with its session."""

    ddp: nn.Module                 # DistributedDataParallel over the session's model
    control: ProcessGroup | None   # gloo group for the stop code (CUDA); None: the default group
    formed_round: int              # the round whose spec formed it


@dataclass(kw_only=True)
class Session:
    """What a warm worker keeps between specs of one job (built by the first)."""

    key: WarmKey | None
    device: torch.device
    data: Dataset
    model: nn.Module
    store: StoreClient
    store_target: str
    trained: bool = False     # the model has moved away from the seed's weights
    group: RankGroup | None = None

    def close(self) -> None:
        self.group = None
        close_group()
        self.store.close()


def on_device(data: Dataset, device: torch.device) -> Dataset:
    """The data set with its training tensors moved to ``device`` once, not every round."""
    if device.type == "cpu":
        return data
    return Dataset(info=data.info, train_x=data.train_x.to(device), train_y=data.train_y.to(device),
                   test_x=data.test_x, test_y=data.test_y)


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and bytes: equal iff the weights are."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy stubs: a buffer on 3.12+
    return h.hexdigest()


def open_group(spec: WorkerSpec, model: nn.Module, device: torch.device, now: float) -> RankGroup:
    """Form the copy's process group at the spec's rendezvous and wrap ``model`` in DDP
    (which makes every rank start from rank 0's weights)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    assert spec.rendezvous is not None
    backend = "nccl" if device.type == "cuda" else "gloo"
    wait_s = max(GROUP_MIN_TIMEOUT_S, spec.deadline - now + GROUP_GRACE_S)
    dist.init_process_group(backend, init_method=f"tcp://{spec.rendezvous}", rank=spec.rank,
                            world_size=spec.world_size, timeout=timedelta(seconds=wait_s))
    # a group of every rank: never NON_GROUP_MEMBER (-100), which new_group returns to a rank outside it
    control = cast("ProcessGroup", dist.new_group(backend="gloo")) if backend == "nccl" else None
    wrapped = DistributedDataParallel(model, device_ids=[0] if device.type == "cuda" else None)
    return RankGroup(ddp=wrapped, control=control, formed_round=spec.round)


def _fingerprint(spec: WorkerSpec) -> int:
    text = f"{spec.job_id}/{spec.round}/{spec.copy}/{spec.world_size}/{spec.step_budget}/{spec.start_from}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def agree_start(spec: WorkerSpec, group: RankGroup, digest: str, now: float) -> None:
    """Check, with every rank of the group, that all run this spec from the same weights
    (module rules); RuntimeError if not, or if a peer is not there in time."""
    import torch.distributed as dist

    mine = torch.tensor([_fingerprint(spec), int(digest[:14], 16)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(spec.world_size)]
    wait_s = max(AGREE_GRACE_S, spec.deadline - now + AGREE_GRACE_S)
    work = dist.all_gather(gathered, mine, group=group.control, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=wait_s))
    except RuntimeError as exc:
        raise RuntimeError(f"the copy's ranks did not all start round {spec.round} within {wait_s:.0f} s "
                           f"(a peer is gone or runs something else): {exc}"[:400]) from None
    for rank, (spec_id, weights) in enumerate(t.tolist() for t in gathered):
        if spec_id != mine[0].item():
            raise RuntimeError(f"rank {rank} runs another spec than rank {spec.rank} "
                               f"({spec.job_id}/{spec.round}/{spec.copy}): the group no longer matches the copy")
        if weights != mine[1].item():
            raise RuntimeError(f"rank {rank} loaded other start weights than rank {spec.rank}")


def close_group() -> None:
    """Leave the process group, if this process is in one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
