"""msgpack decoding whose memory is bounded by the input's size, not by what it claims.

:func:`unpack` charges the Python objects msgpack builds as they are built -- each map
and array by ``sys.getsizeof`` plus :data:`ELEMENT_COST` per item (its slot and a fresh
scalar) -- against ``COST_PER_BYTE x len(data) + COST_SLACK`` and raises
:class:`TooCostly` once that is spent; no single array or map may hold more than
``max(65536, len(data) // 8)`` items; ext types are refused unread. Legitimate records
cost up to ~12x their size; hostile ones would reach ~70x unchecked.
"""

from __future__ import annotations

import sys

import msgpack

from shared.errors import HadarError

__all__ = ["COST_PER_BYTE", "COST_SLACK", "ELEMENT_COST", "TooCostly", "unpack", "cost"]

COST_PER_BYTE = 16
COST_SLACK = 64 * 1024
ELEMENT_COST = 40
MIN_CONTAINER_ITEMS = 1 << 16


class TooCostly(HadarError):
    """The objects built so far exceed the input's memory budget."""


def cost(container: dict | list) -> int:
    """What one completed map or array is charged (its items' own containers apart)."""
    return sys.getsizeof(container) + ELEMENT_COST * len(container)


def unpack(data: bytes) -> object:
    """``data`` decoded (str keys or bytes keys only, no ext types) within its budget.

    Raises :class:`TooCostly` past the budget, and whatever msgpack raises for bad input.
    """
    budget = COST_PER_BYTE * len(data) + COST_SLACK

    def charge(container: dict | list) -> dict | list:
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
