"""Which output a failed copy's CopyFinished carries when several of its ranks failed.

A rank that hangs and is stopped at the deadline prints little; its peers, cut off in a
collective, print long tracebacks that say only "connection closed by peer". The user needs
the culprit's own words first, and the rest only where there is room.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.agent.daemon.failure_log import failed_copy_log_tail


def _failed(rank: int, tail: str) -> dict[str, object]:
    return {"event": "failed", "rank": rank, "reason": "x", "log_tail": tail}


def test_the_rank_that_failed_first_is_kept_even_when_a_peer_printed_more() -> None:
    culprit = "rank 1 never reaches the collective\n"
    peer = "[rank0]: RuntimeError: Connection closed by peer\n" * 200
    tail = failed_copy_log_tail([_failed(0, peer), _failed(1, culprit)], first_failed_rank=1, limit=4096)
    assert culprit.strip() in tail
    assert len(tail) <= 4096
    assert tail.index("rank 1") < tail.index("[rank0]"), "the culprit comes first"


def test_one_failed_rank_keeps_the_end_of_its_output() -> None:
    out = "".join(f"line {i}\n" for i in range(2000))
    tail = failed_copy_log_tail([_failed(0, out)], first_failed_rank=0, limit=100)
    assert len(tail) <= 100 and tail.endswith("line 1999\n")


def test_no_output_is_no_tail() -> None:
    assert failed_copy_log_tail([_failed(0, ""), {"event": "failed", "rank": 1, "reason": "x"}],
                                first_failed_rank=0, limit=4096) == ""


@given(st.lists(st.text(max_size=3000), min_size=1, max_size=4), st.integers(0, 3), st.integers(64, 4096))
def test_the_tail_fits_and_holds_the_end_of_the_culprits_output(outs: list[str], first: int, limit: int) -> None:
    finals = [_failed(rank, out) for rank, out in enumerate(outs)]
    tail = failed_copy_log_tail(finals, first_failed_rank=first, limit=limit)
    assert len(tail) <= limit
    culprit = outs[first] if first < len(outs) and outs[first] else next((o for o in outs if o), "")
    assert culprit[-(limit // 2):] in tail
