"""JSON parsing for untrusted safetensors headers, bounded before and during the parse.

``json.loads`` on hostile text can recurse until RecursionError (deep nesting), spend
quadratic time on, or refuse with ValueError, a many-thousand-digit integer, and accepts
``NaN``, floats and duplicate keys that a header never has. :func:`load` closes each:

* Depth is checked on the raw bytes before parsing (bracket nesting outside strings,
  vectorised), so the parser never nests deeper than ``max_depth``.
* Integers of more than ``max_int_digits`` digits are refused before conversion; floats,
  ``NaN``/``Infinity`` literals and duplicate object keys are refused.
* Every failure is :class:`UnsafeJson` with a one-line ``reason``; nothing else escapes.
"""

from __future__ import annotations

import json

import numpy as np

from shared.errors import HadarError

__all__ = ["UnsafeJson", "load", "nesting_within"]

_QUOTE = ord('"')
_UNIFY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


class UnsafeJson(HadarError, ValueError):
    """Header text refused before or while parsing; ``reason`` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def load(raw: bytes, *, max_depth: int, max_int_digits: int) -> object:
    """The JSON value in ``raw`` (UTF-8), or :class:`UnsafeJson`."""
    if not nesting_within(raw, max_depth):
        raise UnsafeJson(f"header is not JSON nested at most {max_depth} deep: "
                         "its brackets nest deeper or do not match")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys,
                          parse_int=lambda text: _bounded_int(text, max_int_digits),
                          parse_float=_refuse_float, parse_constant=_refuse_constant)
    except UnsafeJson:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise UnsafeJson(f"header is not JSON: {exc}"[:200]) from None


def nesting_within(raw: bytes, max_depth: int) -> bool:
    """Whether brackets outside JSON strings nest at most ``max_depth`` deep and match up.

    Exact for valid JSON, and for invalid JSON up to the point where a parser would stop,
    so a parser given text that passes never recurses deeper. Escapes are removed first
    (``\\\\`` pairs, then ``\\"``: left to right, as JSON tokenises them), then quotes
    toggle "inside a string"; the brackets left outside are peeled one level per pass.
    """
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    inside = np.logical_xor.accumulate(text == _QUOTE)
    brackets = text[~inside].tobytes().translate(_UNIFY, _NOT_BRACKET)
    for _ in range(max_depth):
        # One non-overlapping left-to-right pass removes exactly the innermost level.
        brackets = brackets.replace(b"[]", b"")
    return not brackets


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise UnsafeJson(f"duplicate key {key[:60]!r}")
            seen.add(key)
    return result


def _bounded_int(text: str, max_digits: int) -> int:
    if len(text) - text.startswith("-") > max_digits:
        raise UnsafeJson(f"an integer of {len(text)} digits (at most {max_digits})")
    return int(text)


def _refuse_float(text: str) -> float:
    raise UnsafeJson(f"a non-integer number {text[:30]!r}")


def _refuse_constant(text: str) -> float:
    raise UnsafeJson(f"a non-standard JSON constant {text!r}")
