"""Queue files: the teams' queues an operator keeps in version control, as a QueueConfig.

A YAML (or JSON) mapping::

    default_queue: shared          # where jobs that name no queue go (must be listed)
    fair_share_half_life: 1d       # optional: s, m, h or d (default 1d)
    queues:
      vision:
        weight: 2                  # optional (default 1)
        quota: {a100: 8, v100: 4}  # optional: GPUs per type
        borrowing_limit: 8         # optional: GPUs beyond the quota it may borrow (default: any idle)
        user_max_gpus: 8           # optional
        user_max_queued: 20        # optional
      shared: {}

``parse_queues`` is the one path from such a file to a :class:`QueueConfig` (``hadar queues
apply`` and ``hadar sim --queues`` use it); every error is a :class:`QueueFileError` whose
one line names the file and the offending key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from shared.errors import UsageError
from shared.wire.events import InvalidEvent
from shared.wire.queues import QueueConfig, QueueSpec

__all__ = ["QueueFileError", "load_queue_file", "parse_queues", "MAX_QUEUE_FILE_BYTES"]

MAX_QUEUE_FILE_BYTES = 256 * 1024
_QUEUE_KEYS = ("weight", "quota", "borrowing_limit", "user_max_gpus", "user_max_queued")
_TOP_KEYS = ("default_queue", "fair_share_half_life", "queues")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class QueueFileError(UsageError):
    """A queue file that cannot be applied; the message names where."""


def load_queue_file(path: str | Path) -> QueueConfig:
    p = Path(path)
    try:
        raw = p.read_bytes()[:MAX_QUEUE_FILE_BYTES + 1]
    except OSError as exc:
        raise QueueFileError(f"{p}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_QUEUE_FILE_BYTES:
        raise QueueFileError(f"{p}: larger than {MAX_QUEUE_FILE_BYTES // 1024} KiB")
    try:
        text = raw.decode("utf-8-sig")
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise QueueFileError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first[:200]}") from None
    except RecursionError:
        raise QueueFileError(f"{p}: nested too deeply") from None
    return parse_queues(data, source=str(p))


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise QueueFileError(f"{where}: must be a whole number >= 0, got {value!r}")
    return value


def _duration_s(value: Any, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", str(value))
    if not match:
        raise QueueFileError(f"{where}: expected seconds or a number with s, m, h or d, got {value!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _queue(name: str, body: Any, source: str) -> QueueSpec:
    where = f"{source}: queues.{name}"
    if body is None:
        body = {}
    if not isinstance(body, Mapping):
        raise QueueFileError(f"{where}: must be a mapping of {', '.join(_QUEUE_KEYS)}")
    unknown = sorted(set(body) - set(_QUEUE_KEYS))
    if unknown:
        raise QueueFileError(f"{where}.{unknown[0]}: unknown key; valid: {', '.join(_QUEUE_KEYS)}")
    quota = body.get("quota") or {}
    if not isinstance(quota, Mapping):
        raise QueueFileError(f"{where}.quota: must map GPU types to counts, e.g. {{a100: 8}}")
    fields: dict[str, Any] = {"name": str(name), "quota": {str(t).lower(): _count(n, f"{where}.quota.{t}")
                                                           for t, n in quota.items()}}
    if "weight" in body:
        weight = body["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise QueueFileError(f"{where}.weight: must be a number, got {weight!r}")
        fields["weight"] = float(weight)
    for key in ("borrowing_limit", "user_max_gpus", "user_max_queued"):
        if body.get(key) is not None:
            fields[key] = _count(body[key], f"{where}.{key}")
    try:
        return QueueSpec(**fields)
    except InvalidEvent as exc:
        raise QueueFileError(f"{where}: {exc.reason.split(': ', 1)[-1]}") from None


def parse_queues(data: Any, *, source: str = "<queues>") -> QueueConfig:
    """The QueueConfig a queue file's mapping describes (module docstring)."""
    if not isinstance(data, Mapping):
        raise QueueFileError(f"{source}: must hold a mapping with {', '.join(_TOP_KEYS)}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise QueueFileError(f"{source}: {unknown[0]}: unknown key; valid: {', '.join(_TOP_KEYS)}")
    queues = data.get("queues")
    if not isinstance(queues, Mapping) or not queues:
        raise QueueFileError(f"{source}: queues: required, a mapping of queue names to their settings")
    specs = tuple(_queue(name, body, source) for name, body in queues.items())
    default = data.get("default_queue")
    if default is None:
        raise QueueFileError(f"{source}: default_queue: required (where jobs that name no queue go)")
    try:
        return QueueConfig(queues=specs, default_queue=str(default),
                           fair_share_half_life_s=_duration_s(data.get("fair_share_half_life", "1d"),
                                                              f"{source}: fair_share_half_life"))
    except InvalidEvent as exc:
        raise QueueFileError(f"{source}: {exc.reason.removeprefix('QueueConfig.')}") from None
