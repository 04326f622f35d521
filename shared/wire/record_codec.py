"""Compiled validation and wire conversion for :class:`shared.wire.records.Record` classes.

The typing rules live in one place: :func:`converter` turns an annotation into a closure
``(value, path) -> canonical value`` that accepts exactly what the rules accept and raises
:class:`~shared.wire.records.InvalidEvent` naming ``path`` otherwise. Everything else is
speed, never a second set of rules:

* per annotation, a test expression (:func:`shared.wire.record_compile.fast_test`) that is
  true only for a value the converter would return unchanged (an exact ``str`` of ASCII
  text, an exact ``int`` within 64 bits, a finite exact ``float``, ...). It may be false
  for a valid value -- the converter then decides -- but never true for one the
  converter refuses or would change. For values msgpack has just decoded it can be
  cheaper, since the decoder already guarantees UTF-8 text and 64-bit integers.
* :func:`codec` compiles, once per class, three functions from the record's fields
  (source text by :mod:`shared.wire.record_compile`): ``validate(record)`` (its
  ``__post_init__``: each field's test, else its converter, then the class's checks),
  ``from_wire(data, path, *outer)`` (a decoded map to a record, without a second pass
  through ``__init__``: unknown and missing fields, defaults, the same tests and
  converters, the same checks) and ``to_wire(record)`` (the map msgpack packs).

So an invalid record still cannot be built either way, and a decoded record equals the
one constructed from the same fields.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from shared.wire.record_compile import INT_MAX, INT_MIN, NAMES, Field, fast_test, source
from shared.wire.records import InvalidEvent, Record, short_repr

__all__ = ["Converter", "Codec", "codec", "converter", "explain_keys"]

Converter = Callable[[Any, str], Any]


# ---------------------------------------------------------------- the rules


def _str(value: Any, path: str) -> str:
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidEvent(f"{path}: not valid UTF-8 text") from None
        return value
    raise InvalidEvent(f"{path}: expected str, got {type(value).__name__}")


def _int(value: Any, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if not INT_MIN <= value <= INT_MAX:
            raise InvalidEvent(f"{path}: integer out of the 64-bit range")
        return value
    raise InvalidEvent(f"{path}: expected int, got {type(value).__name__}")


def _float(value: Any, path: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidEvent(f"{path}: must be a finite number, got {value!r}")
        return float(value)
    raise InvalidEvent(f"{path}: expected float, got {type(value).__name__}")


def _bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise InvalidEvent(f"{path}: expected bool, got {type(value).__name__}")


def _bytes(value: Any, path: str) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise InvalidEvent(f"{path}: expected bytes, got {type(value).__name__}")


_SCALARS: dict[Any, Converter] = {str: _str, int: _int, float: _float, bool: _bool, bytes: _bytes}
_CONVERTERS: dict[Any, Converter] = {}


def converter(hint: Any) -> Converter:
    """The converter of an annotation (built once per annotation): ``(value, path)`` to the
    value's canonical form -- tuples for sequences, plain dicts, ``float`` for an ``int``
    given as float, records from maps -- or :class:`InvalidEvent` naming ``path``."""
    conv = _CONVERTERS.get(hint)
    if conv is None:
        conv = _CONVERTERS[hint] = _SCALARS.get(hint) or _compound(hint)
    return conv


def _compound(hint: Any) -> Converter:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        def literal(value: Any, path: str) -> str:
            if isinstance(value, str) and value in args:
                return value
            raise InvalidEvent(f"{path}: must be one of {list(args)}, got {short_repr(value)}")
        return literal
    if origin in (types.UnionType, typing.Union):
        inner = converter(next(a for a in args if a is not type(None)))
        if type(None) not in args:  # pragma: no cover - a programming error in a record
            raise TypeError(f"unsupported union {hint!r}: only X | None")

        def optional(value: Any, path: str) -> Any:
            return None if value is None else inner(value, path)
        return optional
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:  # pragma: no cover
            raise TypeError(f"unsupported tuple {hint!r}: only tuple[X, ...]")
        return _sequence(args[0], hint)
    if origin is dict:
        if args[0] is not str:  # pragma: no cover
            raise TypeError(f"unsupported dict {hint!r}: only dict[str, X]")
        return _mapping(args[1], hint)
    if isinstance(hint, type) and issubclass(hint, Record):
        return _nested(hint)
    raise TypeError(f"unsupported annotation {hint!r}")  # pragma: no cover


def _sequence(item_hint: Any, hint: Any) -> Converter:
    item = converter(item_hint)
    fast = _predicate(fast_test(item_hint, "x"), f"all items {hint!r}")

    def sequence(value: Any, path: str) -> tuple[Any, ...]:
        if isinstance(value, (list, tuple)):
            if fast(value):   # every item already canonical: no per-item path to format
                return value if type(value) is tuple else tuple(value)
            return tuple([item(v, f"{path}[{i}]") for i, v in enumerate(value)])
        raise InvalidEvent(f"{path}: expected {_type_name(hint)}, got {type(value).__name__}")
    return sequence


def _mapping(value_hint: Any, hint: Any) -> Converter:
    item = converter(value_hint)
    fast = _predicate(f"type(k) is str and k.isascii() and {fast_test(value_hint, 'x') or 'False'}",
                      f"all items {hint!r}", pairs=True)

    def mapping(value: Any, path: str) -> dict[str, Any]:
        if isinstance(value, dict):
            if fast(value):
                return dict(value)   # a copy: the record must not share a caller's dict
            return {_str(k, f"{path} key"): item(v, f"{path}[{k!r}]") for k, v in value.items()}
        raise InvalidEvent(f"{path}: expected {_type_name(hint)}, got {type(value).__name__}")
    return mapping


def _nested(cls: type[Record]) -> Converter:
    if cls._WIRE_OUTER:  # pragma: no cover - a programming error in a record
        raise TypeError(f"{cls.__name__} has envelope fields and cannot be nested")

    def nested(value: Any, path: str) -> Record:
        if isinstance(value, cls):
            return value   # records are valid by construction
        if isinstance(value, dict):
            return codec(cls).from_wire(value, path)
        raise InvalidEvent(f"{path}: expected {cls.__name__}, got {type(value).__name__}")
    return nested


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


# ---------------------------------------------------------------- compiling


def _predicate(test: str | None, label: str, *, pairs: bool = False) -> Callable[[Any], bool]:
    """``all(test)`` over a sequence's items (``x``) or a map's pairs (``k``, ``x``)."""
    if test is None:
        return lambda _: False
    loop = "for k, x in value.items()" if pairs else "for x in value"
    source = (f"def test(value):\n    {loop}:\n        if not ({test}):\n"
              "            return False\n    return True\n")
    test_fn: Callable[[Any], bool] = _define(source, "test", dict(NAMES), label)
    return test_fn


def _define(source: str, name: str, namespace: dict[str, Any], label: str) -> Any:
    filename = f"<record_codec {label}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


# ---------------------------------------------------------------- per-class codecs


@dataclass(frozen=True)
class Codec:
    """A record class's compiled functions (see the module docstring)."""

    validate: Callable[[Record], None]
    from_wire: Callable[..., Record]   # (data, path, *values of the _WIRE_OUTER fields)
    to_wire: Callable[[Record], dict[str, Any]]


