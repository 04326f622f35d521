"""Peak memory of ``shared.wire.events.decode`` on hostile 1 MiB records, each in a fresh process.

Every payload is a well-formed envelope (type RoundStarted) whose body carries about
1 MiB of cheap-to-send, costly-to-build msgpack: empty maps, empty arrays, negative
fixints (ints outside CPython's small-int cache), flat or nested so that per-container
length limits alone cannot stop them. For each, a child process decodes it once and
reports its peak RSS growth (Linux ``VmHWM`` after the call, reset just before it via
``/proc/self/clear_refs``, minus ``VmRSS`` before) and what ``decode`` did.
A legitimate large record (a RoundStarted with 5,000 waiting jobs) is measured the same
way for comparison. Last output line: one JSON object.
Run: ``.venv/bin/python benchmarks/decode_memory.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20

_CHILD = r"""
import gc, sys, time
sys.path.insert(0, sys.argv[2])
from shared.wire.events import InvalidEvent, decode
def kib(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field)).split()[1])
data = open(sys.argv[1], "rb").read()
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before = kib("VmRSS:")
started = time.perf_counter()
try:
    decode(data)
    outcome = "decoded"
except InvalidEvent as exc:
    outcome = "InvalidEvent: " + exc.reason[:80]
seconds = time.perf_counter() - started
after = kib("VmHWM:")
print(before, after, round(seconds, 4), outcome, sep="\t")
"""


def _array_header(count: int) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big")


def _envelope(waiting: bytes) -> bytes:
    """A RoundStarted record, complete but for ``waiting``: raw msgpack spliced in."""
    import msgpack
    head = msgpack.packb({"type": "RoundStarted", "v": 1, "id": "x", "ts": 1.0, "source": "s"})
    fields = msgpack.packb({"round": 1, "policy": "hadar", "started_at": 1.0, "ends_at": 2.0})
    assert head[0] == 0x85 and fields[0] == 0x84  # fixmaps of 5 and 4 entries: one more each
    return (b"\x86" + head[1:] + msgpack.packb("body")
            + b"\x85" + fields[1:] + msgpack.packb("waiting") + waiting)


def payloads() -> dict[str, bytes]:
    from shared.wire.events import RoundStarted, Waiting, encode
    inner = 1 << 16
    outer = MIB // inner
    def nested(item):
        return _array_header(outer) + (_array_header(inner) + item * inner) * outer
    legit = RoundStarted(ts=1.0, source="scheduler", round=1, policy="hadar", started_at=1.0, ends_at=2.0,
                         waiting=tuple(Waiting(job_id=f"job-{i:05d}", code="no_gpu", detail="needs 4 x V100")
                                       for i in range(5000)))
    return {
        "empty_maps_flat": _envelope(_array_header(MIB) + b"\x80" * MIB),
        "empty_maps_nested": _envelope(nested(b"\x80")),
        "empty_arrays_nested": _envelope(nested(b"\x90")),
        "neg_fixints_nested": _envelope(nested(b"\xe0")),
        "legit_round_started": encode(legit),
    }


def main() -> None:
    import tempfile
    root = str(Path(__file__).resolve().parents[1])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in payloads().items():
            path = Path(tmp) / name
            path.write_bytes(data)
            out = subprocess.run([sys.executable, "-c", _CHILD, str(path), root], check=True,
                                 capture_output=True, text=True).stdout.strip()
            before, after, seconds, outcome = out.split("\t", 3)
            extra_mb = (int(after) - int(before)) / 1024
            results[name] = {"record_mb": round(len(data) / MIB, 2), "rss_extra_mb": round(extra_mb, 1),
                             "ratio": round(extra_mb * MIB / len(data), 1), "seconds": float(seconds),
                             "outcome": outcome}
            print(f"{name:22s} {len(data) / MIB:6.2f} MiB -> +{extra_mb:6.1f} MB RSS  "
                  f"{float(seconds) * 1000:7.1f} ms  {outcome}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
