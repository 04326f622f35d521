"""What devices this node offers: CUDA GPUs mapped to catalog types, the CPU, or emulated GPUs.

* CUDA present: one device per visible GPU, typed by ``shared.domain.gpus.normalize_gpu_name``;
  a GPU the catalog does not know keeps a sanitised form of its own name (and the
  profiler will have no hardware figures for it until it measures). Each device's
  ``CUDA_VISIBLE_DEVICES`` value for its worker honours the agent's own
  ``CUDA_VISIBLE_DEVICES`` (index i is the i-th GPU the agent sees).
  Under docker swarm the GPUs the task was assigned (generic resources) arrive as
  ``DOCKER_RESOURCE_<KIND>`` (e.g. ``DOCKER_RESOURCE_NVIDIA-GPU=GPU-1a2b...,GPU-3c4d...``);
  when ``CUDA_VISIBLE_DEVICES`` is not set, :func:`assigned_gpus` makes them the agent's
  ``CUDA_VISIBLE_DEVICES`` (CUDA takes GPU UUIDs there), so the agent uses exactly the
  GPUs swarm reserved for it even where the runtime exposes every GPU.
* No CUDA: one device of type ``cpu``.
* ``--emulate``: see :mod:`services.agent.daemon.emulation`.

``python -m services.agent.daemon.discovery`` prints the discovered devices as JSON; the daemon
runs discovery that way so that it never creates a CUDA context itself (a context holds
GPU memory the workers need).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Literal

from services.agent.daemon.emulation import emulated_gpus
from shared.wire.events import GpuInfo

__all__ = ["NodeDevices", "discover", "discover_in_subprocess", "cpu_devices", "emulated_devices"]

DeviceKind = Literal["cuda", "cpu", "emulated"]


@dataclass(frozen=True, kw_only=True)
class NodeDevices:
    """The devices a node registers, and how its workers use each of them."""

    kind: DeviceKind
    gpus: tuple[GpuInfo, ...]
    slowdown: Mapping[int, float] = field(default_factory=dict)   # emulated: index -> factor
    visible: Mapping[int, str] = field(default_factory=dict)      # cuda: index -> CUDA_VISIBLE_DEVICES
    reference: str = ""   # emulated: the type slowdowns are relative to ("" = the catalog's default)

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"

    @property
    def worker_device(self) -> Literal["cpu", "cuda"]:
        return "cuda" if self.kind == "cuda" else "cpu"

    def by_index(self) -> dict[int, GpuInfo]:
        return {g.index: g for g in self.gpus}

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "gpus": [[g.index, g.type, g.memory_gb] for g in self.gpus],
                           "slowdown": {str(k): v for k, v in self.slowdown.items()},
                           "visible": {str(k): v for k, v in self.visible.items()},
                           "reference": self.reference})

    @classmethod
    def from_json(cls, text: str) -> NodeDevices:
        data = json.loads(text)
        return cls(kind=data["kind"],
                   gpus=tuple(GpuInfo(index=i, type=t, memory_gb=m) for i, t, m in data["gpus"]),
                   slowdown={int(k): float(v) for k, v in data["slowdown"].items()},
                   visible={int(k): str(v) for k, v in data["visible"].items()},
                   reference=str(data.get("reference", "")))


def _memory_gb() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return 0.0


def cpu_devices(count: int = 1) -> NodeDevices:
    """A node without CUDA: ``count`` devices of type ``cpu`` (default one)."""
    return NodeDevices(kind="cpu", gpus=tuple(GpuInfo(index=i, type="cpu", memory_gb=_memory_gb())
                                              for i in range(count)))


def emulated_devices(spec: tuple[tuple[str, int], ...], reference: str | None = None) -> NodeDevices:
    """Devices emulating ``spec``, throttled relative to ``reference`` (None: the catalog's default)."""
    devices = emulated_gpus(spec, reference)
    return NodeDevices(kind="emulated", gpus=tuple(d.info for d in devices),
                       slowdown={d.info.index: d.slowdown for d in devices}, reference=reference or "")


def gpu_type_of(device_name: str) -> str:
    """Catalog type of a CUDA device name, else a sanitised form of the name (<= 32 chars)."""
    from shared.domain.gpus import normalize_gpu_name

    known = normalize_gpu_name(device_name)
    if known is not None:
        return known
    cleaned = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return (cleaned or "unknown-gpu")[:32]


def assigned_gpus(env: Mapping[str, str] = os.environ) -> str | None:
    """The GPUs swarm assigned this task (``DOCKER_RESOURCE_*GPU*``), comma-separated;
    ``None`` outside swarm. Several GPU kinds are joined in the variables' name order."""
    found = [env[name] for name in sorted(env) if name.startswith("DOCKER_RESOURCE_") and "GPU" in name.upper()
             and env[name].strip()]
    return ",".join(found) if found else None


def apply_assigned_gpus(env: MutableMapping[str, str]) -> None:
    """Set ``CUDA_VISIBLE_DEVICES`` in ``env`` to the swarm-assigned GPUs unless it is set."""
    assigned = assigned_gpus(env)
    if assigned and not env.get("CUDA_VISIBLE_DEVICES"):
        env["CUDA_VISIBLE_DEVICES"] = assigned


def discover(env: Mapping[str, str] = os.environ) -> NodeDevices:
    """Devices of this machine, queried through torch (creates a CUDA context if CUDA exists)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return cpu_devices()
    parent = [v.strip() for v in (env.get("CUDA_VISIBLE_DEVICES") or assigned_gpus(env) or "").split(",")
              if v.strip()]
    gpus, visible = [], {}
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GpuInfo(index=i, type=gpu_type_of(props.name), memory_gb=round(props.total_memory / 2**30, 1)))
        visible[i] = parent[i] if i < len(parent) else str(i)
    return NodeDevices(kind="cuda", gpus=tuple(gpus), visible=visible)


async def discover_in_subprocess(python: str = sys.executable, timeout_s: float = 120.0) -> NodeDevices:
    """:func:`discover` run in a child process, so this process never touches CUDA."""
    proc = await asyncio.create_subprocess_exec(python, "-m", "services.agent.daemon.discovery",
                                                stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"device discovery did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"device discovery failed (exit code {proc.returncode})")
    return NodeDevices.from_json(out.decode().strip().splitlines()[-1])


if __name__ == "__main__":
    apply_assigned_gpus(os.environ)   # before torch initialises CUDA
    print(discover().to_json())
