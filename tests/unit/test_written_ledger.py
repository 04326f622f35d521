"""services/agent/worker/ledger.py: a node accepts at its checkpoint keys only what it wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.agent.worker.ledger import WrittenLedger, file_sha256, own_checkpoint


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_only_the_bytes_last_recorded_at_a_key_are_its_own(tmp_path: Path) -> None:
    ledger = WrittenLedger(tmp_path / "ledger")
    first = write(tmp_path / "a", b"first")
    assert not ledger.wrote("checkpoints/j/0/n0/0.safetensors", first)   # nothing recorded yet
    assert ledger.record("checkpoints/j/0/n0/0.safetensors", first) == file_sha256(first)
    assert ledger.wrote("checkpoints/j/0/n0/0.safetensors", first)
    assert not ledger.wrote("checkpoints/j/0/n0/1.safetensors", first)   # another key
    assert not ledger.wrote("checkpoints/j/0/n0/0.safetensors", write(tmp_path / "b", b"planted"))
    ledger.record("checkpoints/j/0/n0/0.safetensors", write(tmp_path / "c", b"second"))
    assert not ledger.wrote("checkpoints/j/0/n0/0.safetensors", first)   # the last write is the one
    assert WrittenLedger(tmp_path / "ledger").wrote("checkpoints/j/0/n0/0.safetensors", tmp_path / "c")   # on disk


def test_a_damaged_or_foreign_record_is_no_record(tmp_path: Path) -> None:
    ledger = WrittenLedger(tmp_path)
    data = write(tmp_path / "x.bin", b"x")
    ledger.record("k1", data)
    (record,) = tmp_path.glob("*.json")
    record.write_text("{not json")
    assert ledger.recorded("k1") is None and not ledger.wrote("k1", data)
    record.write_text(json.dumps({"key": "k2", "sha256": file_sha256(data)}))   # a record of another key
    assert ledger.recorded("k1") is None


def test_the_oldest_records_go_past_the_limit(tmp_path: Path) -> None:
    ledger = WrittenLedger(tmp_path / "l", max_records=3)
    data = write(tmp_path / "d", b"d")
    for i in range(5):
        ledger.record(f"k{i}", data)
        for j, path in enumerate(sorted((tmp_path / "l").glob("*.json"), key=os.path.getmtime)):
            os.utime(path, (j, j))   # keep the order of writing whatever the clock's resolution
    assert [ledger.recorded(f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]


class Store:
    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def exists(self, key: str) -> bool:
        return key in self.objects

    def get_file(self, key: str, path: Path) -> None:
        path.write_bytes(self.objects[key])


def test_own_checkpoint_reads_only_its_own_and_says_when_it_is_not(tmp_path: Path) -> None:
    ledger = WrittenLedger(tmp_path / "l")
    ledger.record("k", write(tmp_path / "mine", b"mine"))
    refused: list[str] = []
    read = Path.read_bytes
    assert own_checkpoint(Store({}), "k", ledger, read, lambda: refused.append("k")) is None and not refused
    assert own_checkpoint(Store({"k": b"mine"}), "k", ledger, read, lambda: refused.append("k")) == b"mine"
    assert own_checkpoint(Store({"k": b"planted"}), "k", ledger, read, lambda: refused.append("k")) is None
    assert refused == ["k"]
