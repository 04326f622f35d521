"""``hadar consolidate``: the tracker's weight averaging, offline, on local files.

    hadar consolidate --out OUT.safetensors IN1.safetensors:STEPS IN2.safetensors:STEPS ... [--uniform] [--threads N]

Copy ids are the inputs' positions (0, 1, ...). ``--threads`` (default 1) only
changes the speed: the output is the same bytes whatever it is. Replicas that cannot be averaged are
named on stderr and left out; if none can be, or an argument is bad, one line and exit 2.
The output is written to a temporary file beside OUT and renamed over it when complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.tracker.averaging.consolidate import NoUsableReplica, consolidate_local
from services.tracker.config import default_consolidation_threads
from shared.errors import UsageError

__all__ = ["register", "parse_input"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("consolidate", help="average safetensors replicas into one model",
                            description="Average model replicas weighted by the steps each did "
                                        "(or uniformly), streaming one tensor at a time.")
    parser.add_argument("--out", required=True, type=Path, help="output .safetensors file")
    parser.add_argument("--uniform", action="store_true", help="weigh every replica equally")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads that average (default: 1; the output is the same whatever it is)")
    parser.add_argument("inputs", nargs="+", metavar="IN:STEPS",
                        help="a replica file and the steps it trained, e.g. copy0.safetensors:1200")
    parser.set_defaults(func=run)


def parse_input(text: str) -> tuple[Path, int]:
    """``PATH:STEPS`` -> (path, steps); UsageError when malformed or the file is absent."""
    path, sep, steps = text.rpartition(":")
    if not sep or not path:
        raise UsageError(f"{text!r}: expected PATH:STEPS")
    try:
        count = int(steps)
    except ValueError:
        raise UsageError(f"{text!r}: STEPS must be an integer, got {steps!r}") from None
    if count < 0:
        raise UsageError(f"{text!r}: STEPS must be >= 0")
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file")
    return Path(path), count


def run(args: argparse.Namespace) -> int:
    inputs = [parse_input(text) for text in args.inputs]
    threads = default_consolidation_threads() if args.threads is None else args.threads
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    out: Path = args.out
    if out.is_dir() or not (out.parent if str(out.parent) else Path(".")).is_dir():
        raise UsageError(f"--out {out}: not a file in an existing directory")
    if any(out.resolve() == path.resolve() for path, _ in inputs):
        raise UsageError(f"--out {out}: must not overwrite an input")
    try:
        plan, stats = consolidate_local(inputs, out, mode="uniform" if args.uniform else "steps",
                                        threads=threads)
    except NoUsableReplica as exc:
        raise UsageError(" ".join(str(exc).split())) from None
    except OSError as exc:
        raise UsageError(f"{type(exc).__name__}: {exc}") from None
    for rejected in plan.rejected:
        print(f"hadar consolidate: left out {inputs[rejected.copy][0]}: {rejected.reason}", file=sys.stderr)
    print(json.dumps({
        "out": str(out), "mode": plan.mode, "tensors": stats.tensors, "bytes_read": stats.bytes_read,
        "copies": [{"path": str(inputs[r.copy][0]), "steps": r.steps, "weight": r.weight}
                   for r in plan.accepted],
        "rejected": [{"path": str(inputs[r.copy][0]), "reason": r.reason} for r in plan.rejected],
    }))
    return 0
