"""What an Assignment may hand a worker: the checks an event cannot make about itself.

An :class:`~shared.wire.events.Assignment` is well-formed by construction; whether it is
plausible for *this* node *now* is decided here, before any process starts:

* ``deadline``: at most ``max_deadline_ahead_s`` (a day by default) from now. A worker waits
  for its start model and for its DDP peers until the deadline, so an absurd one would keep
  it polling for ever. (A deadline already passed makes the assignment stale, which the
  caller decides: that is normal in a replay, not an offence.)
* ``gpus``: distinct indices of this node's devices.
* ``ranks``: distinct (the event already checks one per GPU, each below the world size).
* ``rendezvous``: see :func:`rendezvous_problem`; it goes into ``init_method=tcp://...``.
* ``start_from``: the consolidated model, or a copy's checkpoint, of an earlier round of the
  same job (``models/{job}/{r}.safetensors`` or ``checkpoints/{job}/{r}/{c}.safetensors``
  with r < the assignment's round), so a copy never starts from another job's weights, a
  later round's or a key outside the layout. (The scheduler names consolidated models.)
  An evaluation copy (``evaluation``) starts from exactly the job's final model.

Every check returns a :class:`Problem` (a short ``code``, used as a metric label, and a
``detail`` naming the value) or None; nothing here raises or does I/O.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from shared.domain.layout import final_key, parse_checkpoint_key, parse_model_key
from shared.wire.events import Assignment

__all__ = ["Problem", "assignment_problem", "rendezvous_problem", "MIN_PORT", "MAX_PORT"]

MIN_PORT, MAX_PORT = 1024, 65535
# A DNS label, also with '_': the scheduler falls back to the node id as host, and node ids
# may hold underscores (resolvable through /etc/hosts, as such names are in practice).
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_PORT = re.compile(r"[1-9][0-9]{3,4}")
_DOTTED = re.compile(r"[0-9.]+")


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Why an assignment is refused: ``code`` (a small fixed vocabulary) and a readable detail."""

    code: str
    detail: str


def rendezvous_problem(text: str) -> str | None:
    """None if ``text`` is ``host:port``, else what is wrong with it.

    ``host`` is an IPv4 address, an IPv6 address in brackets (``[::1]``), or a host name of
    dot-separated labels (letters, digits, ``-``, ``_``; 1-63 characters, not starting or
    ending with ``-``; 253 at most in all) that is not a malformed dotted number; ``port`` is
    decimal without a sign or leading zero, in 1024-65535. Nothing else: no scheme, path,
    user, spaces or non-ASCII characters.
    """
    if not text.isascii() or not text.isprintable() or " " in text:
        return f"rendezvous {text!r}: must be printable ASCII without spaces"
    if "/" in text or "@" in text:
        return f"rendezvous {text!r}: host:port only (no scheme, path or user)"
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        return f"rendezvous {text!r}: must be host:port"
    if not _PORT.fullmatch(port) or not MIN_PORT <= int(port) <= MAX_PORT:
        return f"rendezvous {text!r}: port must be a number in {MIN_PORT}-{MAX_PORT}"
    problem = _host_problem(host)
    return f"rendezvous {text!r}: {problem}" if problem else None


def _host_problem(host: str) -> str | None:
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            return f"{host!r} is not an IPv6 address in brackets"
        return None
    if _DOTTED.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not an IPv4 address"
        return None
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in host.split(".")):
        return f"{host!r} is not a host name"
    return None


def assignment_problem(a: Assignment, *, gpus: AbstractSet[int], now: float,
                       max_deadline_ahead_s: float) -> Problem | None:
    """The first reason ``a`` must not run on a node with devices ``gpus`` at time ``now``; None if none."""
    if a.deadline > now + max_deadline_ahead_s:
        return Problem(code="deadline", detail=f"deadline {a.deadline:.0f} is {a.deadline - now:.0f} s ahead; "
                                               f"at most {max_deadline_ahead_s:.0f} s is plausible")
    unknown = sorted(set(a.gpus) - set(gpus))
    if unknown:
        return Problem(code="gpus", detail=f"GPU indices {unknown} are not on this node (it has {sorted(gpus)})")
    if len(set(a.gpus)) != len(a.gpus):
        return Problem(code="gpus", detail=f"GPU indices {list(a.gpus)} name a GPU twice")
    if len(set(a.ranks)) != len(a.ranks):
        return Problem(code="ranks", detail=f"ranks {list(a.ranks)} name a rank twice")
    if a.rendezvous is not None:
        problem = rendezvous_problem(a.rendezvous)
        if problem:
            return Problem(code="rendezvous", detail=problem)
    if a.evaluation:
        if a.start_from != final_key(a.job_id):
            return Problem(code="start_from", detail=f"an evaluation copy starts from {final_key(a.job_id)!r}, "
                                                     f"not {a.start_from!r}")
    elif a.start_from is not None:
        parsed = parse_model_key(a.start_from) or parse_checkpoint_key(a.start_from)
        if parsed is None or parsed.job_id != a.job_id or parsed.round >= a.round:
            return Problem(code="start_from", detail=f"start_from {a.start_from!r} is not a model or checkpoint "
                                                     f"of an earlier round of {a.job_id}")
    return None
