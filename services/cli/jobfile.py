"""Job specs from users: YAML/JSON files and flags, validated before anything is published.

``parse_job(mapping)`` is the one path from user input to a ``JobSpec``: the CLI's
``submit`` and the demo both use it, and every error is a ``JobFileError`` whose message
names the offending field.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from shared.errors import UsageError
from shared.wire.events import Hyperparameters, InvalidEvent, JobSpec, UserCode

FIELDS = ("id", "user", "model", "dataset", "batch_size", "workers", "iterations", "priority",
          "deadline_s", "optimizer", "lr", "seed", "queue", "priority_class")
_INT_FIELDS = {"batch_size", "workers", "iterations", "seed", "priority_class"}
_FLOAT_FIELDS = {"priority", "deadline_s", "lr"}


class JobFileError(UsageError):
    """Bad job input; the message starts with the field name."""


MAX_JOB_FILE_BYTES = 64 * 1024   # a job is a dozen fields; anything larger is not a job file


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML or JSON job file; :class:`JobFileError` (one line, naming the
    file) for anything else: unreadable, over ``MAX_JOB_FILE_BYTES``, not UTF-8 text, not
    parseable (including nesting deep enough to exhaust the parser), or not a mapping. The
    size is checked before anything is parsed, so a huge file is refused at once."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as exc:
        raise JobFileError(f"file: cannot read {p}: {exc.strerror}") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise JobFileError(f"file: {p} is larger than {MAX_JOB_FILE_BYTES // 1024} KiB; a job file is a few lines")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise JobFileError(f"file: {p} is not UTF-8 text (byte {exc.start})") from None
    if "\x00" in text:
        raise JobFileError(f"file: {p} holds NUL characters; it is not a text file")
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        data = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise JobFileError(f"file: {p} is not valid {kind}: {first[:200]}") from None
    except RecursionError:
        raise JobFileError(f"file: {p} is not valid {kind}: nested too deeply") from None
    if not isinstance(data, dict):
        raise JobFileError(f"file: {p} must hold a mapping of job fields")
    return data


def _coerce(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise JobFileError(f"{name}: must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise JobFileError(f"{name}: must be an integer, got {value!r}") from None
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool):
            raise JobFileError(f"{name}: must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise JobFileError(f"{name}: must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise JobFileError(f"{name}: must be a string, got {value!r}")
    return value


def new_job_id(model: str) -> str:
    """``<model stem>-<12 random hex digits>``: 48 random bits, so ids generated anywhere
    do not collide in practice (a million ids: odds about 2e-3 of any one pair meeting).
    ``hadar submit`` also checks the log and draws again on a collision."""
    stem = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:40] or "job"
    return f"{stem}-{secrets.token_hex(6)}"


def parse_job(data: Mapping[str, Any], *, default_user: str = "anonymous", code: UserCode | None = None) -> JobSpec:
    """The JobSpec of a job file's fields. ``code``: the job runs that user code (its fields
    were split off and delivered by :mod:`services.cli.usercode`); ``model`` is then the
    user's label for it and ``dataset`` is filled in from the code's data. Without ``code``
    the model and dataset must be the zoo's."""
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise JobFileError(f"{unknown[0]}: unknown field; valid fields: {', '.join(FIELDS)}, and for your own "
                           "script code, entrypoint, args, config, data, hint")
    values = {k: _coerce(k, v) for k, v in data.items() if v is not None}
    if code is not None:
        values.setdefault("dataset", "-")
    for required in ("model", "dataset", "workers", "iterations"):
        if required not in values:
            raise JobFileError(f"{required}: required")
    try:
        hyper = Hyperparameters(**{k: values[k] for k in ("optimizer", "lr", "seed") if k in values})
        spec = JobSpec(
            job_id=values.get("id") or new_job_id(values["model"]), user=values.get("user", default_user),
            model=values["model"], dataset=values["dataset"], batch_size=values.get("batch_size", 32),
            workers=values["workers"], iterations=values["iterations"], priority=values.get("priority", 1.0),
            deadline_s=values.get("deadline_s"), hyper=hyper, queue=values.get("queue", ""),
            priority_class=values.get("priority_class", 0), code=code,
        )
    except InvalidEvent as exc:
        # "JobSpec.workers: must be ..." -> "workers: must be ..."
        raise JobFileError(exc.reason.split(".", 1)[-1] if exc.reason.startswith(("JobSpec.", "Hyperparameters."))
                           else exc.reason) from None
    if code is not None:
        return spec
    from shared.zoo import (
        validate_job,  # imports torch: only once the cheap checks passed
    )
    try:
        validate_job(spec)
    except ValueError as exc:
        raise JobFileError(f"{exc} (or run your own script: code: DIR, README \"Bring your own training code\")"
                           ) from None
    return spec
