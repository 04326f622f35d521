"""What the daemon tells a worker subprocess, and what the worker tells it back.

The daemon writes a :class:`WorkerSpec` as one JSON line to the worker's stdin (stdin, not
argv: it carries the store's secret, and argv is visible to every user of the machine).
A warm worker keeps reading: its next spec, or a stop line
(:func:`stop_line`) for the copy it runs; stdin closed means exit. For each spec the
worker writes one JSON object per line to its stdout: ``started``, ``progress`` (about
every ``progress_s``), then exactly one of ``finished`` or ``failed`` (after ``failed``
the process exits). Nothing else is written there (the worker moves library output on
fd 1 to stderr).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.agent.daemon.validation import rendezvous_problem
from services.agent.worker.ledger import WrittenLedger, default_ledger_dir
from shared.domain.local_sgd import LocalSgd
from shared.store import LocalStore, MinioStore, ObjectStore
from shared.store.settings import S3Settings

__all__ = ["StoreTarget", "CodeTarget", "WorkerSpec", "worker_line", "parse_worker_line", "stop_line",
           "parse_stop_line"]


@dataclass(frozen=True, kw_only=True)
class StoreTarget:
    """Which store a worker opens: a local directory or an S3 endpoint."""

    kind: Literal["local", "s3"]
    root: str = ""
    s3: S3Settings | None = None

    @classmethod
    def local(cls, root: Path | str) -> StoreTarget:
        return cls(kind="local", root=str(root))

    @classmethod
    def remote(cls, settings: S3Settings) -> StoreTarget:
        return cls(kind="s3", s3=settings)

    def open(self) -> ObjectStore:
        if self.kind == "local":
            return LocalStore(Path(self.root))
        assert self.s3 is not None
        return MinioStore(self.s3)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "local":
            return {"kind": "local", "root": self.root}
        assert self.s3 is not None
        return {"kind": "s3", **dataclasses.asdict(self.s3)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoreTarget:
        if data.get("kind") == "local":
            return cls.local(data["root"])
        if data.get("kind") == "s3":
            fields = {k: data[k] for k in ("endpoint", "access_key", "secret_key", "bucket")}
            return cls.remote(S3Settings(**fields))
        raise ValueError(f"store: unknown kind {data.get('kind')!r}")


@dataclass(frozen=True, kw_only=True)
class CodeTarget:
    """A user's own code for a worker to run as a sandboxed child (the job's
    :class:`~shared.wire.events.UserCode` and where this node caches bundles)."""

    user: str
    digest: str
    size: int
    entrypoint: str
    args: tuple[str, ...] = ()
    config: str = ""
    data_digest: str = ""
    data_size: int = 0
    cache_dir: str = ""                # this node's bundle cache (services/agent/worker/artifacts.py)
    cache_bytes: int = 20 << 30
    sandbox: bool = True               # False: the operator's insecure opt-out (no Landlock)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CodeTarget:
        return cls(**{**data, "args": tuple(data.get("args", ()))})


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One worker's part of one job copy for one round (one DDP rank)."""

    job_id: str
    round: int
    copy: int
    node_id: str
    gpu_type: str                     # this worker's device type (checkpoint metadata)
    model: str
    dataset: str
    batch_size: int
    optimizer: str
    lr: float
    seed: int
    rank: int
    world_size: int
    rendezvous: str | None            # host:port of rank 0's store: train with DDP; None: plain loop
    device: Literal["cpu", "cuda"]
    step_budget: int                  # steps this round (the whole copy's; every rank does them)
    deadline: float                   # unix seconds: stop training at this time
    start_from: str | None            # store key of the model to start from; None: from seed
    checkpoint: str                   # store key to write; only rank 0 writes it
    store: StoreTarget
    slowdown: float = 1.0             # emulation: each step takes this many times its real time
    emulated: bool = False
    progress_s: float = 2.0
    threads: int = 1
    env: dict[str, str] = dataclasses.field(default_factory=dict)   # set before any CUDA call
    # forked copies' learning-rate recipe (shared/domain/local_sgd.py)
    local_sgd: LocalSgd = dataclasses.field(default_factory=LocalSgd)
    # the copy's layout, which a warm DDP rank is bound to (services/agent/slots.py):
    local_gpus: tuple[int, ...] = ()  # this node's GPUs of the copy, one per entry of local_ranks
    local_ranks: tuple[int, ...] = ()  # this node's ranks of the copy
    peers: tuple[str, ...] = ()       # the node of every rank, in rank order (empty: not known)
    code: CodeTarget | None = None     # a user's own code; None: the zoo's ``model`` on ``dataset``
    ledger_dir: str = ""               # what this node wrote at its checkpoint keys (worker/ledger.py; "": default)
    evaluation: bool = False           # Assignment.evaluation: measure start_from, train and upload nothing

    def ledger(self) -> WrittenLedger:
        """This node's record of what it wrote at its checkpoint keys."""
        return WrittenLedger(Path(self.ledger_dir) if self.ledger_dir else default_ledger_dir(self.node_id))

    def __post_init__(self) -> None:
        if self.world_size > 1 and not self.rendezvous:
            raise ValueError("WorkerSpec.rendezvous: required when world_size > 1")
        if self.rendezvous is not None and (problem := rendezvous_problem(self.rendezvous)):
            raise ValueError(f"WorkerSpec.{problem}")   # it becomes init_method=tcp://{rendezvous}
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"WorkerSpec.rank: {self.rank} not in 0..{self.world_size - 1}")
        if self.slowdown < 1.0:
            raise ValueError(f"WorkerSpec.slowdown: must be >= 1, got {self.slowdown}")
        if self.threads < 1 or self.progress_s <= 0:
            raise ValueError("WorkerSpec.threads must be >= 1 and progress_s > 0")
        if len(self.local_gpus) != len(self.local_ranks) or (self.peers and len(self.peers) != self.world_size):
            raise ValueError("WorkerSpec.local_gpus/local_ranks/peers: one GPU per local rank, one node per rank")

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["store"] = self.store.to_json()
        data["local_sgd"] = dataclasses.asdict(self.local_sgd)
        data["code"] = dataclasses.asdict(self.code) if self.code is not None else None
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        data["store"] = StoreTarget.from_json(data["store"])
        data["local_sgd"] = LocalSgd.from_json(data.get("local_sgd"))
        data["code"] = CodeTarget.from_json(data["code"]) if data.get("code") else None
        for name in ("local_gpus", "local_ranks", "peers"):
            data[name] = tuple(data.get(name, ()))
        return cls(**data)


def worker_line(kind: str, **fields: Any) -> str:
    """One protocol line (without the newline)."""
    return json.dumps({"event": kind, **fields}, allow_nan=False)


def parse_worker_line(line: str | bytes) -> dict[str, Any] | None:
    """A protocol message, or None for a line that is not one (ignored by the daemon)."""
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("event") not in ("started", "progress", "uploading", "not_ours",
                                                               "finished", "failed"):
        return None
    return data


def stop_line(copy: tuple[str, int, int]) -> str:
    """The control line asking a worker to stop ``copy`` (job, round, copy)."""
    return json.dumps({"stop": list(copy)})


def parse_stop_line(line: str) -> tuple[str, int, int] | None:
    """The copy a stop line names, or None if the line is not one (then it is a spec)."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    stop = data.get("stop") if isinstance(data, dict) else None
    if not (isinstance(stop, list) and len(stop) == 3):
        return None
    job, round_, copy = stop
    if not (isinstance(job, str) and isinstance(round_, int) and isinstance(copy, int)):
        return None
    return job, round_, copy
