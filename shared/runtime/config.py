"""Build a service's frozen Config dataclass from defaults, a TOML file, the environment and flags.

``load_config(cls, flags=..., env=..., env_prefix="HADAR_TRACKER_", file=...)`` returns
``cls(**merged)``, where each init field of ``cls`` takes the value of the first source
that gives it, in this order (highest first):

1. ``flags``: a mapping of field name to value; ``None`` means "not given", so a CLI
   declares its flags with ``default=None``. Reported as ``--field-name``.
2. ``env`` (default ``os.environ``): the variable ``{env_prefix}{FIELD_NAME}`` (upper
   case), e.g. ``HADAR_TRACKER_FINISH_TIMEOUT_S``, or the name a field gives in its
   metadata, ``field(metadata={"env": "HADAR_NODE_ID"})``, for names older than the
   prefix. An empty variable counts as unset.
3. ``file``: a TOML file whose top-level keys are field names (one file per service);
   a dict field is a table. Reported as ``file.toml: field_name``.
4. The field's default. A field without one that no source gives is an error.

Values are converted by the field's annotation: ``int``, ``float`` (finite), ``str``,
``bool`` (``true/false/1/0/yes/no`` from text), ``Path``, ``Literal[...]``, ``X | None``
(a value converts as X; None itself is only the default), ``tuple[X, ...]``
(comma-separated in text, an array in TOML) and ``dict[str, X]`` (a JSON object in text,
a table in TOML). Text (the environment, or a str flag) is parsed; a typed value (TOML, a
typed flag) must already have the right type, apart from int for float.

Guarantees: every value any source gives is converted, also one a higher source
overrides, so a typo never hides; an unconvertible value, an unknown key in the file, an
unreadable file and a missing required field raise :class:`~shared.errors.ConfigError`
whose one-line message starts with the source (``--finish-timeout-s``,
``HADAR_TRACKER_FINISH_TIMEOUT_S``, ``tracker.toml: finish_timeout_s``). A Config's own
validation raises :class:`FieldError`, which ``load_config`` re-raises naming the source
the bad value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from shared.errors import ConfigError

__all__ = ["load_config", "FieldError", "add_config_arg", "env_name", "flag_name"]

T = TypeVar("T")

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


class FieldError(ConfigError):
    """A Config field holds an invalid value. The message starts with ``source`` (where the
    value came from, when known) or else the field's name; ``field`` and ``reason`` keep
    the parts."""

    def __init__(self, field: str, reason: str, *, source: str | None = None) -> None:
        super().__init__(f"{source or field}: {reason}")
        self.field = field
        self.reason = reason


def flag_name(field: str) -> str:
    """The CLI flag a field is set by: ``finish_timeout_s`` -> ``--finish-timeout-s``."""
    return "--" + field.replace("_", "-")


def env_name(f: dataclasses.Field[Any], env_prefix: str) -> str:
    """The variable a field is read from (see the module docstring)."""
    return str(f.metadata.get("env") or f"{env_prefix}{f.name.upper()}")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``: a TOML file of the service's settings (below env and flags)."""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML file of settings, top-level keys named as the flags with '_' "
                             "(environment variables and flags override it)")


def load_config(cls: type[T], *, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                env_prefix: str, file: str | Path | None = None) -> T:
    """``cls`` built from defaults < ``file`` < ``env`` < ``flags``; see the module docstring."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config needs a dataclass, got {cls!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def give(name: str, raw: Any, source: str) -> None:
        values[name] = _convert(raw, hints[name], source)
        sources[name] = source

    if file is not None:
        for name, raw in _read_toml(Path(file), fields).items():
            give(name, raw, f"{file}: {name}")
    environ = os.environ if env is None else env
    for name, f in fields.items():
        variable = env_name(f, env_prefix)
        if environ.get(variable):
            give(name, environ[variable], variable)
    for name, raw in (flags or {}).items():
        if name not in fields:
            raise TypeError(f"flags: {cls.__name__} has no field {name!r}")
        if raw is not None:
            give(name, raw, flag_name(name))

    missing = [n for n, f in fields.items() if n not in values and _required(f)]
    if missing:
        f = fields[missing[0]]
        raise ConfigError(f"{f.name}: required: pass {flag_name(f.name)}, set {env_name(f, env_prefix)} "
                          f"or put {f.name} in the config file")
    try:
        return cls(**values)
    except FieldError as exc:
        if exc.field not in sources:
            raise
        raise FieldError(exc.field, exc.reason, source=sources[exc.field]) from None


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _read_toml(path: Path, fields: Mapping[str, dataclasses.Field[Any]]) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (known: {', '.join(fields)})")
    return data


def _convert(value: Any, hint: Any, source: str) -> Any:
    """``value`` as ``hint``; ConfigError naming ``source`` when it cannot be."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"{source}: unsupported annotation {hint!r} (only X | None)")
        return _convert(value, inner[0], source)
    if origin is Literal:
        for option in args:
            if type(value) is type(option) and value == option:
                return option
            if isinstance(value, str) and str(option) == value.strip():
                return option
        raise _bad(source, "one of " + ", ".join(repr(o) for o in args), value)
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{source}: unsupported annotation {hint!r} (only tuple[X, ...])")
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, (list, tuple)):
            raise _bad(source, "a list", value)
        return tuple(_convert(item, args[0], f"{source}[{i}]") for i, item in enumerate(value))
    if origin is dict:
        return _convert_dict(value, args, source)
    if hint is Any:
        return value
    if hint is bool:
        return _convert_bool(value, source)
    if hint is int:
        return _convert_int(value, source)
    if hint is float:
        return _convert_float(value, source)
    if hint is str:
        if not isinstance(value, str):
            raise _bad(source, "a string", value)
        return value
    if hint is Path:
        if not isinstance(value, (str, Path)):
            raise _bad(source, "a path", value)
        return Path(value)
    raise TypeError(f"{source}: unsupported annotation {hint!r}")


def _convert_dict(value: Any, args: tuple[Any, ...], source: str) -> dict[str, Any]:
    if args and args[0] is not str:
        raise TypeError(f"{source}: unsupported annotation dict[{args[0]!r}, ...] (keys must be str)")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not a JSON object: {exc}") from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _bad(source, "a JSON object (a table in TOML)", value)
    item = args[1] if len(args) == 2 else Any
    return {k: _convert(v, item, f"{source}.{k}") for k, v in value.items()}


def _convert_bool(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise _bad(source, "true/false/1/0/yes/no", value)


def _convert_int(value: Any, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _bad(source, "an integer", value)


def _convert_float(value: Any, source: str) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None or not math.isfinite(number):
        raise _bad(source, "a finite number", value)
    return number


def _bad(source: str, expected: str, value: Any) -> ConfigError:
    shown = repr(value)
    return ConfigError(f"{source}: expected {expected}, got {shown if len(shown) <= 80 else shown[:77] + '...'}")
