"""What consolidating a forked job's copies costs at a round's end: one rule for policy and simulator.

The live system (``services/agent``, ``services/tracker``): every copy's rank 0 uploads a
checkpoint (weights + optimizer state), the tracker downloads all n of them, averages them
tensor by tensor and writes one model (weights + averaged optimizer state), which the next
round's copies download at their start. Counted here, as the issue states it: n uploads,
n downloads and one write of a checkpoint's bytes, through the object store's bandwidth
(``store_gbps``, GB/s, a deployment parameter: ``hadar sim --store-gbps``, HadarE's
``store_gbps`` option; default 1 GB/s), serialised at the store (the copies' uploads
share its link). A checkpoint holds the FP32 weights and ``optimizer_slots`` state tensors
per parameter (1: SGD with momentum, the zoo's default; 2: Adam) -- ``model_bytes`` is
the weights alone (``shared.domain.workloads.model_bytes``).

A job run as one copy pays nothing here: its checkpoint is the next round's start, as for
any job that is preempted and resumed, and no policy is charged for it.
"""

from __future__ import annotations

from shared.wire.events import DEFAULT_OPTIMIZER_SLOTS

__all__ = ["DEFAULT_STORE_GBPS", "checkpoint_bytes", "consolidation_s"]

DEFAULT_STORE_GBPS = 1.0


def checkpoint_bytes(model_bytes: float, *, optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS) -> float:
    """Bytes of one copy's checkpoint: weights plus ``optimizer_slots`` tensors like them."""
    if model_bytes < 0 or optimizer_slots < 0:
        raise ValueError("model_bytes and optimizer_slots must be >= 0")
    return model_bytes * (1 + optimizer_slots)


def consolidation_s(model_bytes: float, copies: int, *, store_gbps: float = DEFAULT_STORE_GBPS,
                    optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS) -> float:
    """Seconds a round of ``copies`` copies spends consolidating: 0 for one copy, else
    (2 n + 1) checkpoints through ``store_gbps``. Non-decreasing in ``copies``."""
    if copies < 0 or not store_gbps > 0:
        raise ValueError("copies must be >= 0 and store_gbps > 0")
    if copies <= 1:
        return 0.0
    return (2 * copies + 1) * checkpoint_bytes(model_bytes, optimizer_slots=optimizer_slots) / (store_gbps * 1e9)
