"""The control channel between the trusted harness and a user's trainer.

One JSON object per line, each at most :data:`MAX_LINE` bytes, over a socket the harness
passes to the trainer (``HADAR_SDK_FD``). Both ends use this module, and both treat what
they read as untrusted: :func:`decode` returns a well-formed :class:`Message` or raises
:class:`ProtocolError` (one line), never another exception.

Harness to trainer: ``round`` (what to train now; ``stop`` true: stopped before it starts,
train no step but save), ``stop`` (finish the current step, save, end the round), ``exit``
(no more rounds). Trainer to harness: ``hello`` (SDK version),
``progress`` (cumulative steps and samples of the round, last loss), ``metric`` (a held-out
figure of the start or final weights), ``saved`` (the round's state file is written),
``failed`` (the script raised).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_LINE", "ProtocolError", "Message", "encode", "decode", "TO_TRAINER", "TO_HARNESS"]

MAX_LINE = 64 * 1024
TO_TRAINER = frozenset({"round", "stop", "exit"})
TO_HARNESS = frozenset({"hello", "progress", "metric", "saved", "failed"})
_MAX_INT = 2**53   # exact in a float and in JSON everywhere


class ProtocolError(Exception):
    """A line that is not a well-formed message of the channel."""


@dataclass(frozen=True, kw_only=True)
class Message:
    op: str
    fields: dict[str, Any] = field(default_factory=dict)

    def integer(self, name: str, *, low: int = 0, high: int = _MAX_INT) -> int:
        value = self.fields.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ProtocolError(f"{self.op}.{name}: expected an integer in [{low}, {high}], got {_short(value)}")
        return value

    def number(self, name: str, *, optional: bool = False) -> float | None:
        value = self.fields.get(name)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ProtocolError(f"{self.op}.{name}: expected a finite number, got {_short(value)}")
        return float(value)

    def text(self, name: str, *, max_len: int = 256, optional: bool = False) -> str | None:
        value = self.fields.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, str) or len(value) > max_len:
            raise ProtocolError(f"{self.op}.{name}: expected text of at most {max_len} characters, "
                                f"got {_short(value)}")
        return value


def encode(op: str, **fields: Any) -> bytes:
    """One line for ``op`` and ``fields``; ProtocolError if a value is not finite JSON or the
    line is over :data:`MAX_LINE`."""
    try:
        line = json.dumps({"op": op, **fields}, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{op}: not encodable: {exc}") from None
    if len(line) > MAX_LINE:
        raise ProtocolError(f"{op}: message of {len(line)} bytes is over {MAX_LINE}")
    return line


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def decode(line: bytes, *, allowed: frozenset[str]) -> Message:
    """The message on ``line`` (without or with its newline), if its op is in ``allowed``."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line of {len(line)} bytes is over {MAX_LINE}")
    try:
        value = json.loads(line.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"not a JSON line: {type(exc).__name__}") from None
    if not isinstance(value, dict) or not isinstance(value.get("op"), str):
        raise ProtocolError("not a message: expected an object with an 'op'")
    op = value.pop("op")
    if op not in allowed:
        raise ProtocolError(f"unexpected message {_short(op)}")
    return Message(op=op, fields=value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
