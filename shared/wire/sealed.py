"""The sealed record: an event's exact bytes, the identity that sealed them and a seal.

Kafka tells a consumer nothing about who produced a record, and one principal is shared by
every node (``agent``) and one by every user (``cli``), so their events carry their own
proof of authorship (:mod:`shared.security.authorship` makes and checks it). On the wire a sealed record is one
msgpack map of four keys, in this order::

    {"sealed": <bin: the event's envelope exactly as shared.wire.events.encode wrote it>,
     "by": "node/n1", "epoch": 1, "mac": <bin: 32 bytes (a node's HMAC) or 64 (a user's signature)>}

A plain event is a map of six keys (:mod:`shared.wire.events`), so the first byte tells the
two apart (``0x84`` against ``0x86``) before anything is unpacked.

Guarantees: :func:`unseal` returns None for every record that is not sealed (decode says
what is wrong with it), and for a sealed one either its four parts, each checked for type
and size, or :class:`~shared.wire.events.InvalidEvent` with the reason; it never raises
anything else. The MAC covers the inner bytes as they travel, so checking it needs no
re-encoding, and any change to them, to ``by`` or to ``epoch`` (each names the key) fails it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from shared.wire.events import MAX_WIRE_BYTES, Event, InvalidEvent, decode

__all__ = ["Sealed", "seal", "unseal", "open_unchecked", "SEAL_BYTES", "MAX_BY_CHARS"]

SEAL_BYTES = (32, 64)  # a node's HMAC-SHA256, a user's Ed25519 signature
MAX_BY_CHARS = 200     # "node/<node id>": node ids are at most 63 characters
_MARK = 0x84           # a fixmap of four entries: the first byte of every sealed record
_KEYS = ("sealed", "by", "epoch", "mac")
_pack: Callable[[object], bytes] = msgpack.Packer(use_bin_type=True).pack


@dataclass(frozen=True, kw_only=True, slots=True)
class Sealed:
    """A sealed record's parts: ``inner`` is an encoded event, not yet decoded nor trusted;
    ``mac`` its seal (a MAC or a signature)."""

    inner: bytes
    by: str
    epoch: int
    mac: bytes


def seal(inner: bytes, *, by: str, epoch: int, mac: bytes) -> bytes:
    """The sealed record of ``inner`` (an encoded event) made by ``by`` at key ``epoch``."""
    if len(mac) not in SEAL_BYTES or not by or len(by) > MAX_BY_CHARS or epoch < 1:
        raise ValueError("seal: a 32- or 64-byte seal, an identity of 1-200 characters and an epoch >= 1")
    return _pack({"sealed": inner, "by": by, "epoch": epoch, "mac": mac})


def unseal(data: bytes) -> Sealed | None:
    """The parts of a sealed record; None if ``data`` is not one. See the module guarantees."""
    if not data or data[0] != _MARK:
        return None
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, max_array_len=0,
                              max_map_len=4, max_str_len=MAX_BY_CHARS, max_bin_len=MAX_WIRE_BYTES)
    except Exception as exc:   # msgpack raises many types; all mean "not a sealed record"
        raise InvalidEvent(f"sealed record: not msgpack: {type(exc).__name__}"[:200]) from None
    if type(msg) is not dict or tuple(msg) != _KEYS:
        raise InvalidEvent(f"sealed record: expected the keys {', '.join(_KEYS)}")
    inner, by, epoch, mac = msg["sealed"], msg["by"], msg["epoch"], msg["mac"]
    if type(inner) is not bytes:
        raise InvalidEvent("sealed record: 'sealed' must be bytes")
    if type(by) is not str or not by:
        raise InvalidEvent("sealed record: 'by' must be a non-empty string")
    if type(epoch) is not int or epoch < 1:
        raise InvalidEvent("sealed record: 'epoch' must be an integer >= 1")
    if type(mac) is not bytes or len(mac) not in SEAL_BYTES:
        raise InvalidEvent("sealed record: 'mac' must be 32 or 64 bytes")
    return Sealed(inner=inner, by=by, epoch=epoch, mac=mac)


def open_unchecked(data: bytes) -> Event:
    """The event in ``data``, sealed or not, its seal unchecked: for readers that decide
    nothing on who wrote it (the CLI's views and replay, a bus without a verifier)."""
    sealed = unseal(data)
    return decode(sealed.inner if sealed is not None else data)
