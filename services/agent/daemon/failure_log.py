"""The output a failed copy's CopyFinished carries (``log_tail``) when several ranks failed.

When one rank fails, its peers fail after it: cut off in a collective, they print long
tracebacks that only say a peer went away, and the failing rank's own last words would be
pushed out of a tail taken from the first rank in order. So the rank that failed first (the
culprit) leads and keeps at least half of the room; its peers' tails follow, each under a
header, in what is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["failed_copy_log_tail"]


def failed_copy_log_tail(finals: Sequence[dict[str, Any] | None], *, first_failed_rank: int | None,
                         limit: int) -> str:
    """At most ``limit`` characters: the end of the culprit's output, then its peers'.

    The culprit is ``first_failed_rank`` when it printed anything, else the lowest failed rank
    that did. With a single rank that printed, its tail is returned bare; otherwise every section
    is headed by its rank and the culprit's keeps at least ``limit // 2`` characters.
    """
    outputs = [(int(f.get("rank", -1)), str(f.get("log_tail") or "")) for f in finals
               if f is not None and f.get("event") == "failed"]
    outputs = sorted((rank, text) for rank, text in outputs if text)
    if not outputs:
        return ""
    culprit = next((o for o in outputs if o[0] == first_failed_rank), outputs[0])
    peers = [o for o in outputs if o[0] != culprit[0]]
    if not peers:
        return culprit[1][-limit:]
    head = f"--- rank {culprit[0]}, the first to fail ---\n"
    room = limit // 2 - len(head) - 1   # the peers' share; 1 for the culprit's closing newline
    peer_text = ""
    for rank, text in peers:
        header = f"--- rank {rank} ---\n"
        if room - len(header) - 1 <= 0:
            break
        body = text[-(room - len(header) - 1):]
        section = header + body + ("" if body.endswith("\n") else "\n")
        peer_text += section
        room -= len(section)
    culprit_room = limit - len(head) - len(peer_text) - 1
    body = culprit[1][-culprit_room:]
    return head + body + ("" if body.endswith("\n") else "\n") + peer_text
