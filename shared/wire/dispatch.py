"""One way to route an event to its handler: a per-consumer table, checked against its topics.

A consumer declares, once, which topics it reads and, for every event type that can
arrive on them, either a handler or that it ignores the type::

    class TrackerState:
        def _on_Progress(self, e: Progress) -> bool: ...
        ...
        HANDLERS: ClassVar[HandlerTable[Callable[[TrackerState, Any], bool]]] = HandlerTable(
            {Progress: _on_Progress, ...}, topics=(PROGRESS, ...), ignore=(...))

        def apply(self, event: Event) -> bool:
            handler = self.HANDLERS.handler_for(event)
            return handler(self, event) if handler is not None else False

Guarantees:

* Construction (so, for a table that is a module or class constant, importing its module)
  raises :class:`HandlerTableError` unless every event type that can arrive on ``topics``
  (:func:`shared.wire.topics.event_types_on`) is handled or explicitly ignored, exactly once,
  and no handled or ignored type is one that cannot arrive there. A new event type on a
  topic therefore breaks every consumer of that topic at import -- in the tests -- until
  each one decides what to do with it.
* :meth:`HandlerTable.handler_for` is one dict lookup by the event's exact class (event
  classes are final: there are no subclasses to match).
* The table calls nothing itself: a handler is whatever the consumer stores (typically
  the plain function of a method, called as ``handler(self, event)``), so its signature
  and return value are the consumer's own, and ``H`` states them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Generic, TypeVar

from shared.errors import HadarError
from shared.wire.events import EVENT_TYPES, Event
from shared.wire.topics import ALL_TOPICS, TOPIC_OF_TYPE, event_types_on

__all__ = ["HandlerTable", "HandlerTableError"]

H = TypeVar("H")


class HandlerTableError(HadarError):
    """A handler table that does not match its topics: a programming error, never retriable."""


class HandlerTable(Generic[H]):
    """Event class -> handler for one consumer, complete for the topics it reads."""

    def __init__(self, handlers: Mapping[type[Event], H], *, topics: Iterable[str],
                 ignore: Iterable[type[Event]] = ()) -> None:
        """Raise :class:`HandlerTableError` (naming each type and topic) on any mismatch."""
        self.topics = frozenset(topics)
        self.ignored = frozenset(ignore)
        self._handlers: Mapping[type[Event], H] = MappingProxyType(dict(handlers))
        problems = _problems(self.topics, frozenset(self._handlers), self.ignored)
        if problems:
            raise HandlerTableError("handler table does not match its topics: " + "; ".join(problems))

    @property
    def handled(self) -> frozenset[type[Event]]:
        return frozenset(self._handlers)

    def handler_for(self, event: Event) -> H | None:
        """The handler for ``event``'s type; None if the type is ignored.

        Also None for a type that cannot arrive on the topics (an event published to the
        wrong topic): that is the publisher's bug, and a consumer skips it rather than crash.
        """
        return self._handlers.get(type(event))


def _problems(topics: frozenset[str], handled: frozenset[type[Event]],
              ignored: frozenset[type[Event]]) -> list[str]:
    unknown_topics = topics - set(ALL_TOPICS)
    if unknown_topics:
        return [f"not a Hadar topic: {sorted(unknown_topics)}"]
    if not topics:
        return ["no topics"]
    problems = [f"{_name(cls)} is not an event type" for cls in sorted(handled | ignored, key=_name)
                if cls not in EVENT_TYPES.values()]
    if problems:
        return problems
    arriving = {EVENT_TYPES[name] for name in event_types_on(topics)}
    where = ", ".join(sorted(topics))
    for cls in sorted(handled & ignored, key=_name):
        problems.append(f"{cls.TYPE} is both handled and ignored")
    for cls in sorted(arriving - handled - ignored, key=_name):
        problems.append(f"no handler for {cls.TYPE} (arrives on {TOPIC_OF_TYPE[cls.TYPE]}): "
                        "handle it or ignore it explicitly")
    for cls in sorted((handled | ignored) - arriving, key=_name):
        verb = "handler" if cls in handled else "ignore entry"
        problems.append(f"{verb} for {cls.TYPE}, which travels on {TOPIC_OF_TYPE[cls.TYPE]}, "
                        f"not on the table's topics ({where})")
    return problems


def _name(cls: object) -> str:
    return getattr(cls, "__name__", repr(cls))