_CODECS: dict[type, Codec] = {}


def codec(cls: type[Record]) -> Codec:
    """The compiled codec of ``cls``, built on first use."""
    found = _CODECS.get(cls)
    if found is None:
        found = _CODECS[cls] = _compile(cls)
    return found


def explain_keys(cls: type[Record], data: dict[Any, Any], path: str, outer: tuple[str, ...]) -> None:
    """Raise the error for ``data``'s keys: an ``outer`` field (given apart, in the
    envelope) in it, else its first unknown key, else the first missing field by name."""
    inside = [k for k in outer if k in data]
    if inside:
        raise InvalidEvent(f"{path}: body must not contain envelope key {inside[0]!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise InvalidEvent(f"{path}: unknown field {short_repr(unknown[0])}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data) - set(outer))
    if missing:
        raise InvalidEvent(f"{path}: missing field {missing[0]!r}")
    raise AssertionError(f"{path}: explain_keys called for valid keys")  # pragma: no cover


_MISSING = object()


def _compile(cls: type[Record]) -> Codec:
    hints = typing.get_type_hints(cls)
    outer: tuple[str, ...] = tuple(cls._WIRE_OUTER)
    namespace: dict[str, Any] = {
        "_cls": cls, "_new": object.__new__, "_set": object.__setattr__, "_M": _MISSING,
        "_explain": explain_keys, "_outer": outer, "InvalidEvent": InvalidEvent, "_record_wire": _record_wire,
    }
    fields = []
    default: Literal["required", "value", "factory"]
    for i, f in enumerate(dataclasses.fields(cls)):
        namespace[f"_c{i}"] = converter(hints[f.name])
        if f.default_factory is not dataclasses.MISSING:
            namespace[f"_d{i}"], default = f.default_factory, "factory"
        elif f.default is not dataclasses.MISSING:
            namespace[f"_d{i}"], default = f.default, "value"
        else:
            default = "required"
        fields.append(Field(index=i, name=f.name, hint=hints[f.name], path=f"{cls.__name__}.{f.name}",
                            default=default, outer=outer.index(f.name) if f.name in outer else None))
    text = source(fields, tuple(cls._CHECKS))
    namespace.update(NAMES)   # after source(): it names the classes its tests compare with
    _define(text, "validate", namespace, cls.__qualname__)
    return Codec(validate=namespace["validate"], from_wire=namespace["from_wire"], to_wire=namespace["to_wire"])


def _record_wire(record: Record) -> dict[str, Any]:
    return codec(type(record)).to_wire(record)
