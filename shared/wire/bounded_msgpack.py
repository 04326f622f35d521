"""msgpack decoding whose memory is bounded by the input's size, not by what it claims.

:func:`unpack` charges the Python objects msgpack builds as they are built -- each map
and array by ``sys.getsizeof`` plus :data:`ELEMENT_COST` per item (its slot and a fresh
scalar) -- against ``COST_PER_BYTE x len(data) + COST_SLACK`` and raises
:class:`TooCostly` once that is spent; no single array or map may hold more than
``max(65536, len(data) // 8)`` items; ext types are refused unread. Legitimate records
cost up to ~12x their size; hostile ones would reach ~70x unchecked.

Inputs of at most :data:`UNCHARGED_MAX` bytes are decoded without the charging hooks
(which cost about as much as the decoding itself), because they cannot spend the budget:
by the accounting above, no input is charged more than 112 bytes per byte (see
:func:`unpack`), and ``UNCHARGED_MAX`` is sized with ``MAX_COST_PER_BYTE`` = 128.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack

from shared.errors import HadarError

__all__ = ["COST_PER_BYTE", "COST_SLACK", "ELEMENT_COST", "MAX_COST_PER_BYTE", "UNCHARGED_MAX",
           "TooCostly", "unpack", "cost"]

COST_PER_BYTE = 16
COST_SLACK = 64 * 1024
ELEMENT_COST = 40
MIN_CONTAINER_ITEMS = 1 << 16
# Upper bound on cost(unpackb(data)) / len(data), with a margin over the proven 112.
MAX_COST_PER_BYTE = 128
UNCHARGED_MAX = COST_SLACK // (MAX_COST_PER_BYTE - COST_PER_BYTE)   # 585 bytes


class TooCostly(HadarError):
    """The objects built so far exceed the input's memory budget."""


def cost(container: dict[Any, Any] | list[Any]) -> int:
    """What one completed map or array is charged (its items' own containers apart)."""
    return sys.getsizeof(container) + ELEMENT_COST * len(container)


def unpack(data: bytes) -> object:
    """``data`` decoded (str keys or bytes keys only, no ext types) within its budget.

    Raises :class:`TooCostly` past the budget, and whatever msgpack raises for bad input.

    Why inputs of at most UNCHARGED_MAX bytes need no charging: by induction, a value of
    b bytes is charged at most ``112b - 48`` in all (CPython 3.11 sizes). A scalar is
    charged 0 and has >= 1 byte. A list of k items is charged ``56 + 48k`` and has >= 1
    header byte besides its items, each of which brings its own ``-48``. A map of k pairs
    with m <= k distinct keys is charged ``getsizeof + 40m``, has >= 1 header byte and
    >= 1 byte per key besides its values: ``{}`` is 64 <= 112 - 48; one key "" (1 byte)
    is 184 + 40 <= 224; a bytes key takes >= 2 bytes for 224 + 40; each further key
    adds less than the 112 its >= 1 byte allows (dict tables grow by < 64 bytes per key).
    So an input of n bytes is charged < 112n <= 16n + 64 KiB when n <= 682, and
    UNCHARGED_MAX keeps a margin (MAX_COST_PER_BYTE). ``tests/unit/test_decode_limits.py``
    checks the worst shapes on the running interpreter.
    """
    if len(data) <= UNCHARGED_MAX:
        # Containers hold at most len(data) items here: unpackb's own default limit.
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)
    budget = COST_PER_BYTE * len(data) + COST_SLACK

    def charge(container: dict[Any, Any] | list[Any]) -> dict[Any, Any] | list[Any]:
        # Called as each map or array is completed, before its parent: the budget is
        # enforced while building, so the peak stays near it. Scalars in a container are
        # charged with it (hooks see no scalars), hence the per-item cost and the cap on
        # items per container.
        nonlocal budget
        budget -= cost(container)
        if budget < 0:
            raise TooCostly
        return container

    most_items = max(MIN_CONTAINER_ITEMS, len(data) // 8)
    return msgpack.unpackb(data, raw=False, strict_map_key=True, object_hook=charge, list_hook=charge,
                           max_array_len=most_items, max_map_len=most_items, max_ext_len=0)
