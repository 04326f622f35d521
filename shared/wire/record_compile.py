"""Source text of a record class's compiled functions (bound and run by shared.wire.record_codec).

Nothing here decides what is valid: every generated test is a shortcut that may only
accept what the class's converters would keep unchanged (:func:`fast_test`), and every
other value goes to its converter, ``_c<i>`` in the generated code. The names the code
uses are listed in :data:`NAMES`; shared.wire.record_codec binds them.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from shared.wire.records import Record

__all__ = ["Field", "NAMES", "fast_test", "wire_test", "wire_expr", "class_name", "source"]

INT_MIN, INT_MAX = -(2**63), 2**64 - 1   # what msgpack can carry

# Names the generated tests use, besides the per-class ones (_c<i>, _d<i>, _cls, ...).
NAMES: dict[str, Any] = {"_isfinite": math.isfinite}


@dataclass(frozen=True)
class Field:
    """One field as the generator needs it: its converter is ``_c<index>`` and its default
    (value or factory) ``_d<index>``."""

    index: int
    name: str
    hint: Any
    path: str   # "Class.field", for the converter's reasons
    default: Literal["required", "value", "factory"]
    outer: int | None   # position in _WIRE_OUTER (given apart, as a parameter), else None


def fast_test(hint: Any, var: str, *, wire: bool = False) -> str | None:
    """A Python expression over ``var``, true only if the converter of ``hint`` would return
    the value unchanged; None where no cheap test exists (the converter always runs).

    With ``wire``, the value comes from msgpack: its ``str`` is valid UTF-8 and its
    ``int`` fits 64 bits, so those tests reduce to the exact type."""
    if hint is str:
        return f"type({var}) is str" if wire else f"(type({var}) is str and {var}.isascii())"
    if hint is int:
        return (f"type({var}) is int" if wire
                else f"(type({var}) is int and {INT_MIN} <= {var} <= {INT_MAX})")
    if hint is float:
        return f"(type({var}) is float and _isfinite({var}))"
    if hint is bool:
        return f"({var} is True or {var} is False)"
    if hint is bytes:
        return f"type({var}) is bytes"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal and all(type(a) is str for a in args):
        return f"(type({var}) is str and {var} in {tuple(args)!r})"
    if origin in (types.UnionType, typing.Union):
        inner = fast_test(next(a for a in args if a is not type(None)), var, wire=wire)
        return None if inner is None else f"({var} is None or {inner})"
    if isinstance(hint, type) and issubclass(hint, Record):
        return f"type({var}) is {class_name(hint)}"
    return None


def wire_test(hint: Any, var: str) -> str | None:
    """:func:`fast_test` for a value msgpack has just decoded."""
    return fast_test(hint, var, wire=True)


def class_name(cls: type) -> str:
    """The name generated code uses for ``cls`` (added to :data:`NAMES`)."""
    name = f"_cls_{cls.__module__.replace('.', '_')}_{cls.__qualname__.replace('.', '_')}"
    NAMES[name] = cls
    return name


def wire_expr(hint: Any, expr: str, depth: int = 0) -> str:
    """An expression for the msgpack form of ``expr`` (of type ``hint``): records become
    maps (``_record_wire``); tuples, dicts and scalars are packed as they are."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    item = f"x{depth}"
    if isinstance(hint, type) and issubclass(hint, Record):
        return f"_record_wire({expr})"
    if origin is tuple:
        inner = wire_expr(args[0], item, depth + 1)
        return expr if inner == item else f"[{inner} for {item} in {expr}]"
    if origin is dict:
        inner = wire_expr(args[1], item, depth + 1)
        return expr if inner == item else f"{{k{depth}: {inner} for k{depth}, {item} in {expr}.items()}}"
    if origin in (types.UnionType, typing.Union):
        inner = wire_expr(next(a for a in args if a is not type(None)), expr, depth)
        return expr if inner == expr else f"(None if {expr} is None else {inner})"
    return expr


def source(fields: list[Field], checks: tuple[str, ...]) -> str:
    """``validate(self)``, ``from_wire(data, path, *outer)`` and ``to_wire(self)``."""
    return "\n".join(_validate(fields, checks) + _from_wire(fields, checks) + _to_wire(fields)) + "\n"


def _validate(fields: list[Field], checks: tuple[str, ...]) -> list[str]:
    lines = ["def validate(self):"]
    for f in fields:
        test = fast_test(f.hint, "v") or "False"
        lines += [f"    v = self.{f.name}", f"    if not {test}: _set(self, {f.name!r}, _c{f.index}(v, {f.path!r}))"]
    return lines + [f"    self.{name}()" for name in checks]


def _from_wire(fields: list[Field], checks: tuple[str, ...]) -> list[str]:
    """A decoded map to a record. An event's map (it has outer fields) is its own: decode
    made it, so it becomes the record's ``__dict__`` (a third of the cost of filling a
    fresh one, ~250 bytes more). A nested record's map may be a caller's, so it is copied
    field by field into a fresh ``__dict__``."""
    inner = [f for f in fields if f.outer is None]
    outer = sorted((f for f in fields if f.outer is not None), key=lambda f: f.outer or 0)
    owned = bool(outer)
    explain = "_explain(_cls, data, path, _outer)"
    required = [f for f in inner if f.default == "required"]
    optional = [f for f in inner if f.default != "required"]
    lines = [f"def from_wire({', '.join(['data', 'path', *(f'v{f.index}' for f in outer)])}):",
             # What encode writes has every field: read them all at once.
             f"    if len(data) == {len(inner)}:", "        try:",
             *(f"            v{f.index} = data[{f.name!r}]" for f in inner),
             "            pass", "        except KeyError:", f"            {explain}", "    else:"]
    if optional:
        lines += ["        try:", *(f"            v{f.index} = data[{f.name!r}]" for f in required),
                  "            pass", "        except KeyError:", f"            {explain}",
                  f"        n = {len(required)}"]
        for f in optional:
            lines += [f"        v{f.index} = data.get({f.name!r}, _M)", f"        if v{f.index} is not _M: n += 1"]
        lines.append(f"        if len(data) != n: {explain}")
        for f in optional:
            default = f"_d{f.index}" + ("()" if f.default == "factory" else "")
            target = f"v{f.index} = data[{f.name!r}]" if owned else f"v{f.index}"
            lines.append(f"        if v{f.index} is _M: {target} = {default}")
    else:
        lines.append(f"        {explain}")
    lines.append("    try:")
    for f in fields:
        var = f"v{f.index}"
        target = f"data[{f.name!r}]" if owned and f.outer is None else var
        test = wire_test(f.hint, var) or "False"
        lines.append(f"        if not {test}: {target} = _c{f.index}({var}, {f.path!r})")
    lines.append("        self = _new(_cls)")
    if owned:
        lines += [*(f"        data[{f.name!r}] = v{f.index}" for f in fields if f.outer is not None),
                  "        _set(self, '__dict__', data)"]
    else:
        lines += ["        d = self.__dict__", *(f"        d[{f.name!r}] = v{f.index}" for f in fields)]
    return lines + [*(f"        self.{name}()" for name in checks),
                    "    except InvalidEvent:", "        raise",
                    "    except (TypeError, ValueError) as exc:  # never leak another error type",
                    "        raise InvalidEvent(f'{path}: {exc}') from None", "    return self"]


def _to_wire(fields: list[Field]) -> list[str]:
    items = [f"        {f.name!r}: {wire_expr(f.hint, f'self.{f.name}')}," for f in fields if f.outer is None]
    return ["def to_wire(self):", "    return {", *items, "    }"]
