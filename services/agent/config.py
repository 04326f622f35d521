"""The agent's settings (:class:`AgentConfig`), validated whatever builds them."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from services.agent.daemon.emulation import parse_emulation
from shared.domain.gpus import GPU_TYPES
from shared.runtime.config import FieldError
from shared.wire.events import NODE_ID_RE

__all__ = ["AgentConfig"]


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """The agent's settings; ``hadar serve agent`` loads them with
    :func:`shared.runtime.config.load_config` from flags, the environment (``HADAR_NODE_ID``,
    ``HADAR_NODE_ADDRESS``, else ``HADAR_AGENT_<FIELD>``) and a ``--config`` file.

    ``emulate``, ``emulate_reference`` and ``cpu_devices`` choose the devices the CLI
    hands the daemon (see :meth:`emulation`); the daemon itself uses the rest. An invalid
    value raises :class:`~shared.runtime.config.FieldError` naming the field.
    """

    node_id: str = field(metadata={"env": "HADAR_NODE_ID"})
    address: str = field(default="", metadata={"env": "HADAR_NODE_ADDRESS"})  # DDP rendezvous host ("" = node id)
    heartbeat_s: float = 5.0
    progress_s: float = 2.0
    stop_timeout_s: float = 30.0    # SIGTERM -> SIGKILL for a preempted worker
    deadline_grace_s: float = 30.0  # a worker still running this long after its deadline is preempted
    upload_grace_s: float = 120.0   # a worker uploading its checkpoint is not killed for this long
    #                                 (the store retries an outage for 90 s: OUTAGE_RETRY_S)
    threads: int = 1                # torch threads per worker
    spare_workers: int = 1          # warm worker processes kept ready
    python: str = sys.executable
    emulate: str | None = None      # TYPE:N[,TYPE:N...]: emulated GPUs on the CPU (None or "": discover)
    emulate_reference: str | None = None   # the type emulated at full CPU speed (None: fastest in the catalog)
    cpu_devices: int = 1            # devices a machine without CUDA offers
    # Hostile input and outages (services/agent/daemon/admission.py, services/agent/daemon/result_expiry.py):
    max_round_leap: int = 8         # rounds ahead of the believed one that one event may move it
    max_deadline_ahead_s: float = 86_400.0   # an assignment's deadline may lie at most this far ahead
    result_retry_s: float = 0.5     # first wait before publishing a result again; doubles ...
    result_retry_max_s: float = 5.0  # ... up to this
    result_ttl_s: float = 3600.0    # a result is given up this long after deadline + grace, once a newer round exists
    # Users' own code (services/agent/worker/user_job.py): where this node caches code and data
    # bundles ("" = ~/.cache/hadar/agent/<node>/bundles), at most how many bytes, and whether the
    # trainer runs in the Landlock sandbox (False only to develop on a kernel without it: insecure).
    cache_dir: str = ""
    cache_bytes: int = 20 << 30
    trainer_sandbox: bool = True
    # Digests of what this node wrote at its copies' checkpoint keys: a copy resumes mid-round only
    # from its own bytes (services/agent/worker/ledger.py; "" = ~/.cache/hadar/agent/<node>/written).
    ledger_dir: str = ""

    def __post_init__(self) -> None:
        if not NODE_ID_RE.fullmatch(self.node_id):
            raise FieldError("node_id", f"{self.node_id!r} must be 1-63 letters, digits, '.', '_', '-'")
        for name in ("heartbeat_s", "progress_s", "stop_timeout_s", "max_deadline_ahead_s", "result_retry_s"):
            if not getattr(self, name) > 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("deadline_grace_s", "upload_grace_s"):
            if not getattr(self, name) >= 0:
                raise FieldError(name, f"must be >= 0, got {getattr(self, name)}")
        if not self.result_retry_max_s >= self.result_retry_s:
            raise FieldError("result_retry_max_s", f"must be >= result_retry_s ({self.result_retry_s}), "
                                                   f"got {self.result_retry_max_s}")
        if not self.result_ttl_s >= 0:
            raise FieldError("result_ttl_s", f"must be >= 0, got {self.result_ttl_s}")
        for name, least in (("threads", 1), ("spare_workers", 0), ("cpu_devices", 1), ("max_round_leap", 1),
                            ("cache_bytes", 1 << 20)):
            if getattr(self, name) < least:
                raise FieldError(name, f"must be >= {least}, got {getattr(self, name)}")
        if self.emulate:
            try:
                parse_emulation(self.emulate)
            except ValueError as exc:
                raise FieldError("emulate", str(exc)) from None
        if self.emulate_reference is not None and self.emulate_reference not in GPU_TYPES:
            raise FieldError("emulate_reference", f"unknown GPU type {self.emulate_reference!r}; "
                                                  f"valid: {', '.join(GPU_TYPES)}")

    @property
    def group(self) -> str:
        return f"hadar-agent-{self.node_id}"

    @property
    def emulation(self) -> tuple[tuple[str, int], ...]:
        """The parsed ``emulate`` (empty: discover the devices)."""
        return parse_emulation(self.emulate) if self.emulate else ()
