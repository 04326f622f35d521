"""What a simulated round charges each copy and job for moving state: flat, or the data plane.

Two models, chosen by ``SimOptions.data_plane``:

* :class:`FlatCharges` (``data_plane=None``, the default, as in Gavel's and Sia's simulators):
  a copy whose GPU set changed since last round (first placement included) loses
  ``restart_s`` (or its job type's ``restart_s_by_job_type``) at its start; nothing at its end;
  a forked job (n > 1 copies) pays :func:`shared.domain.fork_cost.consolidation_s` through
  ``store_gbps`` at the round's end, a one-copy job nothing.
* :class:`DataPlaneCharges`: every copy and job is charged what the live system does, from
  one measured :class:`~shared.domain.data_plane.DataPlane` (the rules are in that module):
  cold or warm start, every rank loading the round's model, the process group's first
  broadcast, rank 0's upload, and the tracker's consolidation of every round, one copy or
  many.

Checkpoint sizes come from the job type's figures (:func:`checkpoint_figures`): Gavel's job
types (``shared.domain.workloads``) and Sia's applications (``shared.domain.sia_figures``);
a type neither knows has a zero-byte checkpoint and pays only start times.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.sim.sia_table import parse_job_type
from shared.domain import data_plane, fork_cost, workloads
from shared.domain.data_plane import DataPlane
from shared.domain.sia_figures import sia_figures
from shared.domain.workloads import JobFigures
from shared.wire.events import DEFAULT_OPTIMIZER_SLOTS

__all__ = ["Charges", "FlatCharges", "DataPlaneCharges", "checkpoint_figures"]

@functools.cache
def checkpoint_figures(job_type: str) -> tuple[int, int]:
    """(weights bytes, optimizer slots) of ``job_type``; (0, default slots) if unknown."""
    figures: JobFigures | None = None
    try:
        figures = workloads.figures_for(job_type)
    except ValueError:
        sia = parse_job_type(job_type)
        if sia is not None:
            with contextlib.suppress(ValueError):
                figures = sia_figures(sia.application, sia.batch)
    if figures is None:
        return 0, DEFAULT_OPTIMIZER_SLOTS
    return figures.params * 4, figures.optimizer_slots


class Charges(Protocol):
    def copy(self, job_type: str, model_bytes: int, *, ranks_per_node: Sequence[int], cold: bool,
             has_model: bool) -> tuple[float, float]:
        """(start, end): seconds of the round one copy does not train."""

    def consolidation(self, job_type: str, model_bytes: int, *, copies: int, has_model: bool) -> float:
        """Seconds at the round's end the job's model is being made."""

    def first_start_s(self, job_type: str) -> float:
        """The least seconds any copy of a ``job_type`` job loses at its first placement (cold, no
        model yet, on any layout): what the TTD bounds charge every job once (``sim/bounds.py``)."""

    def describe(self) -> str:
        """One line for reports: what this run charged."""


@dataclass(frozen=True, kw_only=True)
class FlatCharges:
    restart_s: float
    restart_s_by_job_type: Mapping[str, float]
    store_gbps: float

    def copy(self, job_type: str, model_bytes: int, *, ranks_per_node: Sequence[int], cold: bool,
             has_model: bool) -> tuple[float, float]:
        return (self.restart_s_by_job_type.get(job_type, self.restart_s) if cold else 0.0), 0.0

    def consolidation(self, job_type: str, model_bytes: int, *, copies: int, has_model: bool) -> float:
        return fork_cost.consolidation_s(model_bytes, copies, store_gbps=self.store_gbps)

    def first_start_s(self, job_type: str) -> float:
        return self.restart_s_by_job_type.get(job_type, self.restart_s)

    def describe(self) -> str:
        restart = "each application's own" if self.restart_s_by_job_type else f"{self.restart_s:g} s"
        return (f"flat: restart {restart} per re-placed copy; forked jobs' consolidation through "
                f"{self.store_gbps:g} GB/s; nothing else")


@dataclass(frozen=True, kw_only=True)
class DataPlaneCharges:
    plane: DataPlane

    def copy(self, job_type: str, model_bytes: int, *, ranks_per_node: Sequence[int], cold: bool,
             has_model: bool) -> tuple[float, float]:
        slots = checkpoint_figures(job_type)[1]
        return data_plane.copy_charges(
            self.plane, checkpoint_bytes=fork_cost.checkpoint_bytes(model_bytes, optimizer_slots=slots),
            weights_bytes=model_bytes, ranks_per_node=ranks_per_node, cold=cold, has_model=has_model)

    def consolidation(self, job_type: str, model_bytes: int, *, copies: int, has_model: bool) -> float:
        slots = checkpoint_figures(job_type)[1]
        return data_plane.consolidation_s(
            self.plane, checkpoint_bytes=fork_cost.checkpoint_bytes(model_bytes, optimizer_slots=slots),
            copies=copies, has_model=has_model)

    def first_start_s(self, job_type: str) -> float:
        # data_plane.copy_charges, cold without a model: the process start, plus a broadcast
        # that a one-rank copy does not make
        return self.plane.process_start_s

    def describe(self) -> str:
        p = self.plane
        return (f"data plane: start {p.process_start_s:g} s cold / {p.warm_start_s:g} s warm, store "
                f"{p.store_upload_gbps:g} GB/s up / {p.store_download_gbps:g} down, averaging "
                f"{p.consolidate_gbps:g} GB/s, collectives {p.intra_node_gbps:g} GB/s in a node / "
                f"{p.inter_node_gbps:g} across ({p.source})")
